// Decode attention straight from the paged KV cache: no gathered or padded copy of any context.
//
// One task per sequence, all its query heads: each K/V element is read from memory once per step, in chunks of 16
// tokens with an online softmax (a plain two-pass loop where AVX-512 is missing). With fewer sequences than
// threads, each context is split into ranges whose partial softmaxes are merged after. Queries and output are
// float32 or bfloat16 (the model's dtype), accumulation float32, whatever the cache dtype (float32, bfloat16 or
// float16): a bfloat16 cache halves the bytes that decode attention streams.
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
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

// Where a cache element lies (in elements): block b, slot t, KV head h at b * block_stride + t * token_stride +
// h * head_stride. Token-major blocks [block_size, KVH, D] (GPU, tests): token_stride KVH * D, head_stride D;
// head-major blocks [KVH, block_size, D] (the runner's CPU layout): token_stride D, head_stride block_size * D, so
// that each KV head's keys of a block are one contiguous run (1.12-1.14x float32 decode attention on Qwen3's
// shape: BENCHMARKS.md section 6). block_stride is twice the block when a block's K and V share one run.
struct CacheLayout {
  int64_t block_stride, token_stride, head_stride;
};

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride;  // q_stride: per sequence
  CacheLayout cache;
};

// Where token t's KV head h starts in a K or V cache, in elements (table: the sequence's blocks in order).
inline int64_t cache_row(const int64_t* table, const Shape& s, int64_t t, int64_t h) {
  return table[t / s.block_size] * s.cache.block_stride + t % s.block_size * s.cache.token_stride +
         h * s.cache.head_stride;
}

// A buffer of at least n elements for the calling thread, kept between calls: the prefill kernels' copies of a
// context are several MB, and a fresh buffer per call would fault its pages in each time. It grows to the largest
// context seen and stays. (Hand its pointer to the parallel workers: a thread_local named inside their lambdas
// would be each worker's own.)
template <typename E>
E* kept_buffer(size_t n) {
  thread_local std::vector<E> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

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
  const int64_t hs = s.cache.head_stride, n = t1 - t0;
  std::fill(acc, acc + heads * d, 0.f);
  std::fill(l, l + heads, 0.f);
  std::fill(m, m + heads, 0.f);
  if (n <= 0) return;
  scores.resize(heads * n);
  for (int64_t t = t0; t < t1; ++t) {
    const T* k_row = k_cache + cache_row(table, s, t, 0);
    for (int64_t h = 0; h < heads; ++h) scores[h * n + t - t0] = dot(qf + h * d, k_row + (h / group) * hs, d);
  }
  softmax_rows(scores.data(), heads, n, m, l);
  for (int64_t t = t0; t < t1; ++t) {
    const T* v_row = v_cache + cache_row(table, s, t, 0);
    for (int64_t h = 0; h < heads; ++h) axpy(scores[h * n + t - t0], v_row + (h / group) * hs, acc + h * d, d);
  }
}

// Brings K/V rows into L2 ahead of the kernels, a few lines per call, spread so that the memory stream runs under
// the arithmetic instead of after it (the walker's own prefetch of the next chunk has one step of distance, and
// compute and memory added up: BENCHMARKS.md section 6, "Tenth pass"). Tokens [t0, t1) of one sequence, block by
// block, each block's K rows then its V rows (per block, the span from its first wanted row of KV head 0 to the last
// of the last head: exactly those rows in a token-major block, the whole block in a head-major one).
template <typename T>
class RowPrefetch {
 public:
  RowPrefetch() = default;  // nothing to prefetch
  RowPrefetch(const T* k_cache, const T* v_cache, const int64_t* table, const Shape& s, int64_t t0, int64_t t1,
              int64_t lines_per_call)
      : k_cache_(reinterpret_cast<const char*>(k_cache)), v_cache_(reinterpret_cast<const char*>(v_cache)),
        table_(table), bs_(s.block_size), token_bytes_(s.cache.token_stride * sizeof(T)),
        heads_bytes_(((s.num_kv_heads - 1) * s.cache.head_stride + s.head_dim) * sizeof(T)),
        block_bytes_(s.cache.block_stride * sizeof(T)), t_(t0), end_(t1), lines_per_call_(lines_per_call) {
    next_block();
  }
  // The start of a thread's next task (at most kNextTaskBytes: the walker takes over from there), spread over the
  // steps of its current task of `current_tokens`.
  static RowPrefetch next_task(const T* k_cache, const T* v_cache, const int64_t* table, const Shape& s, int64_t t0,
                               int64_t t1, int64_t current_tokens) {
    const int64_t row_bytes = s.num_kv_heads * s.head_dim * sizeof(T);
    const int64_t tokens = std::min(t1 - t0, kNextTaskBytes / (2 * row_bytes));
    const int64_t steps = std::max<int64_t>(1, (current_tokens + kStepTokens - 1) / kStepTokens);
    return RowPrefetch(k_cache, v_cache, table, s, t0, t0 + tokens,
                       (2 * tokens * row_bytes / 64 + steps - 1) / steps);
  }
  // The current task's own rows past what next_task brought in while the task before it ran (wide rows: Qwen3's
  // 500-token contexts are 2 MB per layer), kept kAheadSteps steps or more ahead of the walker, one step's lines
  // over `calls` calls. Empty when next_task covers the whole task (re-prefetching cached lines cost 0.8x).
  static RowPrefetch ahead(const T* k_cache, const T* v_cache, const int64_t* table, const Shape& s, int64_t t0,
                           int64_t t1, int64_t calls) {
    const int64_t row_bytes = s.num_kv_heads * s.head_dim * sizeof(T), step_lines = 2 * kStepTokens * row_bytes / 64;
    const int64_t skip = std::max(kAheadSteps * kStepTokens, kNextTaskBytes / (2 * row_bytes));
    return RowPrefetch(k_cache, v_cache, table, s, std::min(t1, t0 + skip), t1,
                       (step_lines + calls - 1) / calls);
  }
  // Spreads each step's lines over `calls` calls.
  void spread(int64_t calls) { lines_per_call_ = (lines_per_call_ + calls - 1) / calls; }
  // The next lines_per_call lines. The block arithmetic (divisions) runs once per block, not per line: per line it
  // took half of the float32 decode kernel's time (perf, L3-resident cache).
  void step() {
    for (int64_t n = 0; n < lines_per_call_ && run_bytes_ > 0; ++n) {
      __builtin_prefetch(run_ + byte_, 0, 2);  // T1
      if ((byte_ += 64) < run_bytes_) continue;
      byte_ = 0;
      if (run_ == k_run_) {
        run_ = v_run_;  // the block's V rows after its K rows
      } else {
        next_block();
      }
    }
  }

 private:
  // Moves to the K rows of token t_'s block, from t_ to the block's end (or end_); run_bytes_ = 0 past end_.
  void next_block() {
    if (t_ >= end_) {
      run_bytes_ = 0;
      return;
    }
    const int64_t run_tokens = std::min(end_, (t_ / bs_ + 1) * bs_) - t_;
    const int64_t offset = table_[t_ / bs_] * block_bytes_ + t_ % bs_ * token_bytes_;
    run_ = k_run_ = k_cache_ + offset;
    v_run_ = v_cache_ + offset;
    run_bytes_ = (run_tokens - 1) * token_bytes_ + heads_bytes_;
    t_ += run_tokens;
  }

  static constexpr int64_t kNextTaskBytes = 256 * 1024;
  static constexpr int64_t kStepTokens = 32;  // the chunked kernels' step: two chunks of 16
  // The distance decides only where a K row is wider than 2 KiB (float32 Qwen3: 8 x 128 x 4 bytes) and next_task's
  // 256 KiB cover less than two steps: there one step ahead measured 1.06-1.15x the kernel's speed against two on an
  // AMD Zen 4 (1.04x on a Zen 5), four 0.89-0.99x (BENCHMARKS.md section 6, "Twenty-second pass").
  static constexpr int64_t kAheadSteps = 1;
  const char* k_cache_ = nullptr;
  const char* v_cache_ = nullptr;
  const int64_t* table_ = nullptr;
  int64_t bs_ = 1, token_bytes_ = 0, heads_bytes_ = 0, block_bytes_ = 0, t_ = 0, end_ = 0, lines_per_call_ = 0;
  const char* run_ = nullptr;  // the rows being prefetched: k_run_ or v_run_
  const char* k_run_ = nullptr;
  const char* v_run_ = nullptr;
  int64_t run_bytes_ = 0, byte_ = 0;
};

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

