// Shared by the kernel sources: element types and their float conversions, dtype dispatch, the ISA this build
// targets. Every kernel computes in float32 registers whatever it reads or writes (float32, bfloat16, float16).
//
// The same sources are compiled once per instruction-set level with explicit -m flags (kernels/__init__.py):
// __AVX512BF16__ / __AVX512F__ / __AVX2__ select the hand-written paths; everything else is plain C++ loops
// under `#pragma omp simd` that the compiler vectorizes for the level it was given.
#pragma once

#include <torch/extension.h>

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

inline bool is_act_dtype(at::ScalarType t) { return t == torch::kFloat || t == torch::kBFloat16; }

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
