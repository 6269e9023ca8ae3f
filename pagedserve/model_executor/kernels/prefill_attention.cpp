// Prefill attention straight from the paged KV cache (AVX-512 builds, head_dim % 16 == 0): one chunk of a
// sequence's prompt, causal over everything before it. The context's keys and values are laid out once per call for
// the vector (or AMX) steps, then each task takes a tile of query tokens of one KV head with all its query heads.
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

#if defined(__AVX512F__)

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
// (per 64 keys 0.97-1.01x the speed of per 128, per 128 0.91-0.98x of per 256, per 512 level).
constexpr int kWideSteps = 8;
constexpr int kWideVecs = 2 * kWideSteps;            // score vectors per row and update
constexpr int64_t kWidePairs = kWideVecs * kChunk / 2;  // token pairs per update (the bf16 value sums)

// softmax_update2_four over up to kWideVecs score vectors per row (sc[r][k]: keys 16k .. 16k + 15 of the update;
// row r sees its keys [hidden[r], visible[r]): a sliding window hides the first ones), for NR <= 4 rows: one max
// tree, one sum tree and one rescale exp for all of them. Each vector's weights (exp2_16 of degree Deg) go to
// store(r, k, weights).
template <int NR, int Deg, typename Store>
__attribute__((always_inline)) inline void softmax_update_wide_four(__m512 (*sc)[kWideVecs], int nvec,
                                                                    const int64_t* visible, const int64_t* hidden,
                                                                    float scale, float* m, float* l, float* alpha,
                                                                    Store store) {
  static_assert(NR >= 1 && NR <= 4);
  const __m512 none = _mm512_set1_ps(kNoScore);
  const __mmask8 rows = static_cast<__mmask8>((1u << NR) - 1);
  __mmask16 mask[4][kWideVecs];
  __m512 v[4];
  for (int r = 0; r < 4; ++r) {
    v[r] = none;
    if (r >= NR) continue;
    for (int k = 0; k < nvec; ++k) {
      mask[r][k] = lanes_between(hidden[r] - kChunk * k, visible[r] - kChunk * k);
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

// softmax_update_wide_four for NR <= 8 rows, four at a time, the raw scores soft-capped first where cap > 0.
template <int NR, int Deg, typename Store>
inline void softmax_update_wide(__m512 (*sc)[kWideVecs], int nvec, const int64_t* visible, const int64_t* hidden,
                                float scale, float cap, float* m, float* l, float* alpha, Store store) {
  if (cap > 0.f)
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < nvec; ++k) sc[r][k] = cap_scores(sc[r][k], scale, cap);
  softmax_update_wide_four<std::min(NR, 4), Deg>(sc, nvec, visible, hidden, scale, m, l, alpha, store);
  if constexpr (NR > 4)
    softmax_update_wide_four<NR - 4, Deg>(sc + 4, nvec, visible + 4, hidden + 4, scale, m + 4, l + 4, alpha + 4,
                                          [&](int r, int k, __m512 p) { store(r + 4, k, p); });
}

// NR consecutive rows of a float32 prefill tile (qf, acc: d floats per row; m, l: one per row; visible[j]: how many
// of the update's keys row j sees, hidden[j] how many of those its window has left behind) against up to kWideSteps
// steps of two chunks (kt + s 2 kChunk d: step s's keys
// transposed; vf_rows: the update's value rows in float32): the scores a step at a time from one pass over its kt,
// one online-softmax update for all rows and keys, then the value sums of all NR rows together, each value vector
// loaded once for all of them (p = 0 past a row's visible keys).
template <int NR>
inline void prefill_rows(const float* qf, const float* kt, const float* const* vf_rows, const int64_t* visible,
                         const int64_t* hidden, int64_t d, float scale, float cap, float* acc, float* m, float* l) {
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
  softmax_update_wide<NR, 6>(sc, nvec, visible, hidden, scale, cap, m, l, alpha,
                             [&](int r, int k, __m512 w) { _mm512_store_ps(p[r] + kChunk * k, w); });
  for (int j = 0; j < NR; ++j) pr[j] = p[j], ar[j] = acc + j * d;
  sum_values<NR>(ar, alpha, pr, vf_rows, 0, d, most);
}

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

// Every KV head's keys [base, ctx) of one sequence transposed in float32 for the float32 prefill steps, and its
// values in float32, built once per call (each tile built them again for every update it saw): per head, `steps`
// steps of two 16-key chunks (step s: 32 floats per dim, at keys_t + (h steps + s) 2 kChunk d), then the values d
// floats a token (at values + (h steps 2 kChunk + token - base) d). Tokens before lo (behind every row's window:
// their blocks may be gone) and past ctx are zeros.
template <typename T>
void transpose_chunks(const T* k_cache, const T* v_cache, const int64_t* table, int64_t base, int64_t lo,
                      int64_t ctx, int64_t steps, const Shape& s, float* keys_t, float* values) {
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
          const int64_t t = base + (2 * step + c) * kChunk + i;
          const bool here = t >= lo && t < ctx;
          keys[i] = here ? k_cache + cache_row(table, s, t, h) : nullptr;
          vals[i] = here ? v_cache + cache_row(table, s, t, h) : nullptr;
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

// Which of a prefill chunk's rows and keys an update of the keys [c0, c0 + keys) concerns: a window (x.window > 0)
// hides each row's keys before position - window + 1. The chunk's first token is at position `first`; its token t
// sees keys [lo(t), first + t] (causal) or all of the chunk's context. Updates cover update_keys keys from a
// multiple of update_keys (as without a window: from key 0), so that a row's softmax sums in the same order
// however the prompt was chunked (a draft model and its target, a prefix-cache hit, must agree bitwise).
struct PrefillRange {
  int64_t first, n, window;
  bool causal;
  int64_t update_keys;  // a multiple of 2 kChunk
  int64_t lowest_key() const { return window > 0 ? std::max<int64_t>(0, first - window + 1) : 0; }
  // the first update's first key for a tile starting at token a
  int64_t tile_start(int64_t a) const {
    return window > 0 ? std::max<int64_t>(0, first + a - window + 1) / update_keys * update_keys : 0;
  }
  int64_t tile_end(int64_t b) const { return causal ? first + b : first + n; }  // past the keys of a tile's last row
  // tokens [t_begin, t_end) of the tile [a, b) that see any key of [c0, c0 + keys)
  int64_t t_begin(int64_t a, int64_t c0) const { return causal ? std::max(a, c0 - first) : a; }
  int64_t t_end(int64_t b, int64_t c0, int64_t keys) const {
    return window > 0 ? std::clamp<int64_t>(c0 + keys + window - 1 - first, 0, b) : b;
  }
  int64_t visible(int64_t t, int64_t c0, int64_t keys) const {  // token t's keys end at c0 + visible
    return causal ? std::clamp<int64_t>(first + t - c0 + 1, 0, keys) : keys;
  }
  int64_t hidden(int64_t t, int64_t c0, int64_t keys) const {  // and start at c0 + hidden
    return window > 0 ? std::clamp<int64_t>(first + t - window + 1 - c0, 0, keys) : 0;
  }
};

// Attention of a prefill chunk (head_dim % 16 == 0): its token i, at position first + i, over the sequence's keys
// [0, first + i] (the chunk's own K/V are already in the cache), or with a window from first + i - window + 1; with
// causal false over all first + n of them (an encoder's whole prompt). The context's keys (from the first row's
// window on) are transposed and its values widened to float32 once (transpose_chunks); then one task per (KV head,
// tile of query tokens) with the group's query heads: each update's keys and values serve every (token, head) row
// of the tile that sees them.
template <typename TQ, typename T>
void prefill_kernel(const TQ* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* table,
                    int64_t n, int64_t first, TQ* out, int64_t out_stride, const Shape& s, float scale,
                    bool causal, const AttentionExtras& x) {
  const int64_t d = s.head_dim, group = s.num_heads / s.num_kv_heads;
  const int64_t max_rows = kPrefillTile * group, update_keys = kWideVecs * kChunk;
  const PrefillRange range{first, n, x.window, causal, update_keys};
  const int64_t base = range.tile_start(0);  // the keys laid out: [base, first + n)
  const int64_t steps = (first + n - base + 2 * kChunk - 1) / (2 * kChunk), head_floats = steps * 2 * kChunk * d;
  float* const keys_t = kept_buffer<float>(2 * s.num_kv_heads * head_floats);
  float* const values = keys_t + s.num_kv_heads * head_floats;
  transpose_chunks(k_cache, v_cache, table, base, range.lowest_key(), first + n, steps, s, keys_t, values);
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
      const int64_t end = range.tile_end(b);
      for (int64_t c0 = range.tile_start(a); c0 < end; c0 += update_keys) {
        const int64_t keys = std::min(update_keys, end - c0);
        const float* kt = keys_t + kvh * head_floats + (c0 - base) * d;
        for (int64_t i = 0; i < keys; ++i) vf_rows[i] = values + kvh * head_floats + (c0 - base + i) * d;
        // the tile's rows (token, head) that see this update, kPrefillRows at a time
        const int64_t r_end = (range.t_end(b, c0, keys) - a) * group;
        for (int64_t r = (range.t_begin(a, c0) - a) * group; r < r_end; r += kPrefillRows) {
          const int64_t nr = std::min<int64_t>(kPrefillRows, r_end - r);
          int64_t visible[kPrefillRows], hidden[kPrefillRows];
          for (int64_t j = 0; j < nr; ++j) {
            const int64_t t = a + (r + j) / group;
            visible[j] = range.visible(t, c0, keys);
            hidden[j] = range.hidden(t, c0, keys);
          }
          const float* qr = qf.data() + r * d;
          float* ar = acc.data() + r * d;
          switch (nr) {
#define PS_ROWS(NR)                                                                                              \
  case NR:                                                                                                       \
    prefill_rows<NR>(qr, kt, vf_rows, visible, hidden, d, scale, x.soft_cap, ar, m.data() + r, l.data() + r); \
    break;
            PS_ROWS(8) PS_ROWS(7) PS_ROWS(6) PS_ROWS(5) PS_ROWS(4) PS_ROWS(3) PS_ROWS(2) PS_ROWS(1)
#undef PS_ROWS
            default: break;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = kvh * group + r % group;
        const float inv = output_factor(x, h, m[r], l[r]);
        TQ* o = out + (a + r / group) * out_stride + h * d;
        for (int64_t i = 0; i < d; ++i) o[i] = from_float<TQ>(acc[r * d + i] * inv);
      }
    };
  });
}

#if defined(__AVX512BF16__)
// NR rows (query pairs q[r], row r seeing keys [hidden[r], visible[r]) of the update) of a prefill tile against up to
// kWideVecs chunks whose keys are transposed into pairs (kp + k d/2, lane i of vector j: dims 2j, 2j+1 of key i of
// chunk k) and values interleaved (vp): the scores two chunks at a time straight out of VDPBF16PS with each row's
// query pairs broadcast (lane i = key i, no reduction tree; each broadcast serves both chunks, each kp vector all NR
// rows), then one online-softmax update for all the keys, then the value sums of all NR rows together.
template <int NR>
inline void prefill_rows_bf16(const uint32_t* const* q, const int64_t* visible, const int64_t* hidden,
                              const __m512i* kp, const __m512i* vp, int64_t d, float scale, float cap,
                              float* const* acc, float* m, float* l) {
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
  softmax_update_wide<NR, 4>(sc, nvec, visible, hidden, scale, cap, m, l, alpha, [&](int r, int k, __m512 p) {
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
__attribute__((target("amx-tile,amx-bf16"))) void prefill_block_amx(const bf16* q, const int64_t* visible,
                                                                     const int64_t* hidden, int64_t rows,
                                                                     const __m512i* kp, const __m512i* vp, int64_t d,
                                                                     float scale, float cap, float* acc, float* m,
                                                                     float* l) {
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
      p0 = _mm512_load_ps(&scores[r][0]);
      p1 = _mm512_load_ps(&scores[r][kChunk]);
      if (cap > 0.f) p0 = cap_scores(p0, scale, cap), p1 = cap_scores(p1, scale, cap);
      softmax_update2<4>(p0, lanes_between(hidden[r], visible[r]), p1,
                         lanes_between(hidden[r] - kChunk, visible[r] - kChunk), scale, m[r], l[r], alpha[r]);
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

// Every KV head's keys [base, ctx) of one sequence in the layouts the bfloat16 prefill steps read, built once per
// call (each tile built them again for every update it saw: a 2048-token prompt's 64 tiles re-transposed each chunk
// ~32 times): per head, `chunks` chunks of 16 keys transposed into pairs (d/2 vectors each, one 16 x 16 transpose
// per 32 dims), then as many chunks of values interleaved in token pairs (d/2 vectors each). Tokens before lo
// (behind every row's window) and past ctx are zeros, and so is at least the last chunk: the two-chunk steps score
// one chunk past the keys.
void pair_chunks(const bf16* k_cache, const bf16* v_cache, const int64_t* table, int64_t base, int64_t lo,
                 int64_t ctx, int64_t chunks, const Shape& s, __m512i* pairs) {
  static const bf16 zeros[kMaxDim] = {};
  const int64_t d = s.head_dim, blocks = d / 32;
  at::parallel_for(0, s.num_kv_heads * chunks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / chunks, c = task % chunks;
      const bf16* keys[kChunk];
      const bf16* values[kChunk];
      for (int64_t i = 0; i < kChunk; ++i) {
        const int64_t t = base + c * kChunk + i;
        const bool here = t >= lo && t < ctx;
        keys[i] = here ? k_cache + cache_row(table, s, t, h) : zeros;
        values[i] = here ? v_cache + cache_row(table, s, t, h) : zeros;
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
                         float scale, bool causal, const AttentionExtras& x) {
  const int64_t d = s.head_dim, group = s.num_heads / s.num_kv_heads;
  const int64_t max_rows = (kPrefillTile * group + 15) / 16 * 16;  // whole tiles of 16 rows
  const bool tiles = ps::amx_tiles();
  const int64_t update_keys = (tiles ? 1 : kWideSteps) * 2 * kChunk;
  const PrefillRange range{first, n, x.window, causal, update_keys};
  const int64_t base = range.tile_start(0);  // the keys laid out: [base, first + n)
  const int64_t chunks = (first + n - base + kChunk - 1) / kChunk + 1;
  __m512i* const pairs = kept_buffer<__m512i>(s.num_kv_heads * chunks * d);
  pair_chunks(k_cache, v_cache, table, base, range.lowest_key(), first + n, chunks, s, pairs);
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
      const int64_t end = range.tile_end(b);
      for (int64_t c0 = range.tile_start(a); c0 < end; c0 += update_keys) {
        const int64_t keys = std::min(update_keys, end - c0);
        const __m512i* kp = head_keys + (c0 - base) / kChunk * d / 2;
        const __m512i* vp = head_values + (c0 - base) / kChunk * d / 2;
        // the tile's rows that see this update: r = (t - a) * group + g for its tokens t in [t_begin, t_end)
        const int64_t r_first = (range.t_begin(a, c0) - a) * group, r_end = (range.t_end(b, c0, keys) - a) * group;
        if (tiles) {
          for (int64_t r0 = r_first / 16 * 16; r0 < r_end; r0 += 16) {
            int64_t visible[16], hidden[16];
            for (int64_t i = 0; i < 16; ++i) {  // rows outside [r_first, r_end) see none of it (an empty range)
              const int64_t t = a + (r0 + i) / group;
              visible[i] = range.visible(t, c0, keys);
              hidden[i] = std::min(range.hidden(t, c0, keys), visible[i]);
            }
            prefill_block_amx(&qt[r0 * d], visible, hidden, std::min<int64_t>(16, rows - r0), kp, vp, d, scale,
                              x.soft_cap, acc.data() + r0 * d, m.data() + r0, l.data() + r0);
          }
          continue;
        }
        for (int64_t r = r_first; r < r_end; r += kPrefillRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kPrefillRows, r_end - r));
          const uint32_t* qr[kPrefillRows];
          int64_t visible[kPrefillRows], hidden[kPrefillRows];
          float* ar[kPrefillRows];
          for (int i = 0; i < nr; ++i) {
            const int64_t t = a + (r + i) / group, h = kvh * group + (r + i) % group;
            qr[i] = reinterpret_cast<const uint32_t*>(q + t * q_stride + h * d);
            visible[i] = range.visible(t, c0, keys);
            hidden[i] = range.hidden(t, c0, keys);
            ar[i] = acc.data() + (r + i) * d;
          }
          float* mr = m.data() + r;
          float* lr = l.data() + r;
          switch (nr) {
#define PS_ROWS(NR) \
  case NR: prefill_rows_bf16<NR>(qr, visible, hidden, kp, vp, d, scale, x.soft_cap, ar, mr, lr); break;
            PS_ROWS(8) PS_ROWS(7) PS_ROWS(6) PS_ROWS(5) PS_ROWS(4) PS_ROWS(3) PS_ROWS(2) PS_ROWS(1)
#undef PS_ROWS
            default: break;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* ar = acc.data() + r * d;
        unpermute_values(ar, d);
        const int64_t h = kvh * group + r % group;
        const float inv = output_factor(x, h, m[r], l[r]);
        bf16* o = out + (a + r / group) * out_stride + h * d;
        for (int64_t i = 0; i < d; ++i) o[i] = from_float<bf16>(ar[i] * inv);
      }
    };
  });
}
#endif

#endif

}  // namespace

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
// first + n tokens; the chunk's own K/V written already); causal false: every row sees all first + n keys (an
// encoder's bidirectional attention). window > 0: each row sees its last `window` positions only (block_ids may
// point anywhere, e.g. at a freed block's placeholder, behind the first row's window); soft_cap > 0: scores capped
// at soft_cap tanh(s / soft_cap); sinks ([H] float32): per-head logits in each softmax's denominator. Writes out
// ([n, H, D], q's dtype, any token stride).
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_ids,
                             int64_t first, double scale, torch::Tensor out, bool causal, int64_t window,
                             double soft_cap, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(ps::is_act_dtype(q.scalar_type()) && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 or bfloat16 [T, H, D] with contiguous heads");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes() && out.stride(2) == 1 &&
              out.stride(1) == out.size(2), "out must be shaped like q, of q's dtype, with contiguous heads");
  [[maybe_unused]] const CacheLayout layout = layout_of(k_cache, v_cache);  // checks the caches at every level
  TORCH_CHECK(block_ids.scalar_type() == torch::kLong && first >= 0);
  TORCH_CHECK(scale > 0, "scale must be positive (the softmax takes the max of the unscaled scores)");
  auto table = block_ids.contiguous();
  TORCH_CHECK(table.numel() * k_cache.size(1) >= first + q.size(0), "block_ids do not cover the context");
  TORCH_CHECK(native_prefill(q.size(2)), "paged_prefill_attention: not built for head_dim ", q.size(2));
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "window and soft_cap must be >= 0 (0: none)");
  TORCH_CHECK(causal || window == 0, "a sliding window needs causal attention");
  [[maybe_unused]] const AttentionExtras extras = attention_extras(window, soft_cap, sinks, q.size(1));
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
                              static_cast<float>(scale), causal, extras);
          return;
        }
      }
#endif
      prefill_kernel<TQ, T>(ps::ptr<TQ>(q), q.stride(0), ps::ptr<T>(k_cache), ps::ptr<T>(v_cache),
                            table.data_ptr<int64_t>(), q.size(0), first, ps::ptr<TQ>(out), out.stride(0), s,
                            static_cast<float>(scale), causal, extras);
    });
  });
#endif
}
