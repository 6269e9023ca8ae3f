// The vector steps that decode and prefill attention share (AVX-512 builds): chunks of 16 keys, the online
// softmax's weights and updates, the value sums in float32, and on AVX512-BF16 the value sums on bfloat16 pairs
// (VDPBF16PS or AMX tiles); and on every build what a layer may add to plain attention (AttentionExtras: a sliding
// window, Gemma 2's logit soft cap, gpt-oss's sinks).
#pragma once

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

namespace ps {
// Internal linkage, as when these steps lived in one file with the kernels: each kernel file gets its own copy,
// inlined and specialised as before (as inline functions with external linkage, GCC left more of them as calls:
// bfloat16 decode attention took 1.06-1.10x its time).
namespace {

// What a layer's attention adds to plain softmax attention (the default adds nothing).
struct AttentionExtras {
  int64_t window = 0;            // > 0: the query at position p sees keys p - window + 1 .. p only (a sliding layer)
  float soft_cap = 0.f;          // > 0: each scaled score s becomes soft_cap tanh(s / soft_cap) (Gemma 2)
  const float* sinks = nullptr;  // per query head: a logit in the softmax's denominator that adds no value (gpt-oss)
};

// The factor that turns query head h's value sum into its output, from its online softmax's max m (of the scaled
// scores) and sum l of exp(score - m): 1 / l, or with a sink 1 / (l + exp(sink - m)), taken about max(m, sink) so
// that neither exponent overflows.
inline float output_factor(const AttentionExtras& x, int64_t h, float m, float l) {
  if (x.sinks == nullptr) return 1.f / l;
  const float top = std::max(m, x.sinks[h]), a = std::exp(m - top);
  return a / (l * a + std::exp(x.sinks[h] - top));
}

// The extras of an attention call, checked: sinks (when given) one float32 logit per query head. Holds a pointer
// into `sinks`: the caller keeps the tensor alive (contiguous) for the call.
inline AttentionExtras attention_extras(int64_t window, double soft_cap, const c10::optional<torch::Tensor>& sinks,
                                        int64_t num_heads) {
  AttentionExtras x{window, static_cast<float>(soft_cap), nullptr};
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == torch::kFloat && sinks->dim() == 1 && sinks->size(0) == num_heads &&
                sinks->is_contiguous(), "sinks must be a contiguous float32 [num_heads] tensor");
    x.sinks = sinks->data_ptr<float>();
  }
  return x;
}

#if defined(__AVX512F__)
constexpr int64_t kChunk = 16;      // tokens scored together: one score per lane
constexpr float kNoScore = -1e30f;  // the running max before any token (finite: the kernel builds with -ffast-math)

