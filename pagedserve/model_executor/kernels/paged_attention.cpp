// Decode attention straight from the paged KV cache: no gathered or padded copy of any context.
//
// One task per sequence, all its query heads: each token's K/V row (every KV head) is one contiguous read, once
// per step; pass 1 scores all keys, pass 2 sums values weighted by the softmax. With fewer sequences than
// threads, each context is split into ranges whose partial softmaxes are merged after. Queries and output are
// float32 or bfloat16 (the model's dtype), accumulation float32, whatever the cache dtype (float32, bfloat16 or
// float16): a bfloat16 cache halves the bytes that decode attention streams.
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

using ps::bf16;
using ps::from_float;
using ps::to_float;

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += q[i] * to_float(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * to_float(x[i]);
}

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride;  // q_stride: per sequence
};

// Per head: the max score m, the sum l of exp(score - m) over n scores (overwritten by exp(score - m)).
inline void softmax_rows(float* scores, int64_t heads, int64_t n, float* m, float* l) {
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores + h * n;
    const float mx = *std::max_element(sc, sc + n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    m[h] = mx;
    l[h] = sum;
  }
}

// Unnormalised attention of all query heads of one sequence over its tokens [t0, t1): per head the max score m,
// the sum l of exp(score - m) and acc = sum of exp(score - m) * value. An empty range gives l = 0.
template <typename T>
void attend(const float* qf, const T* k_cache, const T* v_cache, const int64_t* table, int64_t t0, int64_t t1,
            const Shape& s, std::vector<float>& scores, float* acc, float* m, float* l) {
  const int64_t heads = s.num_heads, d = s.head_dim, group = s.num_heads / s.num_kv_heads;
  const int64_t row = s.num_kv_heads * d, n = t1 - t0;  // row: stride between consecutive token slots
  std::fill(acc, acc + heads * d, 0.f);
  std::fill(l, l + heads, 0.f);
  std::fill(m, m + heads, 0.f);
  if (n <= 0) return;
  scores.resize(heads * n);
  for (int64_t t = t0; t < t1; ++t) {  // each token's row holds every KV head: one contiguous read
    const T* k_row = k_cache + (table[t / s.block_size] * s.block_size + t % s.block_size) * row;
    for (int64_t h = 0; h < heads; ++h) scores[h * n + t - t0] = dot(qf + h * d, k_row + (h / group) * d, d);
  }
  softmax_rows(scores.data(), heads, n, m, l);
  for (int64_t t = t0; t < t1; ++t) {
    const T* v_row = v_cache + (table[t / s.block_size] * s.block_size + t % s.block_size) * row;
    for (int64_t h = 0; h < heads; ++h) axpy(scores[h * n + t - t0], v_row + (h / group) * d, acc + h * d, d);
  }
}

#if defined(__AVX512F__)
constexpr int64_t kChunk = 16;      // tokens scored together: one score per lane
constexpr float kNoScore = -1e30f;  // the running max before any token (finite: the kernel builds with -ffast-math)

// Scores of one query head against kChunk keys (k[i]: key i's head_dim values): lane i = q . k[i]. Every key
// is accumulated in its own register over head_dim, then the 16 registers are reduced together.
template <typename T>
inline __m512 score_chunk(const float* q, const T* const* k, int64_t offset, int64_t d) {
  __m512 acc[kChunk];
  for (int i = 0; i < kChunk; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __m512 qv = _mm512_loadu_ps(q + c);
    for (int i = 0; i < kChunk; ++i) acc[i] = _mm512_fmadd_ps(qv, ps::load16(k[i] + offset + c), acc[i]);
  }
  return ps::reduce16x16(acc);
}

#if defined(__AVX512BF16__)
// bfloat16 query and keys: VDPBF16PS multiplies 32 bfloat16 pairs exactly and accumulates in float32 (d % 32 == 0).
inline __m512 score_chunk_bf16(const bf16* q, const bf16* const* k, int64_t offset, int64_t d) {
  __m512 acc[kChunk];
  for (int i = 0; i < kChunk; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
    for (int i = 0; i < kChunk; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(k[i] + offset + c));
  }
  return ps::reduce16x16(acc);
}
#endif