// Walks a sequence's tokens [t0, t1) through its block table in chunks of kChunk: the K and V row pointers of the
// current chunk (lanes past the end point at its first token again: scored, then masked out), while the next
// chunk's rows - scattered in memory, block by block - are prefetched into L2 (every KV head's head_dim elements).
template <typename T>
class ChunkWalker {
 public:
  ChunkWalker(const T* k_cache, const T* v_cache, const int64_t* table, const Shape& s, int64_t t0, int64_t t1)
      : k_cache_(k_cache), v_cache_(v_cache), table_(table), bs_(s.block_size), token_stride_(s.cache.token_stride),
        head_stride_(s.cache.head_stride), block_stride_(s.cache.block_stride), c0_(t0), t1_(t1),
        heads_(s.num_kv_heads), width_(s.head_dim) {
    if (t0 < t1) fill(t0, rows_[0]);
  }
  bool done() const { return c0_ >= t1_; }
  int64_t start() const { return c0_; }
  int64_t size() const { return std::min(kChunk, t1_ - c0_); }
  const T* const* keys() const { return rows_[cur_][0]; }
  const T* const* values() const { return rows_[cur_][1]; }
  void prefetch_next() {
    const int64_t next = c0_ + kChunk;
    if (next >= t1_) return;
    fill(next, rows_[cur_ ^ 1]);
    const int64_t n = std::min(kChunk, t1_ - next), bytes = width_ * static_cast<int64_t>(sizeof(T));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < heads_; ++h)
        for (int64_t byte = 0; byte < bytes; byte += 64) {
          const int64_t at = h * head_stride_;
          _mm_prefetch(reinterpret_cast<const char*>(rows_[cur_ ^ 1][0][i] + at) + byte, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(rows_[cur_ ^ 1][1][i] + at) + byte, _MM_HINT_T1);
        }
  }
  void advance() { c0_ += kChunk, cur_ ^= 1; }
  // One step of the two-chunk kernels: the current chunk's row pointers copied out (it is full whenever a second
  // follows: only a range's last chunk is short), the walker moved to the chunk after it, each prefetched ahead.
  // Returns the two chunks' sizes; the second is 0 when the range ended with the first.
  std::pair<int64_t, int64_t> take_two(const T** first_keys, const T** first_values) {
    prefetch_next();
    const int64_t n0 = size();
    std::copy(keys(), keys() + kChunk, first_keys);
    std::copy(values(), values() + kChunk, first_values);
    advance();
    if (done()) return {n0, 0};
    prefetch_next();  // the second chunk's slot now fetches the chunk after it
    return {n0, size()};
  }

 private:
  void fill(int64_t c0, const T* (*rows)[kChunk]) {
    const int64_t n = std::min(kChunk, t1_ - c0);
    int64_t b = c0 / bs_, off = c0 % bs_;
    for (int64_t i = 0; i < kChunk; ++i) {
      const int64_t at = i < n ? table_[b] * block_stride_ + off * token_stride_ : rows[0][0] - k_cache_;
      rows[0][i] = k_cache_ + at;
      rows[1][i] = v_cache_ + at;
      if (++off == bs_) off = 0, ++b;
    }
  }
  const T* k_cache_;
  const T* v_cache_;
  const int64_t* table_;
  int64_t bs_, token_stride_, head_stride_, block_stride_, c0_, t1_, heads_, width_, cur_ = 0;
  const T* rows_[2][2][kChunk];  // [current/next chunk][K/V][token]: each token's KV head 0
};

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

// One online-softmax step with a chunk's raw scores sc (lanes outside `valid` ignored): m (running max of the
// scaled scores) and l (running sum of exp(score - m)) move to the new max; alpha = exp(m_old - m_new), by which
// the caller rescales its value sums. Returns exp(score - m_new) (0 in ignored lanes).
inline __m512 softmax_update(__m512 sc, __mmask16 valid, float scale, float& m, float& l, float& alpha) {
  sc = _mm512_mask_mov_ps(_mm512_set1_ps(kNoScore), valid, sc);
  const float m_new = std::max(m, _mm512_reduce_max_ps(sc) * scale);
  alpha = m_new == m ? 1.f : std::exp(m - m_new);  // the max moves rarely after the first chunks
  const __m512 pv = _mm512_maskz_mov_ps(valid, softmax_weights<6>(sc, scale, m_new));
  l = l * alpha + _mm512_reduce_add_ps(pv);
  m = m_new;
  return pv;
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

// softmax_update2 for NR <= 4 rows at once (row r: raw scores a[r], b[r], lanes outside va[r] / vb[r] ignored; its
// m[r], l[r], alpha[r]): the rows' max and sum reductions and rescale factors share one tree and one exp each, so
// the serial part of a step is paid once for up to four rows (one call per row spent a quarter of the bf16 prefill
// kernel's time on it; BENCHMARKS.md section 6, "Tenth pass").
template <int NR, int Deg>
__attribute__((always_inline)) inline void softmax_update2_four(__m512* a, const __mmask16* va, __m512* b,
                                                                const __mmask16* vb, float scale, float* m, float* l,
                                                                float* alpha) {
  static_assert(NR >= 1 && NR <= 4);
  const __m512 none = _mm512_set1_ps(kNoScore);
  const __mmask8 rows = static_cast<__mmask8>((1u << NR) - 1);
  __m512 v[4];
  for (int r = 0; r < 4; ++r) {
    if (r >= NR) {
      v[r] = none;
      continue;
    }
    a[r] = _mm512_mask_mov_ps(none, va[r], a[r]);
    b[r] = _mm512_mask_mov_ps(none, vb[r], b[r]);
    v[r] = _mm512_max_ps(a[r], b[r]);
  }
  alignas(16) float mn[4];
  const auto [m_new, al] = new_maxes(v, rows, scale, m, mn);
  for (int r = 0; r < 4; ++r) {
    if (r >= NR) {
      v[r] = _mm512_setzero_ps();
      continue;
    }
    a[r] = _mm512_maskz_mov_ps(va[r], softmax_weights<Deg>(a[r], scale, mn[r]));
    b[r] = _mm512_maskz_mov_ps(vb[r], softmax_weights<Deg>(b[r], scale, mn[r]));
    v[r] = _mm512_add_ps(a[r], b[r]);
  }
  store_update(v, rows, m_new, al, m, l, alpha);
}

// softmax_update2_four for NR <= 8 rows, four at a time.
template <int NR, int Deg>
inline void softmax_update2_rows(__m512* a, const __mmask16* va, __m512* b, const __mmask16* vb, float scale,
                                 float* m, float* l, float* alpha) {
  softmax_update2_four<std::min(NR, 4), Deg>(a, va, b, vb, scale, m, l, alpha);
  if constexpr (NR > 4)
    softmax_update2_four<NR - 4, Deg>(a + 4, va + 4, b + 4, vb + 4, scale, m + 4, l + 4, alpha + 4);
}

// Online softmax of one query head over the scores sc0 of the first n0 keys of a chunk and sc1 of the first n1 of
// the chunk after it (none when n1 = 0): m, l and acc (d floats, the running sum of exp(score - m) * value) are
// rescaled once for both and updated. v_rows: both chunks' value rows, the second's from index n0 (a first chunk
// followed by a second one is full: n0 = kChunk).
template <typename TV>
inline void attend_scored(__m512 sc0, __m512 sc1, const TV* const* v_rows, int64_t v_offset, int64_t d, int64_t n0,
                          int64_t n1, float scale, float* acc, float& m, float& l) {
  const __mmask16 valid0 = static_cast<__mmask16>((1u << n0) - 1);
  float alpha;
  alignas(64) float p[2 * kChunk];
  if (n1 > 0) {
    softmax_update2(sc0, valid0, sc1, static_cast<__mmask16>((1u << n1) - 1), scale, m, l, alpha);
    _mm512_store_ps(p + kChunk, sc1);
  } else {
    sc0 = softmax_update(sc0, valid0, scale, m, l, alpha);
  }
  _mm512_store_ps(p, sc0);
  const float* rows_p[1] = {p};
  sum_values<1>(&acc, &alpha, rows_p, v_rows, v_offset, d, n0 + n1);
}

// attend_scored for one query head (q: its d values in the model dtype, qf: the same in float32) against the keys
// k0 (n0 of them) and k1 (n1; none when 0).
template <typename TQ, typename T, typename TV>
inline void attend_chunks(const TQ* q, const float* qf, const T* const* k0, const T* const* k1, int64_t k_offset,
                          const TV* const* v_rows, int64_t v_offset, int64_t d, int64_t n0, int64_t n1, float scale,
                          float* acc, float& m, float& l) {
  const auto score = [&](const T* const* k) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<TQ, bf16> && std::is_same_v<T, bf16>) {
      if (d % 32 == 0) return score_chunk_bf16(q, k, k_offset, d);
    }
#endif
    return score_chunk(qf, k, k_offset, d);
  };
  attend_scored(score(k0), n1 > 0 ? score(k1) : _mm512_setzero_ps(), v_rows, v_offset, d, n0, n1, scale, acc, m, l);
}

// Scores of R query rows (qf: R rows of d floats) against two chunks' keys transposed (kt[e * 2 kChunk + i] = key i's
// value e, keys 16-31 the second chunk): lanes of s0[r] / s1[r] = q_r . k_i for the first / second chunk. 2R
// independent FMA chains, one broadcast per row and dim serving both chunks, no reduction.
template <int R>
inline void score_rows(const float* qf, int64_t d, const float* kt, __m512* s0, __m512* s1) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; ++e) {
    const __m512 k0 = _mm512_loadu_ps(kt + e * 2 * kChunk), k1 = _mm512_loadu_ps(kt + e * 2 * kChunk + kChunk);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(qf[r * d + e]);
      a0[r] = _mm512_fmadd_ps(qv, k0, a0[r]);
      a1[r] = _mm512_fmadd_ps(qv, k1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) s0[r] = a0[r], s1[r] = a1[r];
}