// For NR rows r at once: a[r][c .. c + 16 NC) = alpha[r] a[r][c ..] + sum over the tokens i < n of p[r][i]
// v_i[offset ..]. NR x NC independent FMA chains in registers (one long chain through memory would wait on its own
// latency every step), each value vector loaded once for all NR rows.
template <int NR, int NC, typename T>
inline void accumulate_values(float* const* a, int64_t c, const float* alpha, const float* const* p,
                              const T* const* v_rows, int64_t offset, int64_t n) {
  __m512 o[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NC; ++j) o[r][j] = _mm512_mul_ps(_mm512_loadu_ps(a[r] + c + 16 * j), _mm512_set1_ps(alpha[r]));
  for (int64_t i = 0; i < n; ++i) {
    __m512 v[NC];
    for (int j = 0; j < NC; ++j) v[j] = ps::load16(v_rows[i] + offset + 16 * j);
    for (int r = 0; r < NR; ++r) {
      const __m512 pi = _mm512_set1_ps(p[r][i]);
      for (int j = 0; j < NC; ++j) o[r][j] = _mm512_fmadd_ps(pi, v[j], o[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(a[r] + c + 16 * j, o[r][j]);
}

// accumulate_values over all d dims (d % 16 == 0), in slabs of up to 64 (32 for more than four rows: NR x NC
// accumulators must leave registers for the values).
template <int NR, typename T>
inline void sum_values(float* const* a, const float* alpha, const float* const* p, const T* const* v_rows,
                       int64_t offset, int64_t d, int64_t n) {
  constexpr int kSlab = NR > 4 ? 2 : 4;
  int64_t c = 0;
  for (; c + 16 * kSlab <= d; c += 16 * kSlab) accumulate_values<NR, kSlab>(a, c, alpha, p, v_rows, offset + c, n);
  switch ((d - c) / 16) {
    case 3: accumulate_values<NR, 3>(a, c, alpha, p, v_rows, offset + c, n); break;
    case 2: accumulate_values<NR, 2>(a, c, alpha, p, v_rows, offset + c, n); break;
    case 1: accumulate_values<NR, 1>(a, c, alpha, p, v_rows, offset + c, n); break;
    default: break;
  }
}

// The online softmax's weights exp(scale s - m) for raw scores s (m: the running max of the scaled scores) as
// 2^(s scale log2(e) - m log2(e)): one FMA into exp2_16, where a multiply, a subtract and exp16's own range
// reduction and clamps took ~2x the instructions (the softmax was a third of the bf16 prefill kernel's time).
// Deg: exp2_16's polynomial (4 where the weights are rounded to bfloat16 next). The max is taken over the raw
// scores: scale > 0, so max(scale s) = scale max(s).
constexpr float kLog2e = 1.44269504088896341f;

template <int Deg>
inline __m512 softmax_weights(__m512 raw, float scale, float m_new) {
  return ps::exp2_16<Deg>(_mm512_fmsub_ps(raw, _mm512_set1_ps(scale * kLog2e), _mm512_set1_ps(m_new * kLog2e)));
}

// The soft cap on raw (unscaled) scores, kept in raw units: (cap / scale) tanh(raw scale / cap), so that the softmax
// steps, which scale the scores themselves, see cap tanh(scaled / cap). tanh(y) = 1 - 2 / (e^2y + 1) (exp16 clamps:
// no overflow at any score).
inline __m512 cap_scores(__m512 raw, float scale, float cap) {
  const __m512 e = ps::exp16(_mm512_mul_ps(raw, _mm512_set1_ps(2.f * scale / cap)));
  const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f),
                                                                    _mm512_add_ps(e, _mm512_set1_ps(1.f))));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap / scale));
}

// The lanes [lo, hi) of a 16-key chunk as a mask (lo, hi clamped to 0 .. 16).
inline __mmask16 lanes_between(int64_t lo, int64_t hi) {
  const auto below = [](int64_t n) { return (1u << std::clamp<int64_t>(n, 0, kChunk)) - 1; };
  return static_cast<__mmask16>(below(hi) & ~below(lo));
}

// softmax_update over two chunks at once (their raw scores a and b, lanes outside va / vb ignored): one running
// max, one rescale, one sum for 32 keys, so the serial part (max reduction, scalar exp, sum) is paid once per 32.
// The chunks' exp(score - m_new) come back in a and b.
template <int Deg = 6>
inline void softmax_update2(__m512& a, __mmask16 va, __m512& b, __mmask16 vb, float scale, float& m, float& l,
                            float& alpha) {
  const __m512 none = _mm512_set1_ps(kNoScore);
  a = _mm512_mask_mov_ps(none, va, a);
  b = _mm512_mask_mov_ps(none, vb, b);
  const float m_new = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(a, b)) * scale);
  alpha = m_new == m ? 1.f : std::exp(m - m_new);
  a = _mm512_maskz_mov_ps(va, softmax_weights<Deg>(a, scale, m_new));
  b = _mm512_maskz_mov_ps(vb, softmax_weights<Deg>(b, scale, m_new));
  l = l * alpha + _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  m = m_new;
}

