// The small per-layer ops of a decoder, each one pass over its data instead of a chain of ATen ops
// (on CPU at small batch, the per-op dispatch costs more than the arithmetic).
// float32 or bfloat16 in and out, float32 arithmetic in registers: a bfloat16 model never round-trips through
// float32 tensors. Rows are processed in parallel.
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
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

// The gated activations of the form act(g) = g / (1 + e^z(g)), z clamped at 88 as exp16 clamps it (e^89 = inf made
// NaN under -ffast-math): silu, z = -g; gelu with the tanh approximation, z = -2y with y = sqrt(2/pi) (g + 0.044715
// g^3) (0.5 (1 + tanh y) = sigmoid(2y)).
struct Silu {
  static float z(float g) { return -g; }
#if defined(__AVX512F__)
  static __m512 z(__m512 g) { return _mm512_sub_ps(_mm512_setzero_ps(), g); }
#endif
};

struct GeluTanh {
  static constexpr float kA = -2.f * 0.7978845608028654f, kB = kA * 0.044715f;
  static float z(float g) { return g * (kA + kB * g * g); }
#if defined(__AVX512F__)
  static __m512 z(__m512 g) {
    return _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(kB), _mm512_set1_ps(kA)));
  }
#endif
};

// act(gate) * up per row of a fused [gate | up] projection.
template <typename Act, typename T>
void gated_mul_kernel(const T* gp, int64_t stride, T* op, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gp + r * stride;
      const T* u = g + n;
      T* o = op + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      // exp16, not std::exp: under `omp simd` GCC calls libmvec's expf, ~2.5 G elements/s per core
      for (; i + 16 <= n; i += 16) {
        const __m512 gv = ps::load16(g + i);
        const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), ps::exp16(Act::z(gv)));
        ps::store16(o + i, _mm512_mul_ps(_mm512_div_ps(gv, d), ps::load16(u + i)));
      }
#endif
#pragma omp simd
      for (int64_t j = i; j < n; ++j) {
        const float gf = to_float(g[j]);
        o[j] = from_float<T>(gf / (1.f + std::exp(std::min(Act::z(gf), 88.f))) * to_float(u[j]));
      }
    }
  });
}

// gate_up: [rows, 2 * n] (gate then up) -> act(gate) * up: [rows, n], same dtype.
template <typename Act>
torch::Tensor gated_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  ps::with_act_type(gate_up.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gated_mul_kernel<Act, T>(ps::ptr<T>(gate_up), gate_up.stride(0), ps::ptr<T>(out), rows, n);
  });
  return out;
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
torch::Tensor silu_and_mul(torch::Tensor gate_up) { return gated_and_mul<Silu>(gate_up); }

// The same with gelu_tanh(gate) (Gemma's GeGLU).
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) { return gated_and_mul<GeluTanh>(gate_up); }

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

// Each row's argmax, the first index on ties (as torch's max(dim)), in one pass: kLanes lanes each keep their
// largest value and its first index (strict >), then the lowest index among the lanes holding the row's maximum.
// NaN logits are not expected (the kernels build with -ffast-math). An all -inf row gives index 0, as torch does.
// bfloat16 logits are compared as the float32 values they convert to exactly: the same index, half the bytes read.
template <typename T>
void argmax_kernel(const T* logits, int64_t rows, int64_t n, int64_t stride, int64_t* out) {
#if defined(__AVX512F__)
  constexpr int64_t kLanes = 64;  // four independent compare-and-blend chains of 16: one would wait on its latency
#else
  constexpr int64_t kLanes = 16;
#endif
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* x = logits + r * stride;
      alignas(64) float best[kLanes];
      alignas(64) int32_t where[kLanes];
      const int64_t body = n - n % kLanes;
#if defined(__AVX512F__)
      __m512 best_v[4];
      __m512i where_v[4], index_v[4];
      for (int c = 0; c < 4; ++c) {
        best_v[c] = _mm512_set1_ps(-INFINITY);
        where_v[c] = _mm512_setzero_si512();
        index_v[c] = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32(16 * c));
      }
      const __m512i step = _mm512_set1_epi32(kLanes);
      for (int64_t i0 = 0; i0 < body; i0 += kLanes)
        for (int c = 0; c < 4; ++c) {
          const __m512 v = ps::load16(x + i0 + 16 * c);
          const __mmask16 more = _mm512_cmp_ps_mask(v, best_v[c], _CMP_GT_OQ);
          best_v[c] = _mm512_mask_mov_ps(best_v[c], more, v);
          where_v[c] = _mm512_mask_mov_epi32(where_v[c], more, index_v[c]);
          index_v[c] = _mm512_add_epi32(index_v[c], step);
        }
      for (int c = 0; c < 4; ++c) {
        _mm512_store_ps(best + 16 * c, best_v[c]);
        _mm512_store_si512(where + 16 * c, where_v[c]);
      }
#else
      for (int64_t j = 0; j < kLanes; ++j) best[j] = -INFINITY, where[j] = 0;
      for (int64_t i0 = 0; i0 < body; i0 += kLanes)
        for (int64_t j = 0; j < kLanes; ++j) {
          const float v = to_float(x[i0 + j]);
          const bool more = v > best[j];
          best[j] = more ? v : best[j];
          where[j] = more ? static_cast<int32_t>(i0 + j) : where[j];
        }
#endif
      float mx = best[0];
      for (int64_t j = 1; j < kLanes; ++j) mx = std::max(mx, best[j]);
      int64_t index = n;  // some lane always holds mx (every lane when the body is empty: -inf at index 0)
      for (int64_t j = 0; j < kLanes; ++j)
        if (best[j] == mx) index = std::min<int64_t>(index, where[j]);
      for (int64_t i = body; i < n; ++i)  // the tail's indices follow the body's: only a larger value wins
        if (to_float(x[i]) > mx) mx = to_float(x[i]), index = i;
      out[r] = index;
    }
  });
}

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(ps::is_act_dtype(logits.scalar_type()) && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "logits must be a float32 or bfloat16 [rows, n] tensor with contiguous rows, n > 0");
  auto out = torch::empty({logits.size(0)}, logits.options().dtype(torch::kLong));
  ps::with_act_type(logits.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    argmax_kernel(ps::ptr<T>(logits), logits.size(0), logits.size(1), logits.stride(0), out.data_ptr<int64_t>());
  });
  return out;
}

const char* kernel_isa() { return ps::isa_name(); }