// Two-chunk steps per online-softmax update in the prefill kernels' vector paths: the update's serial part (the max
// and sum reduction trees, the rescale factor's exp) is paid once per 32 kWideSteps keys instead of once per 32, and
// its exps run side by side. One update per 256 keys measured 1.12-1.25x the bf16 kernel's speed against one per 32
// (per 64 keys 0.97-1.01x the speed of per 128, per 128 0.91-0.98x of per 256, per 512 level; BENCHMARKS.md
// section 6, "Fifteenth pass").
constexpr int kWideSteps = 8;
constexpr int kWideVecs = 2 * kWideSteps;            // score vectors per row and update
constexpr int64_t kWidePairs = kWideVecs * kChunk / 2;  // token pairs per update (the bf16 value sums)

// softmax_update2_four over up to kWideVecs score vectors per row (sc[r][k]: keys 16k .. 16k + 15 of the update;
// row r sees its first visible[r]), for NR <= 4 rows: one max tree, one sum tree and one rescale exp for all of
// them. Each vector's weights (exp2_16 of degree Deg) go to store(r, k, weights).
template <int NR, int Deg, typename Store>
__attribute__((always_inline)) inline void softmax_update_wide_four(__m512 (*sc)[kWideVecs], int nvec,
                                                                    const int64_t* visible, float scale, float* m,
                                                                    float* l, float* alpha, Store store) {
  static_assert(NR >= 1 && NR <= 4);
  const __m512 none = _mm512_set1_ps(kNoScore);
  const __mmask8 rows = static_cast<__mmask8>((1u << NR) - 1);
  __mmask16 mask[4][kWideVecs];
  __m512 v[4];
  for (int r = 0; r < 4; ++r) {
    v[r] = none;
    if (r >= NR) continue;
    for (int k = 0; k < nvec; ++k) {
      const int64_t n = std::clamp<int64_t>(visible[r] - kChunk * k, 0, kChunk);
      mask[r][k] = static_cast<__mmask16>((1u << n) - 1);
      v[r] = _mm512_max_ps(v[r], _mm512_mask_mov_ps(none, mask[r][k], sc[r][k]));
    }
  }
  alignas(16) float mn[4];
  const auto [m_new, al] = new_maxes(v, rows, scale, m, mn);
  for (int r = 0; r < 4; ++r) {
    v[r] = _mm512_setzero_ps();
    if (r >= NR) continue;
    for (int k = 0; k < nvec; ++k) {
      const __m512 p = _mm512_maskz_mov_ps(mask[r][k], softmax_weights<Deg>(sc[r][k], scale, mn[r]));
      v[r] = _mm512_add_ps(v[r], p);
      store(r, k, p);
    }
  }
  store_update(v, rows, m_new, al, m, l, alpha);
}

// softmax_update_wide_four for NR <= 8 rows, four at a time.
template <int NR, int Deg, typename Store>
inline void softmax_update_wide(__m512 (*sc)[kWideVecs], int nvec, const int64_t* visible, float scale, float* m,
                                float* l, float* alpha, Store store) {
  softmax_update_wide_four<std::min(NR, 4), Deg>(sc, nvec, visible, scale, m, l, alpha, store);
  if constexpr (NR > 4)
    softmax_update_wide_four<NR - 4, Deg>(sc + 4, nvec, visible + 4, scale, m + 4, l + 4, alpha + 4,
                                          [&](int r, int k, __m512 p) { store(r + 4, k, p); });
}

// NR consecutive rows of a float32 prefill tile (qf, acc: d floats per row; m, l: one per row; visible[j]: how many
// of the update's keys row j sees) against up to kWideSteps steps of two chunks (kt + s 2 kChunk d: step s's keys
// transposed; vf_rows: the update's value rows in float32): the scores a step at a time from one pass over its kt,
// one online-softmax update for all rows and keys, then the value sums of all NR rows together, each value vector
// loaded once for all of them (p = 0 past a row's visible keys).
template <int NR>
inline void prefill_rows(const float* qf, const float* kt, const float* const* vf_rows, const int64_t* visible,
                         int64_t d, float scale, float* acc, float* m, float* l) {
  int64_t most = 0;
  for (int r = 0; r < NR; ++r) most = std::max(most, visible[r]);
  const int nvec = static_cast<int>((most + kChunk - 1) / kChunk);
  __m512 sc[NR][kWideVecs];
  for (int k = 0; k < nvec; k += 2) {  // chunks k and k + 1 (past nvec: scored, masked out)
    __m512 s0[NR], s1[NR];
    score_rows<NR>(qf, d, kt + k * kChunk * d, s0, s1);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) sc[r][k] = s0[r], sc[r][k + 1] = s1[r];
  }
  alignas(64) float p[NR][kWideVecs * kChunk];
  const float* pr[NR];
  float* ar[NR];
  float alpha[NR];
  softmax_update_wide<NR, 6>(sc, nvec, visible, scale, m, l, alpha,
                             [&](int r, int k, __m512 w) { _mm512_store_ps(p[r] + kChunk * k, w); });
  for (int j = 0; j < NR; ++j) pr[j] = p[j], ar[j] = acc + j * d;
  sum_values<NR>(ar, alpha, pr, vf_rows, 0, d, most);
}

// `attend` for head_dim % 16 == 0 on AVX-512: one pass over the tokens in steps of two 16-token chunks with an
// online softmax (one update per 32 keys). Each step's K/V rows (every KV head) are read from memory once and stay
// in cache while all query heads use them; a query head's 16 scores per chunk come out of one reduction tree.
template <typename TQ, typename T>
void attend_avx512(const TQ* q, float scale, const T* k_cache, const T* v_cache, const int64_t* table, int64_t t0,
                   int64_t t1, const Shape& s, RowPrefetch<T>& next, float* qf, float* acc, float* m, float* l) {
  const int64_t heads = s.num_heads, d = s.head_dim, group = s.num_heads / s.num_kv_heads, hs = s.cache.head_stride;
  for (int64_t i = 0; i < heads * d; ++i) qf[i] = to_float(q[i]);
  std::fill(acc, acc + heads * d, 0.f);
  std::fill(l, l + heads, 0.f);
  std::fill(m, m + heads, kNoScore);
  const T* first_keys[kChunk];
  const T* values[2 * kChunk];
  RowPrefetch<T> ahead = RowPrefetch<T>::ahead(k_cache, v_cache, table, s, t0, t1, heads);
  next.spread(heads);
  for (ChunkWalker<T> w(k_cache, v_cache, table, s, t0, t1); !w.done(); w.advance()) {
    const auto [n0, n1] = w.take_two(first_keys, values);
    const bool two = n1 > 0;
    if (two) std::copy(w.values(), w.values() + kChunk, values + kChunk);
    for (int64_t h = 0; h < heads; ++h, ahead.step(), next.step())
      attend_chunks(q + h * d, qf + h * d, first_keys, w.keys(), (h / group) * hs, values, (h / group) * hs, d, n0,
                    n1, scale, acc + h * d, m[h], l[h]);
    if (!two) break;
  }
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
// (BENCHMARKS.md section 6, "Sixteenth pass": 6.2 G VDPBF16PS/s per core against 7.1).
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

// Decode attention on AMX tiles, per KV head and step of two 16-key chunks (VDPBF16PS takes ~2 cycles on these
// CPUs, and the vector path spends most of its time in it):
// - scores[key][g] = k_key . q_g for its G query heads, one TDPBF16PS per chunk and 32 dims: the keys an A tile
//   straight from the cache (16 rows at the token stride), the queries a B tile of dim pairs built once per task.
//   It replaces G reduction trees of 16 x d/32 VDPBF16PS.
// - value sums: the G rows of softmax weights in pairs (pp) are an A tile, the interleaved values (vp) B tiles of
//   16 token pairs x 16 dims (sum_values_amx, shared with prefill_block_amx).
// Tiles: 0 and 7 the two chunks' scores (16 x G floats), 1 and 4 their keys (16 x 32 dims), 3 the queries (16 dim
// pairs x G heads); 2 the weights (G x 16 pairs), 6 values, 5 their sums (G x 16 dims). Loaded by each task,
// released at its end.
struct AmxDecodeTiles {
  __attribute__((target("amx-tile"))) explicit AmxDecodeTiles(int group) {
    const auto g = static_cast<uint8_t>(group);
    ps::TileConfig cfg;
    for (int t : {0, 3, 7}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(4 * group);
    for (int t : {1, 4, 6}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    for (int t : {2, 5}) cfg.rows[t] = g, cfg.colsb[t] = 64;
    ps::load_tile_config(cfg);
  }
  __attribute__((target("amx-tile"))) ~AmxDecodeTiles() { _tile_release(); }
};

// The G query heads of each KV head as B tiles: qp[((kv * d/32 + b) * 16 + j) * G + g] = dims 32b + 2j, +1 of head
// kv * G + g.
template <int G>
void query_pair_tiles(const bf16* q, int64_t num_kv_heads, int64_t d, uint32_t* qp) {
  for (int64_t kv = 0; kv < num_kv_heads; ++kv)
    for (int g = 0; g < G; ++g) {
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q + (kv * G + g) * d);
      for (int64_t p = 0; p < d / 2; ++p) qp[((kv * d / 32 + p / 16) * 16 + p % 16) * G + g] = pairs[p];
    }
}

// A step's scores for one KV head: both chunks (keys0/keys1: their 16 key rows at stride0/stride1 bytes, this
// head's dims first; keys1 null when there is no second chunk; qp: the head's query tiles) into scores[c][16][G].
template <int G>
__attribute__((target("amx-tile,amx-bf16"))) void score_chunks_amx(const bf16* keys0, int64_t stride0,
                                                                    const bf16* keys1, int64_t stride1,
                                                                    const uint32_t* qp, int64_t d, float* scores0,
                                                                    float* scores1) {
  _tile_zero(0);
  _tile_zero(7);
  for (int64_t b = 0; b < d / 32; ++b) {
    _tile_loadd(3, qp + b * 16 * G, 4 * G);
    _tile_loadd(1, keys0 + 32 * b, stride0);
    _tile_dpbf16ps(0, 1, 3);
    if (keys1 != nullptr) {
      _tile_loadd(4, keys1 + 32 * b, stride1);
      _tile_dpbf16ps(7, 4, 3);
    }
  }
  _tile_stored(0, scores0, 4 * G);
  if (keys1 != nullptr) _tile_stored(7, scores1, 4 * G);
}

// Column g of a dense [16][G] float matrix (c: 16 G floats, readable 16 past them): lane i = c[i G + g].
template <int G>
inline __m512 score_column(const float* c, int g) {
  const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                           1, 0), _mm512_set1_epi32(G)),
                                       _mm512_set1_epi32(g));
  __m512 r = _mm512_permutex2var_ps(_mm512_loadu_ps(c), idx, _mm512_loadu_ps(c + 16));
  for (int j = 2; j < G; j += 2) {  // elements [16 j, 16 j + 32): lanes whose index lies there
    const __mmask16 here = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(16 * j)) &
                           _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(16 * j + 32));
    r = _mm512_mask_mov_ps(r, here, _mm512_permutex2var_ps(_mm512_loadu_ps(c + 16 * j), idx,
                                                           _mm512_loadu_ps(c + 16 * j + 16)));
  }
  return r;
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