// a[0 .. 16 NC) = alpha a + sum over the chunk's tokens i of p[i] v_i[offset ..]: NC independent FMA chains in
// registers (one long chain through memory would wait on its own latency every step).
template <int NC, typename T>
inline void accumulate_values(float* a, __m512 alpha, const float* p, const T* const* v_rows, int64_t offset,
                              int64_t n) {
  __m512 o[NC];
  for (int c = 0; c < NC; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), alpha);
  for (int64_t i = 0; i < n; ++i) {
    const __m512 pi = _mm512_set1_ps(p[i]);
    for (int c = 0; c < NC; ++c) o[c] = _mm512_fmadd_ps(pi, ps::load16(v_rows[i] + offset + 16 * c), o[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(a + 16 * c, o[c]);
}

// `attend` for head_dim % 16 == 0 on AVX-512: one pass over the tokens in chunks of 16 with an online softmax.
// Each chunk's K/V rows (every KV head) are read from memory once and stay in L1 while all query heads use them;
// a query head's 16 scores come out of one reduction tree; acc, m and l are rescaled once per chunk.
template <typename TQ, typename T>
void attend_avx512(const TQ* q, float scale, const T* k_cache, const T* v_cache, const int64_t* table, int64_t t0,
                   int64_t t1, const Shape& s, float* qf, float* acc, float* m, float* l) {
  const int64_t heads = s.num_heads, d = s.head_dim, group = s.num_heads / s.num_kv_heads;
  const int64_t row = s.num_kv_heads * d;
  for (int64_t i = 0; i < heads * d; ++i) qf[i] = to_float(q[i]);
  std::fill(acc, acc + heads * d, 0.f);
  std::fill(l, l + heads, 0.f);
  std::fill(m, m + heads, kNoScore);
  // Row pointers of a chunk's tokens; lanes past the end point at its first token again (scored, masked out).
  auto chunk_rows = [&](int64_t c0, int64_t n, const T** k_rows, const T** v_rows) {
    int64_t b = c0 / s.block_size, off = c0 % s.block_size;
    for (int64_t i = 0; i < kChunk; ++i) {
      const int64_t slot = (i < n ? table[b] * s.block_size + off : (k_rows[0] - k_cache) / row);
      k_rows[i] = k_cache + slot * row;
      v_rows[i] = v_cache + slot * row;
      if (++off == s.block_size) off = 0, ++b;
    }
  };
  const T* rows[2][2][kChunk];  // [current/next chunk][K/V][token]
  alignas(64) float p[kChunk];
  if (t0 < t1) chunk_rows(t0, std::min(kChunk, t1 - t0), rows[0][0], rows[0][1]);
  for (int64_t c0 = t0, cur = 0; c0 < t1; c0 += kChunk, cur ^= 1) {
    const int64_t n = std::min(kChunk, t1 - c0);
    const T* const* k_rows = rows[cur][0];
    const T* const* v_rows = rows[cur][1];
    if (c0 + kChunk < t1) {  // the blocks are scattered in memory: fetch the next chunk while this one computes
      const int64_t next_n = std::min(kChunk, t1 - c0 - kChunk);
      chunk_rows(c0 + kChunk, next_n, rows[cur ^ 1][0], rows[cur ^ 1][1]);
      for (int64_t i = 0; i < next_n; ++i)
        for (int64_t byte = 0; byte < row * static_cast<int64_t>(sizeof(T)); byte += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(rows[cur ^ 1][0][i]) + byte, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(rows[cur ^ 1][1][i]) + byte, _MM_HINT_T1);
        }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t offset = (h / group) * d;
      __m512 sc;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<TQ, bf16> && std::is_same_v<T, bf16>) {
        if (d % 32 == 0)
          sc = score_chunk_bf16(q + h * d, k_rows, offset, d);
        else
          sc = score_chunk(qf + h * d, k_rows, offset, d);
      } else
#endif
        sc = score_chunk(qf + h * d, k_rows, offset, d);
      sc = _mm512_mask_mov_ps(_mm512_set1_ps(kNoScore), valid, _mm512_mul_ps(sc, _mm512_set1_ps(scale)));
      const float m_new = std::max(m[h], _mm512_reduce_max_ps(sc));
      const float alpha = std::exp(m[h] - m_new);
      const __m512 pv = _mm512_maskz_mov_ps(valid, ps::exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
      l[h] = l[h] * alpha + _mm512_reduce_add_ps(pv);
      m[h] = m_new;
      _mm512_store_ps(p, pv);
      const __m512 av = _mm512_set1_ps(alpha);
      float* a = acc + h * d;
      int64_t c = 0;
      for (; c + 64 <= d; c += 64) accumulate_values<4>(a + c, av, p, v_rows, offset + c, n);
      switch ((d - c) / 16) {
        case 3: accumulate_values<3>(a + c, av, p, v_rows, offset + c, n); break;
        case 2: accumulate_values<2>(a + c, av, p, v_rows, offset + c, n); break;
        case 1: accumulate_values<1>(a + c, av, p, v_rows, offset + c, n); break;
        default: break;
      }
    }
  }
}
#endif

template <typename TQ, typename T>
void decode_kernel(const TQ* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, TQ* out, Shape s, float scale) {
  const int64_t heads = s.num_heads, d = s.head_dim;
  // Fewer sequences than threads (batch 1): split each context into `parts` ranges, one task each, and merge
  // the partial softmaxes after (as flash-decoding does); otherwise one task per sequence.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = s.num_seqs >= threads ? 1 : (threads + s.num_seqs - 1) / s.num_seqs;
  const int64_t num_tasks = s.num_seqs * parts;
  std::vector<float> part_acc(parts > 1 ? num_tasks * heads * d : 0), part_m(parts > 1 ? num_tasks * heads : 0),
      part_l(parts > 1 ? num_tasks * heads : 0);
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * d), acc(heads * d), m(heads), l(heads), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / parts, part = task % parts, len = context_lens[seq];
      const TQ* qs = q + seq * s.q_stride;
      float* a = parts > 1 ? part_acc.data() + task * heads * d : acc.data();
      float* mm = parts > 1 ? part_m.data() + task * heads : m.data();
      float* ll = parts > 1 ? part_l.data() + task * heads : l.data();
      const int64_t* table = block_tables + seq * s.max_blocks;
      const int64_t t0 = len * part / parts, t1 = len * (part + 1) / parts;
#if defined(__AVX512F__)
      if (d % 16 == 0) {
        attend_avx512(qs, scale, k_cache, v_cache, table, t0, t1, s, qf.data(), a, mm, ll);
      } else
#endif
      {
        for (int64_t i = 0; i < heads * d; ++i) qf[i] = to_float(qs[i]) * scale;
        attend(qf.data(), k_cache, v_cache, table, t0, t1, s, scores, a, mm, ll);
      }
      if (parts == 1) {
        for (int64_t h = 0; h < heads; ++h) {
          const float inv = 1.f / ll[h];
          TQ* o = out + (seq * heads + h) * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) o[i] = from_float<TQ>(a[h * d + i] * inv);
        }
      }
    }
  });
  if (parts == 1) return;
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    for (int64_t h = 0; h < heads; ++h) {
      float mx = 0.f;
      bool any = false;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t i = (seq * parts + p) * heads + h;
        if (part_l[i] > 0.f && (!any || part_m[i] > mx)) mx = part_m[i], any = true;
      }
      float denom = 0.f;
      std::vector<float> o(d, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t i = (seq * parts + p) * heads + h;
        if (part_l[i] == 0.f) continue;  // an empty range
        const float w = std::exp(part_m[i] - mx);
        denom += w * part_l[i];
        axpy(w, part_acc.data() + i * d, o.data(), d);
      }
      const float inv = 1.f / denom;
      TQ* dst = out + (seq * heads + h) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = from_float<TQ>(o[i] * inv);
    }
  }
}

}  // namespace

