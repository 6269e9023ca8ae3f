// The small per-layer ops of a decoder, each one pass over its data instead of a chain of ATen ops
// (on CPU at small batch, the per-op dispatch costs more than the arithmetic). float32 only; the Python
// side falls back to PyTorch for other dtypes. Rows are processed in parallel.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowGrain = 4;

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a float32 [rows, n] tensor with contiguous rows");
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

}  // namespace

// RMSNorm of each row of x: out = w * x / sqrt(mean(x^2) + eps). With `residual`: residual += x (in place)
// first and the norm is of residual - a decoder layer's residual add fused with the norm that follows it.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const bool add = residual.has_value() && residual->defined();
  if (add) {
    check_rows(*residual, "residual");
    TORCH_CHECK(x.sizes() == residual->sizes(), "x and residual must have the same shape");
  }
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = add ? residual->data_ptr<float>() : nullptr;
  const int64_t x_stride = x.stride(0), r_stride = add ? residual->stride(0) : 0;
  const float* wp = weight.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xp + r * x_stride;
      if (add) {
        float* res = rp + r * r_stride;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) res[i] += xr[i];
        xr = res;
      }
      norm_row(xr, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
  return out;
}

// gate_up: [rows, 2 * n] (gate then up) -> silu(gate) * up: [rows, n].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * gate_up.stride(0);
      const float* u = g + n;
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// Neox-style rotary embedding, in place: x is [T, heads, D] (any row stride, heads and D contiguous), cos and
// sin are [T, D/2]. Each head (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be float32 [T, heads, D] with contiguous heads");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  auto c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.scalar_type() == torch::kFloat && c.numel() == tokens * half && s.numel() == tokens * half);
  float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* ct = cp + t * half;
      const float* st = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + t * x.stride(0) + h * 2 * half;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], bb = x2[i];
          x1[i] = a * ct[i] - bb * st[i];
          x2[i] = bb * ct[i] + a * st[i];
        }
      }
    }
  });
}

#if defined(__AVX512F__)
namespace {

// y[r0 .. r0 + R) = W[r0 .. r0 + R) . x, R weight rows streamed together.
template <int R>
inline void dot_rows(const float* x, const float* w, float* y, int64_t r0, int64_t k) {
  const int64_t k16 = k - k % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k % 16)) - 1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k16; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + (r0 + r) * k + i), xv, acc[r]);
  }
  if (k16 < k) {
    const __m512 xv = _mm512_maskz_loadu_ps(tail, x + k16);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + (r0 + r) * k + k16), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) y[r0 + r] = _mm512_reduce_add_ps(acc[r]);
}

}  // namespace
#endif

// y = x W^T (+ b) for a single row x: [1, K], W: [N, K] float32. A batch-1 decode step is this product
// streaming every weight once; four weight rows per iteration keep enough loads in flight to run at the memory
// bandwidth (MKL's GEMV measured 5-10% slower on the decoder's matrices). Without AVX-512 it is at::linear.
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "float32 only");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x must be [1, K] and weight [N, K]");
#if defined(__AVX512F__)
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1);
  auto y = torch::empty({1, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n / 4, 16, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) dot_rows<4>(xp, wp, yp, g * 4, k);
  });
  for (int64_t r = n - n % 4; r < n; ++r) dot_rows<1>(xp, wp, yp, r, k);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
#else
  return at::linear(x, weight, bias);
#endif
}