// accumulate_pairs on AMX tiles (G rows; the value pairs of the step's first `pairs` token pairs in vp; the rest are
// zeroed here, since they multiply weights of 0 and must not be NaN).
template <int G>
__attribute__((target("amx-tile,amx-bf16"))) void accumulate_pairs_amx(float* const* acc, const float* alpha,
                                                                        const uint32_t (*pp)[2 * kPairs], __m512i* vp,
                                                                        int64_t d, int64_t pairs) {
  std::fill(vp + pairs * (d / 32) * 2, vp + 2 * kPairs * (d / 32) * 2, _mm512_setzero_si512());
  _tile_loadd(2, pp, sizeof pp[0]);
  sum_values_amx(acc, alpha, G, vp, d);
}

// A chunk's key rows for score_chunks_amx: in place when its 16 rows lie `stride` apart (a whole chunk inside a
// block), else copied (lanes past the chunk repeat its first key) into scratch [16][d].
inline std::pair<const bf16*, int64_t> chunk_key_rows(const bf16* const* keys, int64_t n, int64_t offset,
                                                      int64_t stride, int64_t d, bf16* scratch) {
  if (n == kChunk && keys[kChunk - 1] - keys[0] == (kChunk - 1) * stride)
    return {keys[0] + offset, stride * static_cast<int64_t>(sizeof(bf16))};
  for (int64_t i = 0; i < kChunk; ++i) std::memcpy(scratch + i * d, keys[i] + offset, d * sizeof(bf16));
  return {scratch, d * static_cast<int64_t>(sizeof(bf16))};
}

// `attend` on the bfloat16 path with G query heads per KV head: the tokens in steps of two 16-token chunks with an
// online softmax (one update per 32 keys: softmax_update2), per KV head: its G query heads are scored (one
// reduction tree per chunk, or on AMX tiles with `tiles`), then its values are interleaved once per step and summed
// for all G heads together - no value widened to float32 or read twice.
template <int G>
__attribute__((target("amx-tile,amx-bf16"))) void attend_bf16_grouped(const bf16* q, float scale, const bf16* k_cache,
                                                                       const bf16* v_cache, const int64_t* table,
                                                                       int64_t t0, int64_t t1, const Shape& s,
                                                                       RowPrefetch<bf16>& next, bool tiles,
                                                                       float* acc, float* m, float* l) {
  const int64_t heads = s.num_heads, d = s.head_dim, hs = s.cache.head_stride, ts = s.cache.token_stride;
  const int64_t blocks = d / 32;
  std::fill(acc, acc + heads * d, 0.f);
  std::fill(l, l + heads, 0.f);
  std::fill(m, m + heads, kNoScore);
  __m512i vp[2 * kPairs * 2 * (kMaxDim / 32)];
  alignas(64) uint32_t pp[G][2 * kPairs];
  float alpha[G];
  float* rows[G];
  const bf16* first_keys[kChunk];
  const bf16* first_values[kChunk];
  std::optional<AmxDecodeTiles> amx;
  std::vector<uint32_t> qp(tiles ? heads * d / 2 : 0);
  constexpr int64_t kScores = kChunk * G + 16;  // one chunk's scores [16][G]: score_column reads 16 floats past them
  std::vector<float> scores(tiles ? s.num_kv_heads * 2 * kScores : 0);
  alignas(64) bf16 scratch[2][kChunk * kMaxDim];
  if (tiles) {
    amx.emplace(G);
    query_pair_tiles<G>(q, s.num_kv_heads, d, qp.data());
  }
  // Prefetch calls per KV head and step: one before each query head's scores, one before the values are
  // interleaved, one before they are summed. Few lines per call keep the stream paced with the arithmetic (one call
  // per KV head measured 0.82x on SmolLM2's shape, cold).
  constexpr int64_t kCallsPerHead = G + 2;
  RowPrefetch<bf16> ahead = RowPrefetch<bf16>::ahead(k_cache, v_cache, table, s, t0, t1,
                                                     s.num_kv_heads * kCallsPerHead);
  next.spread(s.num_kv_heads * kCallsPerHead);
  const auto prefetch = [&] {
    ahead.step();
    next.step();
  };
  for (ChunkWalker<bf16> w(k_cache, v_cache, table, s, t0, t1); !w.done(); w.advance()) {
    const auto [n0, n1] = w.take_two(first_keys, first_values);
    const bool two = n1 > 0;
    const __mmask16 valid0 = static_cast<__mmask16>((1u << n0) - 1), valid1 = static_cast<__mmask16>((1u << n1) - 1);
    // an odd count pairs the last token with a masked (p = 0) lane
    const int64_t pairs0 = (n0 + 1) / 2, pairs = two ? kPairs + (n1 + 1) / 2 : pairs0;
    if (tiles)  // every KV head's scores first: the tile products back to back
      for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
        const auto [k0, stride0] = chunk_key_rows(first_keys, n0, kv * hs, ts, d, scratch[0]);
        const auto [k1, stride1] = two ? chunk_key_rows(w.keys(), n1, kv * hs, ts, d, scratch[1])
                                       : std::pair<const bf16*, int64_t>{nullptr, 0};
        score_chunks_amx<G>(k0, stride0, k1, stride1, qp.data() + kv * d / 2 * G, d, &scores[2 * kv * kScores],
                            &scores[(2 * kv + 1) * kScores]);
      }
    for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
      __m512 sc0[G], sc1[G];
      __mmask16 v0[G], v1[G];
      for (int g = 0; g < G; ++g) {
        prefetch();
        const int64_t h = kv * G + g;
        sc0[g] = tiles ? score_column<G>(&scores[2 * kv * kScores], g)
                       : score_chunk_bf16(q + h * d, first_keys, kv * hs, d);
        sc1[g] = !two ? _mm512_setzero_ps()
               : tiles ? score_column<G>(&scores[(2 * kv + 1) * kScores], g)
                       : score_chunk_bf16(q + h * d, w.keys(), kv * hs, d);
        v0[g] = valid0, v1[g] = valid1;
        rows[g] = acc + h * d;
      }
      softmax_update2_rows<G, 4>(sc0, v0, sc1, v1, scale, m + kv * G, l + kv * G, alpha);
      for (int g = 0; g < G; ++g) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), (__m256i)_mm512_cvtneps_pbh(sc0[g]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g] + kPairs), (__m256i)_mm512_cvtneps_pbh(sc1[g]));
      }
      prefetch();
      interleave_value_pairs(first_values, kv * hs, d, pairs0, vp);
      if (two) interleave_value_pairs(w.values(), kv * hs, d, pairs - kPairs, vp + kPairs * blocks * 2);
      prefetch();
      if (tiles)
        accumulate_pairs_amx<G>(rows, alpha, pp, vp, d, pairs);
      else
        accumulate_pairs<G, 2 * kPairs>(rows, alpha, pp, vp, d, pairs);
    }
    if (!two) break;
  }
  for (int64_t h = 0; h < heads; ++h) unpermute_values(acc + h * d, d);
}

