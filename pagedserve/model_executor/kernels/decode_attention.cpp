// Decode attention straight from the paged KV cache: no gathered or padded copy of any context.
//
// One task per sequence, all its query heads: each K/V element is read from memory once per step, in chunks of 16
// tokens with an online softmax (a plain two-pass loop where AVX-512 is missing). With fewer sequences than
// threads, each context is split into ranges whose partial softmaxes are merged after. Queries and output are
// float32 or bfloat16 (the model's dtype), accumulation float32, whatever the cache dtype (float32, bfloat16 or
// float16): a bfloat16 cache halves the bytes that decode attention streams.
#include "attention_math.h"
#include "ops.h"
#include "paged_cache.h"
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

using namespace ps;  // the element types, conversions and shared attention steps

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
// the sum l of exp(score - m) and acc = sum of exp(score - m) * value. An empty range gives l = 0. qf: the queries
// times the scale; cap > 0: the scores soft-capped.
template <typename T>
void attend(const float* qf, const T* k_cache, const T* v_cache, const int64_t* table, int64_t t0, int64_t t1,
            const Shape& s, float cap, std::vector<float>& scores, float* acc, float* m, float* l) {
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
  if (cap > 0.f)
    for (float& sc : scores) sc = cap * std::tanh(sc / cap);
  softmax_rows(scores.data(), heads, n, m, l);
  for (int64_t t = t0; t < t1; ++t) {
    const T* v_row = v_cache + cache_row(table, s, t, 0);
    for (int64_t h = 0; h < heads; ++h) axpy(scores[h * n + t - t0], v_row + (h / group) * hs, acc + h * d, d);
  }
}

// Brings K/V rows into L2 ahead of the kernels, a few lines per call, spread so that the memory stream runs under
// the arithmetic instead of after it (the walker's own prefetch of the next chunk has one step of distance, and
// compute and memory added up). Tokens [t0, t1) of one sequence, block by
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
  // AMD Zen 4 (1.04x on a Zen 5), four 0.89-0.99x.
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

// softmax_update2 for NR <= 4 rows at once (row r: raw scores a[r], b[r], lanes outside va[r] / vb[r] ignored; its
// m[r], l[r], alpha[r]): the rows' max and sum reductions and rescale factors share one tree and one exp each, so
// the serial part of a step is paid once for up to four rows (one call per row spent a quarter of the bf16 prefill
// kernel's time on it).
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
// followed by a second one is full: n0 = kChunk); cap > 0: the scores soft-capped first.
template <typename TV>
inline void attend_scored(__m512 sc0, __m512 sc1, const TV* const* v_rows, int64_t v_offset, int64_t d, int64_t n0,
                          int64_t n1, float scale, float cap, float* acc, float& m, float& l) {
  const __mmask16 valid0 = static_cast<__mmask16>((1u << n0) - 1);
  if (cap > 0.f) sc0 = cap_scores(sc0, scale, cap), sc1 = cap_scores(sc1, scale, cap);
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
                          float cap, float* acc, float& m, float& l) {
  const auto score = [&](const T* const* k) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<TQ, bf16> && std::is_same_v<T, bf16>) {
      if (d % 32 == 0) return score_chunk_bf16(q, k, k_offset, d);
    }
#endif
    return score_chunk(qf, k, k_offset, d);
  };
  attend_scored(score(k0), n1 > 0 ? score(k1) : _mm512_setzero_ps(), v_rows, v_offset, d, n0, n1, scale, cap, acc, m,
                l);
}

// `attend` for head_dim % 16 == 0 on AVX-512: one pass over the tokens in steps of two 16-token chunks with an
// online softmax (one update per 32 keys). Each step's K/V rows (every KV head) are read from memory once and stay
// in cache while all query heads use them; a query head's 16 scores per chunk come out of one reduction tree.
template <typename TQ, typename T>
void attend_avx512(const TQ* q, float scale, float cap, const T* k_cache, const T* v_cache, const int64_t* table,
                   int64_t t0, int64_t t1, const Shape& s, RowPrefetch<T>& next, float* qf, float* acc, float* m,
                   float* l) {
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
                    n1, scale, cap, acc + h * d, m[h], l[h]);
    if (!two) break;
  }
}

