// The small per-layer ops of a decoder, each one pass over its data instead of a chain of ATen ops
// (on CPU at small batch, the per-op dispatch costs more than the arithmetic), and the batch-1 GEMV.
// float32 or bfloat16 in and out, float32 arithmetic in registers: a bfloat16 model never round-trips through
// float32 tensors. Rows are processed in parallel.
#include "vec.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

using ps::bf16;
using ps::from_float;
using ps::to_float;

namespace {

constexpr int64_t kRowGrain = 4;

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(ps::is_act_dtype(t.scalar_type()) && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a float32 or bfloat16 [rows, n] tensor with contiguous rows");
}

// Row r of a [rows, n] or [T, heads, n] view: rows are (t, h) pairs, r = t * heads + h.
struct Rows {
  int64_t heads, s0, s1;
  int64_t offset(int64_t r) const { return (r / heads) * s0 + (r % heads) * s1; }
};

template <typename T, typename TW>
void rms_norm_kernel(const T* xp, Rows xr_, T* rp, int64_t r_stride, const TW* wp, T* op, Rows or_, int64_t rows,
                     int64_t n, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = xp + xr_.offset(r);
      float ss = 0.f;
      if (rp != nullptr) {  // residual += x, rounded to the stream's dtype (as the PyTorch add_ does), then normed
        T* res = rp + r * r_stride;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          const T s = from_float<T>(to_float(res[i]) + to_float(xr[i]));
          res[i] = s;
          const float f = to_float(s);
          ss += f * f;
        }
        xr = res;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = op + or_.offset(r);  // may be x itself (in place): x[i] is read before o[i] is written
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(to_float(wp[i]) * (to_float(xr[i]) * inv));
    }
  });
}

template <typename T>
void silu_mul_kernel(const T* gp, int64_t stride, T* op, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gp + r * stride;
      const T* u = g + n;
      T* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float gf = to_float(g[i]);
        o[i] = from_float<T>(gf / (1.f + std::exp(-gf)) * to_float(u[i]));
      }
    }
  });
}

template <typename T, typename TC>
void rotary_kernel(T* xp, int64_t x_stride, const TC* cp, const TC* sp, int64_t tokens, int64_t heads,
                   int64_t half) {
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const TC* ct = cp + t * half;
      const TC* st = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = xp + t * x_stride + h * 2 * half;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(x1[i]), bb = to_float(x2[i]), c = to_float(ct[i]), s = to_float(st[i]);
          x1[i] = from_float<T>(a * c - bb * s);
          x2[i] = from_float<T>(bb * c + a * s);
        }
      }
    }
  });
}

}  // namespace

// RMSNorm of each row of x: out = w * x / sqrt(mean(x^2) + eps). x: [rows, n] or [T, heads, n] (Qwen3's per-head
// q/k norm), any strides but the last. With `residual` (2-D only): residual += x (in place) first and the norm is
// of residual - a decoder layer's residual add fused with the norm that follows it. With `out` (x's shape and
// dtype, may be x itself: an in-place norm), the result is written there; else into a new contiguous tensor.
// x, residual and out share a dtype (float32 or bfloat16); the weight is float32 or that dtype.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> out_opt) {
  TORCH_CHECK(ps::is_act_dtype(x.scalar_type()) && (x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
              "x must be a float32 or bfloat16 [rows, n] or [T, heads, n] tensor with contiguous rows");
  const bool add = residual.has_value() && residual->defined();
  if (add) {
    TORCH_CHECK(x.dim() == 2, "residual needs a 2-D x");
    check_rows(*residual, "residual");
    TORCH_CHECK(x.sizes() == residual->sizes() && x.scalar_type() == residual->scalar_type(),
                "x and residual must have the same shape and dtype");
  }
  const int64_t n = x.size(-1), heads = x.dim() == 3 ? x.size(1) : 1, rows = x.size(0) * heads;
  auto w = weight.contiguous();
  TORCH_CHECK(w.numel() == n && (w.scalar_type() == torch::kFloat || w.scalar_type() == x.scalar_type()),
              "weight must be [n], float32 or x's dtype");
  auto out = out_opt.has_value() && out_opt->defined() ? *out_opt : torch::empty(x.sizes(), x.options());
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && out.stride(-1) == 1,
              "out must be shaped like x, of x's dtype, with contiguous rows");
  const Rows xrows{heads, x.stride(0), x.dim() == 3 ? x.stride(1) : 0};
  const Rows orows{heads, out.stride(0), out.dim() == 3 ? out.stride(1) : 0};
  ps::with_act_type(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* rp = add ? ps::ptr<T>(*residual) : nullptr;
    const int64_t r_stride = add ? residual->stride(0) : 0;
    if (w.scalar_type() == torch::kFloat)
      rms_norm_kernel<T, float>(ps::ptr<T>(x), xrows, rp, r_stride, ps::ptr<float>(w), ps::ptr<T>(out), orows, rows,
                                n, static_cast<float>(eps));
    else
      rms_norm_kernel<T, T>(ps::ptr<T>(x), xrows, rp, r_stride, ps::ptr<T>(w), ps::ptr<T>(out), orows, rows, n,
                            static_cast<float>(eps));
  });
  return out;
}