inline bool bf16_path(int64_t head_dim) { return head_dim % 32 == 0 && head_dim <= kMaxDim; }

// attend_bf16_grouped for this shape's group size; false when it does not apply (the caller takes another path).
inline bool attend_bf16(const bf16* q, float scale, const bf16* k_cache, const bf16* v_cache, const int64_t* table,
                        int64_t t0, int64_t t1, const Shape& s, RowPrefetch<bf16>& next, float* acc, float* m,
                        float* l) {
  if (!bf16_path(s.head_dim)) return false;
  const bool tiles = ps::amx_tiles();
  switch (s.num_heads / s.num_kv_heads) {
#define PS_GROUP(G) \
  case G: attend_bf16_grouped<G>(q, scale, k_cache, v_cache, table, t0, t1, s, next, tiles, acc, m, l); return true;
    PS_GROUP(1) PS_GROUP(2) PS_GROUP(3) PS_GROUP(4) PS_GROUP(5) PS_GROUP(6) PS_GROUP(7) PS_GROUP(8)
#undef PS_GROUP
    default: return false;
  }
}
#endif

// Query tokens per task: they share each update's keys and values while those are in cache. 32 against 16 measured
// 1.04x (bf16) and 1.08x (float32) on SmolLM2's prefill attention in the engine and 1.11x on Qwen3's (bf16), when
// each tile still built its own transposed copies; 64 no better then, and level with 32 since the copies are built
// once per call (pair_chunks, transpose_chunks).
constexpr int64_t kPrefillTile = 32;
// (token, head) rows the prefill kernels' vector paths score and sum together (prefill_rows, prefill_rows_bf16):
// 8-16 independent FMA / VDPBF16PS chains, enough to cover their latency (4 rows measured 0.8x on AMD Zen 5).
constexpr int64_t kPrefillRows = 8;

// Calls tile(kvh, a, b) for every (KV head, tile [a, b) of kPrefillTile query tokens) of an n-token prefill chunk,
// in parallel; make() builds each thread's tile worker (with its scratch buffers) once. Later tiles see more keys,
// so tasks go short, long, short, ...: each thread's range gets a fair share.
template <typename Make>
void for_each_prefill_tile(int64_t n, int64_t num_kv_heads, Make make) {
  const int64_t tiles = (n + kPrefillTile - 1) / kPrefillTile;
  at::parallel_for(0, num_kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    auto tile_worker = make();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kvh = task % num_kv_heads, j = task / num_kv_heads;
      const int64_t tile = j % 2 == 0 ? j / 2 : tiles - 1 - j / 2;
      const int64_t a = tile * kPrefillTile;
      tile_worker(kvh, a, std::min(n, a + kPrefillTile));
    }
  });
}

// Every KV head's keys [0, ctx) of one sequence transposed in float32 for the float32 prefill steps, and its values
// in float32, built once per call (each tile built them again for every update it saw): per head, `steps` steps of
// two 16-key chunks (step s: 32 floats per dim, at keys_t + (h steps + s) 2 kChunk d), then the values d floats a
// token (at values + (h steps 2 kChunk + token) d). Tokens past ctx are zeros.
template <typename T>
void transpose_chunks(const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx, int64_t steps,
                      const Shape& s, float* keys_t, float* values) {
  const int64_t d = s.head_dim, step_floats = 2 * kChunk * d;
  at::parallel_for(0, s.num_kv_heads * steps, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / steps, step = task % steps;
      float* step_kt = keys_t + task * step_floats;
      float* step_v = values + task * step_floats;
      for (int64_t c = 0; c < 2; ++c) {
        const T* keys[kChunk];
        const T* vals[kChunk];
        for (int64_t i = 0; i < kChunk; ++i) {
          const int64_t t = (2 * step + c) * kChunk + i;
          keys[i] = t < ctx ? k_cache + cache_row(table, s, t, h) : nullptr;
          vals[i] = t < ctx ? v_cache + cache_row(table, s, t, h) : nullptr;
        }
        for (int64_t eb = 0; eb < d; eb += 16) {  // 16 dims of the chunk's 16 keys: one 16 x 16 transpose
          __m512i block[kChunk];
          for (int64_t i = 0; i < kChunk; ++i) {
            const __m512 k = keys[i] == nullptr ? _mm512_setzero_ps() : ps::load16(keys[i] + eb);
            const __m512 v = vals[i] == nullptr ? _mm512_setzero_ps() : ps::load16(vals[i] + eb);
            block[i] = _mm512_castps_si512(k);
            _mm512_storeu_ps(&step_v[(c * kChunk + i) * d + eb], v);
          }
          ps::transpose16x16(block);
          for (int64_t e = 0; e < 16; ++e) _mm512_storeu_si512(&step_kt[(eb + e) * 2 * kChunk + c * kChunk], block[e]);
        }
      }
    }
  });
}

// Attention of a prefill chunk (head_dim % 16 == 0): its token i, at position first + i, over the sequence's keys
// [0, first + i] (the chunk's own K/V are already in the cache). The context's keys are transposed and its values
// widened to float32 once (transpose_chunks); then one task per (KV head, tile of query tokens) with the group's
// query heads: each update's keys and values serve every (token, head) row of the tile.
template <typename TQ, typename T>
void prefill_kernel(const TQ* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* table,
                    int64_t n, int64_t first, TQ* out, int64_t out_stride, const Shape& s, float scale) {
  const int64_t d = s.head_dim, group = s.num_heads / s.num_kv_heads;
  const int64_t max_rows = kPrefillTile * group, update_keys = kWideVecs * kChunk;
  const int64_t steps = (first + n + 2 * kChunk - 1) / (2 * kChunk), head_floats = steps * 2 * kChunk * d;
  float* const keys_t = kept_buffer<float>(2 * s.num_kv_heads * head_floats);
  float* const values = keys_t + s.num_kv_heads * head_floats;
  transpose_chunks(k_cache, v_cache, table, first + n, steps, s, keys_t, values);
  for_each_prefill_tile(n, s.num_kv_heads, [&] {
    return [&, qf = std::vector<float>(max_rows * d), acc = std::vector<float>(max_rows * d),
            m = std::vector<float>(max_rows), l = std::vector<float>(max_rows)](int64_t kvh, int64_t a, int64_t b) mutable {
      const int64_t rows = (b - a) * group;
      for (int64_t r = 0; r < rows; ++r) {
        const TQ* src = q + (a + r / group) * q_stride + (kvh * group + r % group) * d;
        for (int64_t i = 0; i < d; ++i) qf[r * d + i] = to_float(src[i]);
      }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(m.begin(), m.begin() + rows, kNoScore);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const float* vf_rows[kWideVecs * kChunk];
      for (int64_t c0 = 0; c0 < first + b; c0 += update_keys) {
        const int64_t keys = std::min(update_keys, first + b - c0);
        const float* kt = keys_t + kvh * head_floats + c0 * d;
        for (int64_t i = 0; i < keys; ++i) vf_rows[i] = values + kvh * head_floats + (c0 + i) * d;
        // the tile's rows (token, head) that see this update, kPrefillRows at a time
        for (int64_t r = (std::max(a, c0 - first) - a) * group; r < rows; r += kPrefillRows) {
          const int64_t nr = std::min<int64_t>(kPrefillRows, rows - r);
          int64_t visible[kPrefillRows];
          for (int64_t j = 0; j < nr; ++j) visible[j] = std::min(keys, first + a + (r + j) / group - c0 + 1);
          const float* qr = qf.data() + r * d;
          float* ar = acc.data() + r * d;
          switch (nr) {
#define PS_ROWS(NR) \
  case NR: prefill_rows<NR>(qr, kt, vf_rows, visible, d, scale, ar, m.data() + r, l.data() + r); break;
            PS_ROWS(8) PS_ROWS(7) PS_ROWS(6) PS_ROWS(5) PS_ROWS(4) PS_ROWS(3) PS_ROWS(2) PS_ROWS(1)
#undef PS_ROWS
            default: break;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / l[r];
        TQ* o = out + (a + r / group) * out_stride + (kvh * group + r % group) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = from_float<TQ>(acc[r * d + i] * inv);
      }
    };
  });
}

#if defined(__AVX512BF16__)
// NR rows (query pairs q[r], row r seeing the first visible[r] keys of the update) of a prefill tile against up to
// kWideVecs chunks whose keys are transposed into pairs (kp + k d/2, lane i of vector j: dims 2j, 2j+1 of key i of
// chunk k) and values interleaved (vp): the scores two chunks at a time straight out of VDPBF16PS with each row's
// query pairs broadcast (lane i = key i, no reduction tree; each broadcast serves both chunks, each kp vector all NR
// rows), then one online-softmax update for all the keys, then the value sums of all NR rows together.
template <int NR>
inline void prefill_rows_bf16(const uint32_t* const* q, const int64_t* visible, const __m512i* kp, const __m512i* vp,
                              int64_t d, float scale, float* const* acc, float* m, float* l) {
  int64_t most = 0;
  for (int r = 0; r < NR; ++r) most = std::max(most, visible[r]);
  const int nvec = static_cast<int>((most + kChunk - 1) / kChunk);
  const int64_t half = d / 2;
  __m512 sc[NR][kWideVecs];
  for (int k = 0; k < nvec; k += 2) {  // chunks k and k + 1 (past nvec: scored, masked out)
    __m512 s0[NR], s1[NR];  // two independent chains per row
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
    const __m512i* kk = kp + k * half;
    for (int64_t j = 0; j < half; ++j) {
      const __m512bh k0 = (__m512bh)kk[j], k1 = (__m512bh)kk[half + j];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const __m512bh qj = broadcast_pair(&q[r][j]);
        s0[r] = _mm512_dpbf16_ps(s0[r], k0, qj);
        s1[r] = _mm512_dpbf16_ps(s1[r], k1, qj);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) sc[r][k] = s0[r], sc[r][k + 1] = s1[r];
  }
  alignas(64) uint32_t pp[NR][kWidePairs];
  float alpha[NR];
  softmax_update_wide<NR, 4>(sc, nvec, visible, scale, m, l, alpha, [&](int r, int k, __m512 p) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r] + kPairs * k), (__m256i)_mm512_cvtneps_pbh(p));
  });
  accumulate_pairs<NR, kWidePairs>(acc, alpha, pp, vp, d, (most + 1) / 2);
}

