// y = x W^T (+ b) for bfloat16 weights on CPUs without bfloat16 arithmetic (AVX2 without AVX512-BF16): the linear
// method's and the MoE experts' bfloat16 products where neither the native small GEMM (AVX512-BF16) nor oneDNN
// (whose bfloat16 path needs AVX-512) takes them.
//
// Why: there PyTorch's bfloat16 F.linear runs a dot product per output element, reading the whole weight once per
// row of x (16 rows: 16 passes over an LM head) at a fraction of the memory bandwidth. Here each weight element is
// read once per call for all the rows: 8 bfloat16 weights widened to float32 (a zero-extend and a shift: bfloat16 is
// float32's upper half) and multiplied into float32 accumulators against each row's float32 activations (x
// converted once per call), summed across the 8 lanes at the end of K. The weight stays in its checkpoint layout
// [N, K] (no packed copy); threads split the output columns.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

namespace {
#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kCols = 4;  // output columns per tile: their weight rows stream side by side
constexpr int64_t kRows = 3;  // rows of x per tile: 3 x 4 accumulators, a weight vector and x in 16 registers
constexpr int64_t kPrefetchTiles = 2;  // how far ahead (in column tiles) the weights are prefetched

inline __m256 widen8(const uint16_t* w) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Rows [m0, m0 + MT) x columns [n0, n0 + NC) of x W^T into acc_out[MT][NC] (float sums, before bias).
template <int MT, int NC>
void tile(const float* x, int64_t m0, const uint16_t* w, int64_t n0, int64_t k, float* acc_out) {
  __m256 acc[MT][NC];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NC; ++j) acc[m][j] = _mm256_setzero_ps();
  const uint16_t* wr = w + n0 * k;
  const float* xr = x + m0 * k;
  // The next tile's NC weight rows are the kPrefetchTiles-th NC * k values ahead, one contiguous run: a cache line
  // of it per 8 k here (8 bfloat16 of NC rows = NC x 16 bytes a step; NC * k * 2 bytes over k / 8 steps = 16 NC).
  // Without it a tile's NC interleaved short streams (an expert's 768-k rows are 1.5 KB) end before the hardware
  // prefetcher has ramped up: 4.6 GB/s on one thread against 7.9 for 2048-k rows.
  const char* ahead = reinterpret_cast<const char*>(wr + kPrefetchTiles * NC * k);
  for (int64_t s = 0; s < k; s += 8) {
    for (int p = 0; p < NC * 16; p += 64) _mm_prefetch(ahead + s * 2 * NC + p, _MM_HINT_T0);
    for (int j = 0; j < NC; ++j) {
      const __m256 wv = widen8(wr + j * k + s);
      for (int m = 0; m < MT; ++m) acc[m][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr + m * k + s), acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NC; ++j) acc_out[m * kCols + j] = sum8(acc[m][j]);
}

template <int NC>
void row_tile(const float* x, int64_t m0, int64_t rows, const uint16_t* w, int64_t n0, int64_t k, float* acc) {
  switch (rows) {
    case 3: tile<3, NC>(x, m0, w, n0, k, acc); break;
    case 2: tile<2, NC>(x, m0, w, n0, k, acc); break;
    default: tile<1, NC>(x, m0, w, n0, k, acc); break;
  }
}

template <typename T>
void gemm(const float* x, int64_t rows, const uint16_t* w, const T* bias, T* y, int64_t n, int64_t k) {
  const int64_t tiles = (n + kCols - 1) / kCols;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    float acc[kRows * kCols];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kCols, cols = std::min(kCols, n - n0);
      for (int64_t m0 = 0; m0 < rows; m0 += kRows) {  // the tile's weight rows stay in L1 across the row tiles
        const int64_t r = std::min(kRows, rows - m0);
        if (cols == kCols) row_tile<kCols>(x, m0, r, w, n0, k, acc);
        else
          for (int64_t j = 0; j < cols; ++j) row_tile<1>(x, m0, r, w, n0 + j, k, acc + j);
        for (int64_t m = 0; m < r; ++m)
          for (int64_t j = 0; j < cols; ++j) {
            const float b = bias != nullptr ? ps::to_float(bias[n0 + j]) : 0.f;
            y[(m0 + m) * n + n0 + j] = ps::from_float<T>(acc[m * kCols + j] + b);
          }
      }
    }
  });
}
#endif
}  // namespace

bool native_bf16_weight_gemm(int64_t k) {
#if defined(__AVX2__) && defined(__FMA__)
  return k % 8 == 0;
#else
  (void)k;
  return false;
#endif
}

torch::Tensor bf16_weight_gemm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && ps::is_act_dtype(x.scalar_type()), "bf16_weight_gemm: x [M, K] float32 or bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1), "bf16_weight_gemm: weight [N, K] bfloat16, contiguous");
  TORCH_CHECK(native_bf16_weight_gemm(x.size(1)), "bf16_weight_gemm: not in this build, or K not a multiple of 8");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == weight.size(0),
                "bf16_weight_gemm: bias [N] of x's dtype");
  const int64_t rows = x.size(0), n = weight.size(0);
  auto y = torch::empty({rows, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t k = x.size(1);
  const auto xf = x.to(torch::kFloat).contiguous();  // widened once; every column tile reads it
  const auto bc = has_bias ? bias->contiguous() : torch::Tensor();
  ps::with_act_type(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gemm<T>(ps::ptr<float>(xf), rows, reinterpret_cast<const uint16_t*>(weight.data_ptr()),
            has_bias ? ps::ptr<T>(bc) : nullptr, ps::ptr<T>(y), n, k);
  });
#endif
  return y;
}