// Lane r (r < 4) of the result: op over all 16 lanes of v[r]. Four horizontal reductions as one transposing tree
// (three levels, then two across the 128-bit lanes) instead of four serial chains.
template <typename Op>
inline __m128 reduce4(const __m512* v, Op op) {
  const __m512 u0 = op(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 u1 = op(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  const __m512d a = _mm512_castps_pd(u0), b = _mm512_castps_pd(u1);
  __m512 w = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  w = op(w, _mm512_shuffle_f32x4(w, w, _MM_SHUFFLE(1, 0, 3, 2)));
  w = op(w, _mm512_shuffle_f32x4(w, w, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(w);
}

// The rescale step of an online-softmax update for up to four rows (the rows set in `rows`): lane r of the result's
// m_new is max(m[r], scale * the max over v[r]'s lanes (raw scores)), also stored to mn[r]; alpha = exp(m - m_new).
__attribute__((always_inline)) inline std::pair<__m128, __m128> new_maxes(const __m512* v, __mmask8 rows, float scale,
                                                                          const float* m, float* mn) {
  const __m128 m_old = _mm_maskz_loadu_ps(rows, m);
  const __m128 raw_max = reduce4(v, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); });
  const __m128 m_new = _mm_max_ps(m_old, _mm_mul_ps(raw_max, _mm_set1_ps(scale)));
  _mm_store_ps(mn, m_new);
  return {m_new, _mm512_castps512_ps128(ps::exp16(_mm512_zextps128_ps512(_mm_sub_ps(m_old, m_new))))};
}

// The end of that update: l[r] = alpha l[r] + the sum over v[r]'s lanes (the new weights), m[r] = m_new, alpha[r].
__attribute__((always_inline)) inline void store_update(const __m512* v, __mmask8 rows, __m128 m_new, __m128 al,
                                                        float* m, float* l, float* alpha) {
  const __m128 sums = reduce4(v, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
  _mm_mask_storeu_ps(l, rows, _mm_fmadd_ps(_mm_maskz_loadu_ps(rows, l), al, sums));
  _mm_mask_storeu_ps(m, rows, m_new);
  _mm_mask_storeu_ps(alpha, rows, al);
}

#if defined(__AVX512BF16__)
// The bfloat16 path (a bfloat16 model with a bfloat16 cache, head_dim % 32 == 0, at most kMaxDim): every product
// on VDPBF16PS, which multiplies *pairs* of bfloat16 and accumulates in float32.
//
// Value sums: two tokens' value rows interleaved by a 16-bit unpack (vpunpck{l,h}wd), times the pair of their softmax
// weights rounded to bfloat16 (as PyTorch's own CPU flash attention rounds them for its bfloat16 P.V product). The
// unpack works per 128-bit lane, so the 32 dims of block b land permuted: lane 4c+i of the "lo" accumulator (a[32b
// .. 32b+16)) is dim 32b+8c+i, of the "hi" one (a[32b+16 .. 32b+32)) dim 32b+8c+4+i (c < 4, i < 4);
// `unpermute_values` restores the order once at the end.
constexpr int64_t kMaxDim = 256;
constexpr int64_t kPairs = kChunk / 2;

// *p (a pair of bfloat16 weights) in every lane, by a load-port broadcast: the compiler turns a set1 of a pair it
// has kept in a register into shifts plus a shuffle-port broadcast, which compete with VDPBF16PS. One broadcast
// serves two VDPBF16PS; the pair broadcast inside each of them ({1to16}) ran 1.04-1.16x slower on AMD Zen 5
// (6.2 G VDPBF16PS/s per core against 7.1).
inline __m512bh broadcast_pair(const uint32_t* p) {
  __m512i v;
  asm("vpbroadcastd %1, %0" : "=v"(v) : "m"(*p));
  return (__m512bh)v;
}

// A chunk's value rows (at `offset`), interleaved in token pairs: vp[(j * d/32 + b) * 2 + {0, 1}] = the lo and hi
// unpack of tokens 2j and 2j+1 over dims 32b .. 32b+32.
inline void interleave_value_pairs(const bf16* const* v_rows, int64_t offset, int64_t d, int64_t pairs, __m512i* vp) {
  const int64_t blocks = d / 32;
  for (int64_t j = 0; j < pairs; ++j)
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512i x = _mm512_loadu_si512(v_rows[2 * j] + offset + 32 * b);
      const __m512i y = _mm512_loadu_si512(v_rows[2 * j + 1] + offset + 32 * b);
      vp[(j * blocks + b) * 2] = _mm512_unpacklo_epi16(x, y);
      vp[(j * blocks + b) * 2 + 1] = _mm512_unpackhi_epi16(x, y);
    }
}

// For NR rows r: acc[r] = alpha[r] acc[r] + sum over token pairs j of p_r[2j] v[2j] + p_r[2j+1] v[2j+1] (pp[r][j]:
// that pair in bfloat16), in the permuted lane order. Each interleaved value vector serves all NR rows.
template <int NR, int P = kPairs>
inline void accumulate_pairs(float* const* acc, const float* alpha, const uint32_t (*pp)[P], const __m512i* vp,
                             int64_t d, int64_t pairs) {
  const int64_t blocks = d / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) {
      const __m512 al = _mm512_set1_ps(alpha[r]);
      lo[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 32 * b), al);
      hi[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 32 * b + 16), al);
    }
    for (int64_t j = 0; j < pairs; ++j) {
      const __m512bh vlo = (__m512bh)vp[(j * blocks + b) * 2], vhi = (__m512bh)vp[(j * blocks + b) * 2 + 1];
      for (int r = 0; r < NR; ++r) {
        const __m512bh pair = broadcast_pair(&pp[r][j]);
        lo[r] = _mm512_dpbf16_ps(lo[r], vlo, pair);
        hi[r] = _mm512_dpbf16_ps(hi[r], vhi, pair);
      }
    }
    for (int r = 0; r < NR; ++r) {
      _mm512_storeu_ps(acc[r] + 32 * b, lo[r]);
      _mm512_storeu_ps(acc[r] + 32 * b + 16, hi[r]);
    }
  }
}