// The same step for 16 rows at once on AMX tiles (CPUs with AMX-BF16, ps::amx_tiles()). The pair layouts built
// for VDPBF16PS are already TDPBF16PS's B tiles: kp (16 dim pairs x 16 keys per 32 dims) for the scores, and the
// interleaved values (16 key pairs x 16 dims, a row every d/32 * 2 vectors) for the value sums. q: the 16 rows'
// queries, contiguous (d apart); the scores go through memory to the same online-softmax step as the vector path;
// each 16 x 16 block of value sums is rescaled into acc by AVX-512 (a tile cannot be scaled in place). Tiles (all
// 16 x 64 bytes, AmxPrefillTiles): 0, 1 the two chunks' scores, 2 the queries then the softmax weights, 3, 4
// the chunks' keys, 5 a block of value sums, 6 its values. Rows past `rows` are padding: computed, never used.
__attribute__((target("amx-tile,amx-bf16"))) void prefill_block_amx(const bf16* q, const int64_t* visible, int64_t rows,
                                                                     const __m512i* kp, const __m512i* vp, int64_t d,
                                                                     float scale, float* acc, float* m, float* l) {
  alignas(64) float scores[16][2 * kChunk];
  alignas(64) bf16 p[16][2 * kChunk];
  const int64_t blocks = d / 32;
  const uint32_t* kt = reinterpret_cast<const uint32_t*>(kp);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_loadd(2, q + 32 * b, d * sizeof(bf16));
    _tile_loadd(3, kt + 16 * kChunk * b, 64);
    _tile_loadd(4, kt + (d / 2 + 16 * b) * kChunk, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, &scores[0][0], sizeof scores[0]);
  _tile_stored(1, &scores[0][kChunk], sizeof scores[0]);
  float alpha[16];
  for (int64_t r = 0; r < 16; ++r) {
    __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
    alpha[r] = 1.f;
    if (r < rows) {
      const int64_t v0 = std::min(visible[r], kChunk), v1 = visible[r] - v0;
      p0 = _mm512_load_ps(&scores[r][0]);
      p1 = _mm512_load_ps(&scores[r][kChunk]);
      softmax_update2<4>(p0, static_cast<__mmask16>((1u << v0) - 1), p1, static_cast<__mmask16>((1u << v1) - 1), scale,
                      m[r], l[r], alpha[r]);
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(&p[r][0]), (__m256i)_mm512_cvtneps_pbh(p0));
    _mm256_store_si256(reinterpret_cast<__m256i*>(&p[r][kChunk]), (__m256i)_mm512_cvtneps_pbh(p1));
  }
  _tile_loadd(2, &p[0][0], sizeof p[0]);
  float* acc_rows[16];
  for (int64_t r = 0; r < rows; ++r) acc_rows[r] = acc + r * d;
  sum_values_amx(acc_rows, alpha, rows, vp, d);
}

// The tile shapes of prefill_block_amx, loaded by each task; released at the task's end.
struct AmxPrefillTiles {
  __attribute__((target("amx-tile"))) AmxPrefillTiles() {
    ps::TileConfig cfg;
    for (int t = 0; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    ps::load_tile_config(cfg);
  }
  __attribute__((target("amx-tile"))) ~AmxPrefillTiles() { _tile_release(); }
};

// Every KV head's keys [0, ctx) of one sequence in the layouts the bfloat16 prefill steps read, built once per call
// (each tile built them again for every update it saw: a 2048-token prompt's 64 tiles re-transposed each chunk ~32
// times): per head, `chunks` chunks of 16 keys transposed into pairs (d/2 vectors each, one 16 x 16 transpose per 32
// dims), then as many chunks of values interleaved in token pairs (d/2 vectors each). Tokens past ctx are zeros,
// and so is at least the last chunk: the two-chunk steps score one chunk past the keys.
void pair_chunks(const bf16* k_cache, const bf16* v_cache, const int64_t* table, int64_t ctx, int64_t chunks,
                 const Shape& s, __m512i* pairs) {
  static const bf16 zeros[kMaxDim] = {};
  const int64_t d = s.head_dim, blocks = d / 32;
  at::parallel_for(0, s.num_kv_heads * chunks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / chunks, c = task % chunks;
      const bf16* keys[kChunk];
      const bf16* values[kChunk];
      for (int64_t i = 0; i < kChunk; ++i) {
        const int64_t t = c * kChunk + i;
        keys[i] = t < ctx ? k_cache + cache_row(table, s, t, h) : zeros;
        values[i] = t < ctx ? v_cache + cache_row(table, s, t, h) : zeros;
      }
      __m512i* kp = pairs + (2 * h * chunks + c) * d / 2;
      for (int64_t jb = 0; jb < blocks; ++jb) {
        __m512i* block = kp + jb * 16;
        for (int64_t i = 0; i < kChunk; ++i) block[i] = _mm512_loadu_si512(keys[i] + jb * 32);
        ps::transpose16x16(block);
      }
      interleave_value_pairs(values, 0, d, kPairs, kp + chunks * d / 2);
    }
  });
}

// prefill_kernel on the bfloat16 path: the context's keys and values paired once (pair_chunks), then per tile and
// update the tile's (token, head) rows eight at a time (prefill_rows_bf16, kWideSteps two-chunk steps per update),
// or 16 at a time on AMX tiles (prefill_block_amx, one two-chunk step per update).
void prefill_kernel_bf16(const bf16* q, int64_t q_stride, const bf16* k_cache, const bf16* v_cache,
                         const int64_t* table, int64_t n, int64_t first, bf16* out, int64_t out_stride, const Shape& s,
                         float scale) {
  const int64_t d = s.head_dim, group = s.num_heads / s.num_kv_heads;
  const int64_t max_rows = (kPrefillTile * group + 15) / 16 * 16;  // whole tiles of 16 rows
  const bool tiles = ps::amx_tiles();
  const int64_t update_keys = (tiles ? 1 : kWideSteps) * 2 * kChunk;
  const int64_t chunks = (first + n + kChunk - 1) / kChunk + 1;
  __m512i* const pairs = kept_buffer<__m512i>(s.num_kv_heads * chunks * d);
  pair_chunks(k_cache, v_cache, table, first + n, chunks, s, pairs);
  for_each_prefill_tile(n, s.num_kv_heads, [&] {
    return [&, acc = std::vector<float>(max_rows * d), m = std::vector<float>(max_rows),
            l = std::vector<float>(max_rows),
            qt = std::vector<bf16>(tiles ? max_rows * d : 0)](int64_t kvh, int64_t a, int64_t b) mutable {
      const int64_t rows = (b - a) * group;
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(m.begin(), m.begin() + rows, kNoScore);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      std::optional<AmxPrefillTiles> amx;
      if (tiles) {  // the tile's query rows, contiguous for the tile loads (padding rows zero)
        amx.emplace();
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(&qt[r * d], q + (a + r / group) * q_stride + (kvh * group + r % group) * d, d * sizeof(bf16));
        std::fill(qt.begin() + rows * d, qt.begin() + (rows + 15) / 16 * 16 * d, bf16{0});
      }
      const __m512i* head_keys = pairs + kvh * chunks * d;
      const __m512i* head_values = head_keys + chunks * d / 2;
      for (int64_t c0 = 0; c0 < first + b; c0 += update_keys) {
        const int64_t keys = std::min(update_keys, first + b - c0);
        const __m512i* kp = head_keys + c0 / kChunk * d / 2;
        const __m512i* vp = head_values + c0 / kChunk * d / 2;
        // the tile's rows that see this update: r = (t - a) * group + g for its tokens t from max(a, c0 - first)
        const int64_t r_first = (std::max(a, c0 - first) - a) * group;
        if (tiles) {
          for (int64_t r0 = r_first / 16 * 16; r0 < rows; r0 += 16) {
            int64_t visible[16];
            for (int64_t i = 0; i < 16; ++i)  // rows before the update's first key see none of it
              visible[i] = std::clamp<int64_t>(first + a + (r0 + i) / group - c0 + 1, 0, keys);
            prefill_block_amx(&qt[r0 * d], visible, std::min<int64_t>(16, rows - r0), kp, vp, d, scale,
                              acc.data() + r0 * d, m.data() + r0, l.data() + r0);
          }
          continue;
        }
        for (int64_t r = r_first; r < rows; r += kPrefillRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kPrefillRows, rows - r));
          const uint32_t* qr[kPrefillRows];
          int64_t visible[kPrefillRows];
          float* ar[kPrefillRows];
          for (int i = 0; i < nr; ++i) {
            const int64_t t = a + (r + i) / group, h = kvh * group + (r + i) % group;
            qr[i] = reinterpret_cast<const uint32_t*>(q + t * q_stride + h * d);
            visible[i] = std::min(keys, first + t - c0 + 1);
            ar[i] = acc.data() + (r + i) * d;
          }
          float* mr = m.data() + r;
          float* lr = l.data() + r;
          switch (nr) {
#define PS_ROWS(NR) \
  case NR: prefill_rows_bf16<NR>(qr, visible, kp, vp, d, scale, ar, mr, lr); break;
            PS_ROWS(8) PS_ROWS(7) PS_ROWS(6) PS_ROWS(5) PS_ROWS(4) PS_ROWS(3) PS_ROWS(2) PS_ROWS(1)
#undef PS_ROWS
            default: break;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* ar = acc.data() + r * d;
        unpermute_values(ar, d);
        const float inv = 1.f / l[r];
        bf16* o = out + (a + r / group) * out_stride + (kvh * group + r % group) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = from_float<bf16>(ar[i] * inv);
      }
    };
  });
}
#endif
#endif

