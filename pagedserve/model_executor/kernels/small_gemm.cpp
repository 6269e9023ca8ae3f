// y = x W^T (+ b) for the few rows of a decode step (M up to ~16), on a weight packed once at load time.
//
// Why not oneDNN here: its bfloat16 brgemm is built for many rows; on the decoder's matrices at 8 rows it ran at
// ~1/3 of what the weights' streaming allows (BENCHMARKS.md section 6, "small-M GEMM"). This kernel reads every
// weight byte once per call and keeps all the step's rows in registers against it:
//   * packed layout: 16 output columns per block, K in order inside a block, so one 64-byte load is one k step
//     (float32: [N/16][K][16]) or one k pair (bfloat16: [N/16][K/2][16][2], VDPBF16PS's pair layout);
//   * a tile is MT rows x NB blocks of float32 accumulators (up to 8 x 3 = 24 of the 32 registers); each k step
//     loads NB weight vectors and broadcasts one x element (pair) per row: NB multiply-adds per broadcast;
//   * threads split the column blocks; a thread runs all row tiles over its blocks, the blocks staying in L2.
#include "vec.h"

#include <ATen/Parallel.h>

#include <type_traits>

using ps::bf16;

namespace {

#if defined(__AVX512F__)
constexpr int64_t kBlock = 16;  // output columns per packed block (one zmm of float32)
// k steps of each block stream prefetched ahead (512 bytes): +5-9% at 8-32 rows on Zen 4, none at 1 row (measured
// side by side over 30 SmolLM2-shaped layers; the hardware prefetcher alone left the streams short of bandwidth).
constexpr int64_t kPrefetchSteps = 8;

// Element type -> what one k step of the packed layout holds per column: 1 float or a pair of bf16.
template <typename T>
constexpr int64_t kStep = std::is_same_v<T, float> ? 1 : 2;

template <typename T>
inline __m512 madd(__m512 acc, __m512i w, const T* x);

template <>
inline __m512 madd<float>(__m512 acc, __m512i w, const float* x) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_set1_ps(*x), acc);
}

#if defined(__AVX512BF16__)
template <>
inline __m512 madd<bf16>(__m512 acc, __m512i w, const bf16* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
}
#endif

inline void store_row(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
#if defined(__AVX512BF16__)
inline void store_row(bf16* y, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

inline __m512 load_bias(const float* b, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, b); }
inline __m512 load_bias(const bf16* b, __mmask16 mask) { return ps::load16_tail(b, mask); }

// Rows [m0, m0 + MT) x blocks [b0, b0 + NB) of y.
template <typename T, int MT, int NB>
inline void tile(const T* x, int64_t m0, const T* w, const T* bias, T* y, int64_t n, int64_t k, int64_t b0) {
  const int64_t steps = k / kStep<T>, block_elems = steps * kBlock * kStep<T>;
  const T* wb = w + b0 * block_elems;
  __m512 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    for (int j = 0; j < NB; ++j)  // a hint only: past the block's end it touches the next one, never faults
      _mm_prefetch(reinterpret_cast<const char*>(wb + j * block_elems + (s + kPrefetchSteps) * kBlock * kStep<T>),
                   _MM_HINT_T0);
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm512_loadu_si512(wb + j * block_elems + s * kBlock * kStep<T>);
    for (int m = 0; m < MT; ++m) {
      const T* xs = x + (m0 + m) * k + s * kStep<T>;
      for (int j = 0; j < NB; ++j) acc[m][j] = madd<T>(acc[m][j], wv[j], xs);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t col = (b0 + j) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, n - col);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias != nullptr ? load_bias(bias + col, mask) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) store_row(y + (m0 + m) * n + col, _mm512_add_ps(acc[m][j], b), mask);
  }
}

