// Shared by the kernel sources: element types and their float conversions, dtype dispatch, the ISA this build
// targets. Every kernel computes in float32 registers whatever it reads or writes (float32, bfloat16, float16).
//
// The same sources are compiled once per instruction-set level with explicit -m flags (kernels/__init__.py):
// __AVX512BF16__ / __AVX512F__ / __AVX2__ select the hand-written paths; everything else is plain C++ loops
// under `#pragma omp simd` that the compiler vectorizes for the level it was given.
#pragma once

#include "torch_slice.h"

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ps {

using bf16 = uint16_t;  // bfloat16 read and written as its bits: conversions are shifts the compiler vectorizes

inline float to_float(float x) { return x; }
inline float to_float(bf16 bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// float -> element, rounding to nearest even (as c10::BFloat16 and PyTorch's .to(torch.bfloat16) do); NaN stays
// NaN. Integer arithmetic only, so it vectorizes and -ffast-math cannot change it.
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<bf16>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}
template <>
inline at::Half from_float<at::Half>(float x) { return static_cast<at::Half>(x); }

template <typename T>
inline T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Calls f with a null pointer of the element type of `dtype`: float32 and bfloat16 (activations, weights).
template <typename F>
void with_act_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case torch::kFloat: return f(static_cast<float*>(nullptr));
    case torch::kBFloat16: return f(static_cast<bf16*>(nullptr));
    default: TORCH_CHECK(false, "unsupported dtype ", dtype, " (float32 or bfloat16)");
  }
}

// The same for a KV cache, which may also be float16.
template <typename F>
void with_cache_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case torch::kFloat: return f(static_cast<float*>(nullptr));
    case torch::kBFloat16: return f(static_cast<bf16*>(nullptr));
    case torch::kHalf: return f(static_cast<at::Half*>(nullptr));
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", dtype);
  }
}

#if defined(__AVX512F__)
// 16 elements as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load16_tail(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// 16 float32 lanes stored as float32, or rounded to bfloat16 exactly as from_float<bf16> rounds one.
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0))));
}

// e^x per lane (Cephes' expf polynomial on [-ln2/2, ln2/2], scaled by 2^n with VSCALEFPS; relative error
// ~1e-7). x is clamped to [-100, 88]: e^-100 is below float32's normal range anyway.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 2^x per lane for the online softmax's exponents (x <= 0 up to rounding: a score's distance below the running
// max, in log2 units). x = n + r, n an integer and |r| <= 1/2 (exact), 2^r by a polynomial of degree Deg, times 2^n
// by VSCALEFPS. Deg 6: ~1e-7 relative, float32's own rounding; Deg 4: ~5e-6, for weights that are rounded to
// bfloat16 next (2^-9 relative). No clamp: a very negative x gives 0, and a masked lane's -1e30 gives r = 0, 2^n = 0.
template <int Deg = 6>
inline __m512 exp2_16(__m512 x) {
  static_assert(Deg == 4 || Deg == 6);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p;
  if constexpr (Deg == 6) {  // least-squares fits of 2^r on [-1/2, 1/2], relative error weighted
    p = _mm512_fmadd_ps(_mm512_set1_ps(1.5332507609855384e-4f), r, _mm512_set1_ps(1.3394701527431607e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618490934371948e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5503424257040024e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022647738456726f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931471824645996f));
  } else {
    p = _mm512_fmadd_ps(_mm512_set1_ps(9.55411046743393e-3f), r, _mm512_set1_ps(5.587037652730942e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402469664812088f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931280493736267f));
  }
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(Deg == 6 ? 1.f : 0.999999463558197f));
  return _mm512_scalef_ps(p, n);
}

// Transposes the 16 x 16 matrix of 32-bit elements whose row i is v[i], in place (lane i of v[j] becomes element j of
// the old row i): three levels of unpacks within 128-bit lanes, then two of 128-bit lane shuffles, 64 in all.
inline void transpose16x16(__m512i* v) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane L: rows 4k .. 4k+3 at column 4L + c in u[4k + c]
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i even01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), odd01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i even23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i odd23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    v[c] = _mm512_shuffle_i32x4(even01, even23, 0x88);
    v[8 + c] = _mm512_shuffle_i32x4(even01, even23, 0xDD);
    v[4 + c] = _mm512_shuffle_i32x4(odd01, odd23, 0x88);
    v[12 + c] = _mm512_shuffle_i32x4(odd01, odd23, 0xDD);
  }
}

// Lane i of the result = the sum of the lanes of v[i], for 16 vectors: a transpose-and-add tree (45 shuffles and
// adds in four independent levels) instead of 16 horizontal reductions, each a serial chain.
inline __m512 reduce16x16(const __m512* v) {
  __m512 u[8], w[4], z[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's partial sums of 4 vectors
    const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes summed in pairs
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

inline bool is_act_dtype(at::ScalarType t) { return t == torch::kFloat || t == torch::kBFloat16; }

// AMX tile shapes for LDTILECFG (palette 1): rows and bytes per row of each of the 8 tile registers.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if defined(__AVX512BF16__)
// LDTILECFG. The compiler does not know the instruction reads all 64 bytes of cfg: without the barrier GCC 12
// dropped the stores of rows and colsb as dead, and the first tile instruction faulted.
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
#endif

// Whether this build and CPU run products on AMX tiles: the small GEMM (2+ rows; bfloat16, and int8 weights where
// the CPU has AMX-INT8), bfloat16 prefill and decode attention (defined in small_gemm.cpp; set_amx_tiles turns them
// all off).
bool amx_tiles();

inline const char* isa_name() {
#if defined(__AVX512BF16__)
  return "avx512bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace ps