// Any other dtype pair or instruction set: the bfloat16 grouped path does not apply.
template <typename TQ, typename T>
inline bool attend_bf16(const TQ*, float, const T*, const T*, const int64_t*, int64_t, int64_t, const Shape&,
                        RowPrefetch<T>&, float*, float*, float*) {
  return false;
}

template <typename TQ, typename T>
void decode_kernel(const TQ* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, TQ* out, Shape s, float scale) {
  const int64_t heads = s.num_heads, d = s.head_dim;
  // The work split: every context in parts of at most `span` tokens (a multiple of 16, the chunked kernels' step),
  // the tasks in sequence order, each thread a contiguous run of them holding ~1/threads of all the keys; a split
  // sequence's partial softmaxes are merged after (as flash-decoding does). One task per sequence, split evenly by
  // count, left one thread with most of the keys whenever the lengths were mixed (a 1400-token context next to
  // 100-token ones) while the other waited at the barrier.
  const int64_t threads = at::get_num_threads();
  constexpr int64_t kAlign = 16;
  int64_t total = 0;
  for (int64_t i = 0; i < s.num_seqs; ++i) total += context_lens[i];
  const int64_t span = std::max<int64_t>(4 * kAlign, (total / (4 * threads) + kAlign - 1) / kAlign * kAlign);
  std::vector<int64_t> first_task(s.num_seqs + 1, 0);
  for (int64_t i = 0; i < s.num_seqs; ++i)
    first_task[i + 1] = first_task[i] + std::max<int64_t>(1, (context_lens[i] + span - 1) / span);
  const int64_t num_tasks = first_task[s.num_seqs];
  const bool any_split = num_tasks > s.num_seqs;
  std::vector<int64_t> task_seq(num_tasks), task_t0(num_tasks), task_t1(num_tasks);
  for (int64_t i = 0; i < s.num_seqs; ++i)
    for (int64_t t = first_task[i]; t < first_task[i + 1]; ++t) {
      task_seq[t] = i;
      task_t0[t] = (t - first_task[i]) * span;
      task_t1[t] = std::min(context_lens[i], task_t0[t] + span);
    }
  std::vector<int64_t> bounds(threads + 1, num_tasks);  // thread th runs tasks [bounds[th], bounds[th + 1])
  bounds[0] = 0;
  for (int64_t t = 0, th = 1, prefix = 0; t < num_tasks; prefix += task_t1[t] - task_t0[t], ++t)
    while (th < threads && prefix * threads >= th * total) bounds[th++] = t;
  std::vector<float> part_acc(any_split ? num_tasks * heads * d : 0), part_m(any_split ? num_tasks * heads : 0),
      part_l(any_split ? num_tasks * heads : 0);
  at::parallel_for(0, threads, 1, [&](int64_t th_begin, int64_t th_end) {
    std::vector<float> qf(heads * d), acc(heads * d), m(heads), l(heads), scores;
    for (int64_t task = bounds[th_begin]; task < bounds[th_end]; ++task) {
      const int64_t seq = task_seq[task], t0 = task_t0[task], t1 = task_t1[task];
      const bool whole = first_task[seq + 1] - first_task[seq] == 1;
      const TQ* qs = q + seq * s.q_stride;
      float* a = whole ? acc.data() : part_acc.data() + task * heads * d;
      float* mm = whole ? m.data() : part_m.data() + task * heads;
      float* ll = whole ? l.data() : part_l.data() + task * heads;
      const int64_t* table = block_tables + seq * s.max_blocks;
      RowPrefetch<T> next;
      if (task + 1 < bounds[th_end]) {
        const int64_t n = task + 1;
        next = RowPrefetch<T>::next_task(k_cache, v_cache, block_tables + task_seq[n] * s.max_blocks, s, task_t0[n],
                                         task_t1[n], t1 - t0);
      }
      // The chunked kernels on every row width: on Qwen3's rows (8 KV heads x 128, 2-4 KiB per token) they once
      // lost to the token-at-a-time pass below (AMD Zen 4, float32, before the two-chunk softmax steps); on an Intel
      // Xeon they now take 0.58-0.66x its time in bfloat16 and 0.80-0.89x in float32 (BENCHMARKS.md section 6).
      if (!attend_bf16(qs, scale, k_cache, v_cache, table, t0, t1, s, next, a, mm, ll)) {
#if defined(__AVX512F__)
        if (d % 16 == 0) {
          attend_avx512(qs, scale, k_cache, v_cache, table, t0, t1, s, next, qf.data(), a, mm, ll);
        } else
#endif
        {
          for (int64_t i = 0; i < heads * d; ++i) qf[i] = to_float(qs[i]) * scale;
          attend(qf.data(), k_cache, v_cache, table, t0, t1, s, scores, a, mm, ll);
        }
      }
      if (whole) {
        for (int64_t h = 0; h < heads; ++h) {
          const float inv = 1.f / ll[h];
          TQ* o = out + (seq * heads + h) * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) o[i] = from_float<TQ>(a[h * d + i] * inv);
        }
      }
    }
  });
  if (!any_split) return;
  std::vector<float> o(d);
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    if (first_task[seq + 1] - first_task[seq] == 1) continue;
    for (int64_t h = 0; h < heads; ++h) {
      float mx = 0.f;
      bool any = false;
      for (int64_t t = first_task[seq]; t < first_task[seq + 1]; ++t) {
        const int64_t i = t * heads + h;
        if (part_l[i] > 0.f && (!any || part_m[i] > mx)) mx = part_m[i], any = true;
      }
      float denom = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t t = first_task[seq]; t < first_task[seq + 1]; ++t) {
        const int64_t i = t * heads + h;
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

// The caches' layout. k_cache and v_cache: [num_blocks, block_size, KVH, D] views, one dtype and strides, each block
// one dense run, token-major (a contiguous [block_size, KVH, D]) or head-major (the view of a [KVH, block_size, D]
// block), any stride between blocks: separate tensors, or the K and V halves of one [num_blocks, 2, ...] tensor,
// where a block's K and V are one contiguous run.
CacheLayout layout_of(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "K and V caches must be [num_blocks, block_size, KVH, D] tensors of one shape, dtype and layout");
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), d = k_cache.size(3);
  const bool token_major = k_cache.stride(2) == d && k_cache.stride(1) == kvh * d;
  const bool head_major = k_cache.stride(1) == d && k_cache.stride(2) == bs * d;
  TORCH_CHECK(k_cache.stride(3) == 1 && (token_major || head_major) && k_cache.stride(0) >= bs * kvh * d,
              "each KV cache block must be one dense [block_size, KVH, D] or [KVH, block_size, D] run");
  return {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
}

}  // namespace

// q: [S, H, D] float32 or bfloat16 (heads contiguous, any stride between sequences: a view of the fused QKV
// output); k_cache, v_cache: [num_blocks, block_size, KVH, D] float32, bfloat16 or float16 (layout_of: token- or
// head-major blocks, any stride between blocks); block_tables:
// [S, max_blocks] int64; context_lens: [S] int64. Accumulates in float32; writes into `out` ([S, H, D], q's
// dtype, contiguous) when given; returns it.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> out_opt) {
  TORCH_CHECK(ps::is_act_dtype(q.scalar_type()) && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 or bfloat16 [S, H, D] with contiguous heads");
  const CacheLayout layout = layout_of(k_cache, v_cache);
  TORCH_CHECK(scale > 0, "scale must be positive (the softmax takes the max of the unscaled scores)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong);
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = out_opt.has_value() ? *out_opt : torch::empty(q.sizes(), q.options());
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.is_contiguous() && out.sizes() == q.sizes(),
              "out must be a contiguous tensor shaped like q, of q's dtype");
  const Shape s{q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), bt.size(1), q.stride(0), layout};
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