#if defined(__AVX512BF16__)

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
__attribute__((target("amx-tile,amx-bf16"))) void attend_bf16_grouped(const bf16* q, float scale, float cap,
                                                                       const bf16* k_cache,
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
        if (cap > 0.f) sc0[g] = cap_scores(sc0[g], scale, cap), sc1[g] = cap_scores(sc1[g], scale, cap);
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

// attend_bf16_grouped for this shape's group size; false when it does not apply (the caller takes another path).
inline bool attend_bf16(const bf16* q, float scale, float cap, const bf16* k_cache, const bf16* v_cache,
                        const int64_t* table, int64_t t0, int64_t t1, const Shape& s, RowPrefetch<bf16>& next,
                        float* acc, float* m, float* l) {
  if (!bf16_path(s.head_dim)) return false;
  const bool tiles = ps::amx_tiles();
  switch (s.num_heads / s.num_kv_heads) {
#define PS_GROUP(G) \
  case G: attend_bf16_grouped<G>(q, scale, cap, k_cache, v_cache, table, t0, t1, s, next, tiles, acc, m, l); return true;
    PS_GROUP(1) PS_GROUP(2) PS_GROUP(3) PS_GROUP(4) PS_GROUP(5) PS_GROUP(6) PS_GROUP(7) PS_GROUP(8)
#undef PS_GROUP
    default: return false;
  }
}

#endif
#endif

// Any other dtype pair or instruction set: the bfloat16 grouped path does not apply.
template <typename TQ, typename T>
inline bool attend_bf16(const TQ*, float, float, const T*, const T*, const int64_t*, int64_t, int64_t, const Shape&,
                        RowPrefetch<T>&, float*, float*, float*) {
  return false;
}

template <typename TQ, typename T>
void decode_kernel(const TQ* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, TQ* out, Shape s, float scale, const AttentionExtras& x) {
  const int64_t heads = s.num_heads, d = s.head_dim;
  // The work split: every context in parts of at most `span` tokens (a multiple of 16, the chunked kernels' step),
  // the tasks in sequence order, each thread a contiguous run of them holding ~1/threads of all the keys; a split
  // sequence's partial softmaxes are merged after (as flash-decoding does). One task per sequence, split evenly by
  // count, left one thread with most of the keys whenever the lengths were mixed (a 1400-token context next to
  // 100-token ones) while the other waited at the barrier.
  const int64_t threads = at::get_num_threads();
  constexpr int64_t kAlign = 16;
  // With a sliding window (window > 0) a sequence's keys start at its window's first position.
  std::vector<int64_t> first_key(s.num_seqs, 0);
  int64_t total = 0;
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    if (x.window > 0) first_key[i] = std::max<int64_t>(0, context_lens[i] - x.window);
    total += context_lens[i] - first_key[i];
  }
  const int64_t span = std::max<int64_t>(4 * kAlign, (total / (4 * threads) + kAlign - 1) / kAlign * kAlign);
  std::vector<int64_t> first_task(s.num_seqs + 1, 0);
  for (int64_t i = 0; i < s.num_seqs; ++i)
    first_task[i + 1] = first_task[i] + std::max<int64_t>(1, (context_lens[i] - first_key[i] + span - 1) / span);
  const int64_t num_tasks = first_task[s.num_seqs];
  const bool any_split = num_tasks > s.num_seqs;
  std::vector<int64_t> task_seq(num_tasks), task_t0(num_tasks), task_t1(num_tasks);
  for (int64_t i = 0; i < s.num_seqs; ++i)
    for (int64_t t = first_task[i]; t < first_task[i + 1]; ++t) {
      task_seq[t] = i;
      task_t0[t] = first_key[i] + (t - first_task[i]) * span;
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
      // Xeon they now take 0.58-0.66x its time in bfloat16 and 0.80-0.89x in float32.
      if (!attend_bf16(qs, scale, x.soft_cap, k_cache, v_cache, table, t0, t1, s, next, a, mm, ll)) {
#if defined(__AVX512F__)
        if (d % 16 == 0) {
          attend_avx512(qs, scale, x.soft_cap, k_cache, v_cache, table, t0, t1, s, next, qf.data(), a, mm, ll);
        } else
#endif
        {
          for (int64_t i = 0; i < heads * d; ++i) qf[i] = to_float(qs[i]) * scale;
          attend(qf.data(), k_cache, v_cache, table, t0, t1, s, x.soft_cap, scores, a, mm, ll);
        }
      }
      if (whole) {
        for (int64_t h = 0; h < heads; ++h) {
          const float inv = output_factor(x, h, mm[h], ll[h]);
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
      if (x.sinks != nullptr) mx = std::max(mx, x.sinks[h]);  // the sink joins the denominator once
      float denom = x.sinks != nullptr ? std::exp(x.sinks[h] - mx) : 0.f;
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

}  // namespace

// q: [S, H, D] float32 or bfloat16 (heads contiguous, any stride between sequences: a view of the fused QKV
// output); k_cache, v_cache: [num_blocks, block_size, KVH, D] float32, bfloat16 or float16 (layout_of: token- or
// head-major blocks, any stride between blocks); block_tables:
// [S, max_blocks] int64; context_lens: [S] int64; window > 0: each row attends to its last `window` positions
// only (a sliding-window layer); soft_cap > 0: scores s become soft_cap tanh(s / soft_cap) (Gemma 2); sinks ([H]
// float32): per-head logits in each softmax's denominator (gpt-oss). Accumulates in float32; writes into `out`
// ([S, H, D], q's dtype, contiguous) when given; returns it.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> out_opt, int64_t window, double soft_cap,
                                     c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(ps::is_act_dtype(q.scalar_type()) && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 or bfloat16 [S, H, D] with contiguous heads");
  const CacheLayout layout = layout_of(k_cache, v_cache);
  TORCH_CHECK(scale > 0, "scale must be positive (the softmax takes the max of the unscaled scores)");
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "window and soft_cap must be >= 0 (0: none)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong);
  const AttentionExtras extras = attention_extras(window, soft_cap, sinks, q.size(1));
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
      decode_kernel<TQ, T>(ps::ptr<TQ>(q), ps::ptr<T>(k_cache), ps::ptr<T>(v_cache), tp, lp, ps::ptr<TQ>(out), s, sc,
                           extras);
    });
  });
  return out;
}