// gate_up: [rows, 2 * n] (gate then up) -> silu(gate) * up: [rows, n], same dtype.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  ps::with_act_type(gate_up.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_kernel<T>(ps::ptr<T>(gate_up), gate_up.stride(0), ps::ptr<T>(out), rows, n);
  });
  return out;
}

// Neox-style rotary embedding, in place: x is [T, heads, D] (any row stride, heads and D contiguous), float32 or
// bfloat16; cos and sin are [T, D/2], float32 or x's dtype. Each head (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(ps::is_act_dtype(x.scalar_type()) && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be float32 or bfloat16 [T, heads, D] with contiguous heads");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  auto c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.numel() == tokens * half && s.numel() == tokens * half && c.scalar_type() == s.scalar_type() &&
              (c.scalar_type() == torch::kFloat || c.scalar_type() == x.scalar_type()),
              "cos and sin must be [T, D/2], float32 or x's dtype");
  ps::with_act_type(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (c.scalar_type() == torch::kFloat)
      rotary_kernel<T, float>(ps::ptr<T>(x), x.stride(0), ps::ptr<float>(c), ps::ptr<float>(s), tokens, heads, half);
    else
      rotary_kernel<T, T>(ps::ptr<T>(x), x.stride(0), ps::ptr<T>(c), ps::ptr<T>(s), tokens, heads, half);
  });
}

#if defined(__AVX512F__)
namespace {

// y[0 .. R) = W[0 .. R) . x (w points at the first of R weight rows, streamed together; float32).
template <int R>
inline void dot_rows(const float* x, const float* w, float* y, int64_t k) {
  const int64_t k16 = k - k % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k % 16)) - 1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k16; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * k + i), xv, acc[r]);
  }
  if (k16 < k) {
    const __m512 xv = _mm512_maskz_loadu_ps(tail, x + k16);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + r * k + k16), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

#if defined(__AVX512BF16__)
// bfloat16 weights and x: VDPBF16PS multiplies 32 bf16 pairs exactly and accumulates in float32.
template <int R>
inline void dot_rows(const bf16* x, const bf16* w, float* y, int64_t k) {
  const int64_t k32 = k - k % 32;
  const __mmask32 tail = static_cast<__mmask32>((k % 32) == 0 ? 0u : (1u << (k % 32)) - 1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k32; i += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * k + i), xv);
  }
  if (k32 < k) {
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k32);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * k + k32), xv);
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}
#else
// bfloat16 weights and x on AVX-512 without BF16: widen 16 at a time (a shift) and FMA in float32.
using ps::load16;
using ps::load16_tail;
template <int R>
inline void dot_rows(const bf16* x, const bf16* w, float* y, int64_t k) {
  const int64_t k16 = k - k % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k % 16)) - 1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k16; i += 16) {
    const __m512 xv = load16(x + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(load16(w + r * k + i), xv, acc[r]);
  }
  if (k16 < k) {
    const __m512 xv = load16_tail(x + k16, tail);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(load16_tail(w + r * k + k16, tail), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

template <typename T>
void gemv_kernel(const T* xp, const T* wp, const T* bp, T* yp, int64_t n, int64_t k) {
  // float32 partial results, rounded once per output (bias added in float32 first)
  at::parallel_for(0, (n + 3) / 4, 16, [&](int64_t b, int64_t e) {
    float acc[4];
    for (int64_t g = b; g < e; ++g) {
      const int64_t r0 = g * 4, rows = std::min<int64_t>(4, n - r0);
      if (rows == 4) {
        dot_rows<4>(xp, wp + r0 * k, acc, k);
      } else {
        for (int64_t r = 0; r < rows; ++r) dot_rows<1>(xp, wp + (r0 + r) * k, acc + r, k);
      }
      for (int64_t r = 0; r < rows; ++r)
        yp[r0 + r] = from_float<T>(acc[r] + (bp != nullptr ? to_float(bp[r0 + r]) : 0.f));
    }
  });
}

}  // namespace
#endif

// y = x W^T (+ b) for a single row x: [1, K], W: [N, K], float32 or bfloat16 (all three the same dtype). A batch-1
// decode step is this product streaming every weight once; four weight rows per iteration keep enough loads in
// flight to run at the memory bandwidth (MKL's GEMV measured 5-10% slower on the decoder's matrices). The bfloat16
// version is not used by the model by default (layers.py: oneDNN measured as fast or faster once the weights
// stream from memory) but kept, tested, for the A/B script. Without AVX-512 it is at::linear.
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(ps::is_act_dtype(x.scalar_type()) && weight.scalar_type() == x.scalar_type(),
              "x and weight: float32 or bfloat16, the same dtype");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x must be [1, K] and weight [N, K]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == weight.size(0));
#if defined(__AVX512F__)
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto bc = has_bias ? bias->contiguous() : torch::Tensor();
  const int64_t n = wc.size(0), k = wc.size(1);
  auto y = torch::empty({1, n}, x.options());
  ps::with_act_type(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gemv_kernel<T>(ps::ptr<T>(xc), ps::ptr<T>(wc), has_bias ? ps::ptr<T>(bc) : nullptr, ps::ptr<T>(y), n, k);
  });
  return y;
#else
  return at::linear(x, weight, bias);
#endif
}

// Whether gemv() is the native kernel in this build (else it is at::linear).
bool native_gemv() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

const char* kernel_isa() { return ps::isa_name(); }