// Whether paged_prefill_attention handles this head size in this build (AVX-512, head_dim % 16 == 0); else the
// caller keeps PyTorch's SDPA.
bool native_prefill(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim % 16 == 0;
#else
  return false;
#endif
}

// One prefill chunk of one sequence: q [n, H, D] (heads contiguous, any token stride) at positions first ..
// first + n - 1, causal over the sequence's K/V in the paged cache (block_ids: its blocks in order, covering
// first + n tokens; the chunk's own K/V written already). Writes out ([n, H, D], q's dtype, any token stride).
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_ids,
                             int64_t first, double scale, torch::Tensor out) {
  TORCH_CHECK(ps::is_act_dtype(q.scalar_type()) && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 or bfloat16 [T, H, D] with contiguous heads");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes() && out.stride(2) == 1 &&
              out.stride(1) == out.size(2), "out must be shaped like q, of q's dtype, with contiguous heads");
  const CacheLayout layout = layout_of(k_cache, v_cache);
  TORCH_CHECK(block_ids.scalar_type() == torch::kLong && first >= 0);
  TORCH_CHECK(scale > 0, "scale must be positive (the softmax takes the max of the unscaled scores)");
  auto table = block_ids.contiguous();
  TORCH_CHECK(table.numel() * k_cache.size(1) >= first + q.size(0), "block_ids do not cover the context");
  TORCH_CHECK(native_prefill(q.size(2)), "paged_prefill_attention: not built for head_dim ", q.size(2));
#if defined(__AVX512F__)
  const Shape s{1, q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), table.numel(), q.stride(0), layout};
  ps::with_act_type(q.scalar_type(), [&](auto* qtag) {
    using TQ = std::remove_pointer_t<decltype(qtag)>;
    ps::with_cache_type(k_cache.scalar_type(), [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<TQ, bf16> && std::is_same_v<T, bf16>) {
        if (bf16_path(s.head_dim)) {
          prefill_kernel_bf16(ps::ptr<bf16>(q), q.stride(0), ps::ptr<bf16>(k_cache), ps::ptr<bf16>(v_cache),
                              table.data_ptr<int64_t>(), q.size(0), first, ps::ptr<bf16>(out), out.stride(0), s,
                              static_cast<float>(scale));
          return;
        }
      }
#endif
      prefill_kernel<TQ, T>(ps::ptr<TQ>(q), q.stride(0), ps::ptr<T>(k_cache), ps::ptr<T>(v_cache),
                            table.data_ptr<int64_t>(), q.size(0), first, ps::ptr<TQ>(out), out.stride(0), s,
                            static_cast<float>(scale));
    });
  });
#endif
}

namespace {

// Token i's KV heads (src: heads contiguous, d elements each) into its slot: one run per token where the cache is
// token-major (head_stride == d), one per head where it is head-major.
template <typename TS, typename T>
void scatter_rows(const TS* src, int64_t src_stride, T* cache, const int64_t* slots, int64_t tokens, int64_t heads,
                  int64_t d, int64_t block_size, const CacheLayout& layout) {
  const int64_t run = layout.head_stride == d ? heads * d : d, runs = heads * d / run;
  at::parallel_for(0, tokens, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t r = 0; r < runs; ++r) {
        const TS* from = src + i * src_stride + r * run;
        T* to = cache + slots[i] / block_size * layout.block_stride + slots[i] % block_size * layout.token_stride +
                r * layout.head_stride;
        if constexpr (std::is_same_v<TS, T>) {
          std::memcpy(to, from, run * sizeof(T));
        } else {
#pragma omp simd
          for (int64_t j = 0; j < run; ++j) to[j] = from_float<T>(to_float(from[j]));
        }
      }
  });
}

}  // namespace

// k, v: [T, KVH, D] float32 or bfloat16 (heads contiguous, any stride between tokens); caches [num_blocks,
// block_size, KVH, D] float32, bfloat16 or float16 (layout_of); slot_mapping: [T] int64. Writes token i's K
// and V at slot slot_mapping[i], converted to the cache dtype (rounded to nearest even).
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  for (const auto& t : {k, v})
    TORCH_CHECK(ps::is_act_dtype(t.scalar_type()) && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2),
                "k and v must be float32 or bfloat16 [T, KVH, D] with contiguous heads");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  const CacheLayout layout = layout_of(k_cache, v_cache);
  const int64_t block_size = k_cache.size(1);
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k and v must match the cache's heads");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.numel() == k.size(0));
  auto slots = slot_mapping.contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  ps::with_act_type(k.scalar_type(), [&](auto* stag) {
    using TS = std::remove_pointer_t<decltype(stag)>;
    ps::with_cache_type(k_cache.scalar_type(), [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      scatter_rows(ps::ptr<TS>(k), k.stride(0), ps::ptr<T>(k_cache), sp, tokens, heads, d, block_size, layout);
      scatter_rows(ps::ptr<TS>(v), v.stride(0), ps::ptr<T>(v_cache), sp, tokens, heads, d, block_size, layout);
    });
  });
}

// layer_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> out);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor argmax_rows(torch::Tensor logits);
const char* kernel_isa();
// small_gemm.cpp
bool native_small_gemm(at::ScalarType dtype, int64_t k);
torch::Tensor pack_small_gemm_weight(torch::Tensor weight);
bool set_amx_tiles(bool enable);
bool set_small_gemm_chunks(bool enable);
bool small_gemm_chunks();
int64_t set_small_gemm_prefetch(int64_t steps);
int64_t small_gemm_prefetch();
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias);
torch::Tensor small_gemm_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor col_scale, torch::Tensor col_shift,
                              int64_t n, c10::optional<torch::Tensor> bias);
// decode_layers.cpp
std::tuple<torch::Tensor, torch::Tensor> decode_layers(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                       std::vector<torch::Tensor> weights, std::vector<int64_t> widths,
                                                       std::vector<torch::Tensor> caches, torch::Tensor cos,
                                                       torch::Tensor sin, torch::Tensor slot_mapping,
                                                       torch::Tensor block_tables, torch::Tensor context_lens,
                                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                                       double eps, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("out") = py::none());
  m.def("paged_prefill_attention", &paged_prefill_attention, "causal attention of one prefill chunk over its "
        "sequence's paged KV cache (CPU, AVX-512)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_ids"), py::arg("first"), py::arg("scale"), py::arg("out"));
  m.def("native_prefill", &native_prefill, "whether paged_prefill_attention handles this head_dim in this build");
  m.def("write_kv", &write_kv, "write new K/V rows (float32 or bfloat16) into the paged cache at their slots");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row ([rows, n] or [T, heads, n]); with residual: residual += x in "
        "place, then its RMSNorm; with out (may be x): written there (float32 or bfloat16)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("out") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] projection (float32 or bfloat16)");
  m.def("rotary_inplace", &rotary_inplace, "Neox-style rotary embedding in place (float32 or bfloat16)");
  m.def("argmax_rows", &argmax_rows,
        "each row's argmax, the first index on ties (float32 or bfloat16 [rows, n], contiguous rows)");
  m.def("native_small_gemm", &native_small_gemm, "whether small_gemm runs this dtype (and K; 0: any) natively in "
        "this build", py::arg("dtype"), py::arg("k") = 0);
  m.def("pack_small_gemm_weight", &pack_small_gemm_weight, "a [N, K] weight packed for small_gemm");
  m.def("small_gemm", &small_gemm, "x W^T (+ b) for a few rows x on a weight packed by pack_small_gemm_weight",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("small_gemm_int8", &small_gemm_int8, "x W^T (+ b) on an int8 weight packed by pack_small_gemm_weight, x "
        "quantized per row on the fly", py::arg("x"), py::arg("packed"), py::arg("col_scale"), py::arg("col_shift"),
        py::arg("n"), py::arg("bias") = py::none());
  m.def("decode_layers", &decode_layers, "a decode step's decoder layers in one call (the Python layers' ops, in "
        "their order); returns (hidden, residual)");
  m.def("amx_tiles", &ps::amx_tiles,
        "whether small_gemm calls of 2+ rows (bfloat16, K % 32 == 0; int8 weights, K % 64 == 0, with AMX-INT8) and "
        "bfloat16 prefill and decode attention run on AMX tiles");
  m.def("set_amx_tiles", &set_amx_tiles, "turn the AMX path on or off where available; returns amx_tiles()");
  m.def("small_gemm_chunks", &small_gemm_chunks,
        "whether small_gemm calls of 9-20 rows take K in chunks (on CPUs where that was measured faster)");
  m.def("set_small_gemm_chunks", &set_small_gemm_chunks, "turn those chunks on or off; returns small_gemm_chunks()");
  m.def("small_gemm_prefetch", &small_gemm_prefetch,
        "how many k steps ahead small_gemm calls of up to 8 rows prefetch their weights (a per-CPU default)");
  m.def("set_small_gemm_prefetch", &set_small_gemm_prefetch,
        "set that distance (0-64 k steps); returns small_gemm_prefetch()");
  m.def("isa", &kernel_isa, "the instruction-set level this build targets");
}