// q: [S, H, D] float32 or bfloat16 (heads contiguous, any stride between sequences: a view of the fused QKV
// output); k_cache, v_cache: [num_blocks, block_size, KVH, D] float32, bfloat16 or float16; block_tables:
// [S, max_blocks] int64; context_lens: [S] int64. Accumulates in float32; writes into `out` ([S, H, D], q's
// dtype, contiguous) when given; returns it.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> out_opt) {
  TORCH_CHECK(ps::is_act_dtype(q.scalar_type()) && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 or bfloat16 [S, H, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong);
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = out_opt.has_value() ? *out_opt : torch::empty(q.sizes(), q.options());
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.is_contiguous() && out.sizes() == q.sizes(),
              "out must be a contiguous tensor shaped like q, of q's dtype");
  const Shape s{q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), bt.size(1), q.stride(0)};
  const float sc = static_cast<float>(scale);
  const auto* tp = bt.data_ptr<int64_t>();
  const auto* lp = lens.data_ptr<int64_t>();
  ps::with_act_type(q.scalar_type(), [&](auto* qtag) {
    using TQ = std::remove_pointer_t<decltype(qtag)>;
    ps::with_cache_type(k_cache.scalar_type(), [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      decode_kernel<TQ, T>(ps::ptr<TQ>(q), ps::ptr<T>(k_cache), ps::ptr<T>(v_cache), tp, lp, ps::ptr<TQ>(out), s, sc);
    });
  });
  return out;
}