// Every row tile over blocks [b0, b0 + NB).
template <typename T, int NB>
void rows_over_blocks(const T* x, int64_t rows, const T* w, const T* bias, T* y, int64_t n, int64_t k,
                      int64_t b0) {
  int64_t m = 0;
  for (; m + 8 <= rows; m += 8) tile<T, 8, NB>(x, m, w, bias, y, n, k, b0);
  switch (rows - m) {
    case 7: tile<T, 7, NB>(x, m, w, bias, y, n, k, b0); break;
    case 6: tile<T, 6, NB>(x, m, w, bias, y, n, k, b0); break;
    case 5: tile<T, 5, NB>(x, m, w, bias, y, n, k, b0); break;
    case 4: tile<T, 4, NB>(x, m, w, bias, y, n, k, b0); break;
    case 3: tile<T, 3, NB>(x, m, w, bias, y, n, k, b0); break;
    case 2: tile<T, 2, NB>(x, m, w, bias, y, n, k, b0); break;
    case 1: tile<T, 1, NB>(x, m, w, bias, y, n, k, b0); break;
    default: break;
  }
}

template <typename T>
void small_gemm_kernel(const T* x, int64_t rows, const T* w, const T* bias, T* y, int64_t n, int64_t k) {
  constexpr int64_t kGroup = 3;  // blocks per task: 3 x 8 accumulators + 3 weight vectors fit the registers
  const int64_t blocks = (n + kBlock - 1) / kBlock, groups = (blocks + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * kGroup, nb = std::min(kGroup, blocks - b0);
      if (nb == 3) rows_over_blocks<T, 3>(x, rows, w, bias, y, n, k, b0);
      else if (nb == 2) rows_over_blocks<T, 2>(x, rows, w, bias, y, n, k, b0);
      else rows_over_blocks<T, 1>(x, rows, w, bias, y, n, k, b0);
    }
  });
}
#endif  // __AVX512F__

// Which dtypes this build runs natively: float32 with AVX-512, bfloat16 with AVX512-BF16.
bool supports(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  return dtype == torch::kFloat || dtype == torch::kBFloat16;
#elif defined(__AVX512F__)
  return dtype == torch::kFloat;
#else
  (void)dtype;
  return false;
#endif
}

}  // namespace

// Whether small_gemm runs this dtype natively in this build and, given K (0: any), that K: bfloat16 packs K in pairs.
bool native_small_gemm(at::ScalarType dtype, int64_t k) {
  return supports(dtype) && (dtype == torch::kFloat || k % 2 == 0);
}

// [N, K] -> the packed blocks above (zero columns pad N to a multiple of 16). K must be even for bfloat16.
torch::Tensor pack_small_gemm_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && supports(weight.scalar_type()),
              "pack_small_gemm_weight: a 2-D weight of a dtype this build runs natively (native_small_gemm)");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(native_small_gemm(weight.scalar_type(), k), "pack_small_gemm_weight: bfloat16 needs an even K, got ", k);
  const int64_t step = weight.scalar_type() == torch::kFloat ? 1 : 2;
  const int64_t blocks = (n + 15) / 16;
  auto padded = torch::zeros({blocks * 16, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [B*16, K] -> [B, 16, K/step, step] -> [B, K/step, 16, step]
  return padded.view({blocks, 16, k / step, step}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor small_gemm(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == packed.scalar_type() && supports(x.scalar_type()),
              "small_gemm: x [M, K] of the packed weight's dtype");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(1) * packed.size(3) == x.size(1) &&
                  packed.size(0) * 16 >= n && packed.size(0) * 16 < n + 16,
              "small_gemm: packed weight does not match x [M, K] and N");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "small_gemm: bias [N]");
  auto y = torch::empty({x.size(0), n}, x.options());
#if defined(__AVX512F__)
  auto xc = x.contiguous();
  auto bc = has_bias ? bias->contiguous() : torch::Tensor();
  const auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    small_gemm_kernel<T>(ps::ptr<T>(xc), xc.size(0), ps::ptr<T>(packed), has_bias ? ps::ptr<T>(bc) : nullptr,
                         ps::ptr<T>(y), n, xc.size(1));
  };
  if (x.scalar_type() == torch::kFloat) run(static_cast<float*>(nullptr));
#if defined(__AVX512BF16__)
  else run(static_cast<bf16*>(nullptr));  // supports() let only float32 and bfloat16 through
#endif
#endif
  return y;
}