// Puts the d values of a (in accumulate_pairs' lane order) back in dim order.
inline void unpermute_values(float* a, int64_t d) {
  for (int64_t b = 0; b < d; b += 32) {
    float t[32];
    std::memcpy(t, a + b, sizeof t);
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 4; ++i) a[b + 8 * c + i] = t[4 * c + i], a[b + 8 * c + 4 + i] = t[16 + 4 * c + i];
  }
}

// For `rows` rows r: acc[r] = alpha[r] acc[r] + the row's softmax weights times the values, on tiles: the weights
// in pairs already in tile 2 (rows x 16 token pairs), the interleaved values (vp: a row every d/32 * 2 vectors)
// into tile 6 one block of 16 dims at a time, their sums through tile 5 (a tile cannot be scaled in place, so the
// rescale and the add run on AVX-512). acc stays in accumulate_pairs' lane order.
__attribute__((target("amx-tile,amx-bf16"))) inline void sum_values_amx(float* const* acc, const float* alpha,
                                                                         int64_t rows, const __m512i* vp, int64_t d) {
  alignas(64) float sums[16][16];
  const int64_t blocks = d / 32;
  for (int64_t c = 0; c < 2 * blocks; ++c) {  // c = 2 b + {lo, hi}: dims 32 b + 16 (c % 2) .. in pair order
    _tile_zero(5);
    _tile_loadd(6, vp + c, blocks * 2 * sizeof(__m512i));
    _tile_dpbf16ps(5, 2, 6);
    _tile_stored(5, &sums[0][0], sizeof sums[0]);
    for (int64_t r = 0; r < rows; ++r) {
      float* a = acc[r] + 16 * c;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_set1_ps(alpha[r]), _mm512_load_ps(sums[r])));
    }
  }
}

inline bool bf16_path(int64_t head_dim) { return head_dim % 32 == 0 && head_dim <= kMaxDim; }
#endif
#endif

}  // namespace
}  // namespace ps