namespace {

template <typename TS, typename T>
void scatter_rows(const TS* src, int64_t src_stride, T* cache, const int64_t* slots, int64_t tokens, int64_t row) {
  at::parallel_for(0, tokens, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const TS* from = src + i * src_stride;
      T* to = cache + slots[i] * row;
      if constexpr (std::is_same_v<TS, T>) {
        std::memcpy(to, from, row * sizeof(T));
      } else {
#pragma omp simd
        for (int64_t j = 0; j < row; ++j) to[j] = from_float<T>(to_float(from[j]));
      }
    }
  });
}

}  // namespace

// k, v: [T, KVH, D] float32 or bfloat16 (heads contiguous, any stride between tokens); caches [num_blocks,
// block_size, KVH, D] float32, bfloat16 or float16; slot_mapping: [T] int64. Writes token i's K and V at slot
// slot_mapping[i], converted to the cache dtype (rounded to nearest even).
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  for (const auto& t : {k, v})
    TORCH_CHECK(ps::is_act_dtype(t.scalar_type()) && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2),
                "k and v must be float32 or bfloat16 [T, KVH, D] with contiguous heads");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.numel() == k.size(0));
  auto slots = slot_mapping.contiguous();
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  ps::with_act_type(k.scalar_type(), [&](auto* stag) {
    using TS = std::remove_pointer_t<decltype(stag)>;
    ps::with_cache_type(k_cache.scalar_type(), [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      scatter_rows(ps::ptr<TS>(k), k.stride(0), ps::ptr<T>(k_cache), sp, tokens, row);
      scatter_rows(ps::ptr<TS>(v), v.stride(0), ps::ptr<T>(v_cache), sp, tokens, row);
    });
  });
}

// layer_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> out);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
bool native_gemv();
const char* kernel_isa();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("out") = py::none());
  m.def("write_kv", &write_kv, "write new K/V rows (float32 or bfloat16) into the paged cache at their slots");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row ([rows, n] or [T, heads, n]); with residual: residual += x in "
        "place, then its RMSNorm; with out (may be x): written there (float32 or bfloat16)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("out") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] projection (float32 or bfloat16)");
  m.def("rotary_inplace", &rotary_inplace, "Neox-style rotary embedding in place (float32 or bfloat16)");
  m.def("gemv", &gemv, "x W^T (+ b) for one row x (float32 or bfloat16)", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
  m.def("native_gemv", &native_gemv, "whether gemv is the native kernel in this build (else at::linear)");
  m.def("isa", &kernel_isa, "the instruction-set level this build targets");
}
