// y = x W^T (+ b) for the few rows of a decode step (M up to ~128), on a weight packed once at load time.
//
// Why not oneDNN here: its bfloat16 brgemm is built for many rows; on the decoder's matrices at 8 rows it ran at
// ~1/3 of what the weights' streaming allows. This kernel reads every weight byte once per call and keeps all the
// step's rows in registers against it:
//   * packed layout: 16 output columns per block, K in order inside a block, so one 64-byte load is one k step:
//     float32 [N/16][K][16]; bfloat16 [N/16][K/2][16][2] (VDPBF16PS's pairs); int8 [N/16][K/4][16][4]
//     (VPDPBUSD's quads);
//   * a tile is MT rows x NB blocks of accumulators (up to 8 x 3 = 24 of the 32 registers); each k step loads NB
//     weight vectors and broadcasts one x element (pair, quad) per row: NB multiply-adds per broadcast;
//   * threads split the column blocks (in groups of three); a thread runs all row tiles over each group, the group
//     staying in cache (from 9 to 20 rows, on CPUs where it measured faster, the tiles take turns over chunks
//     of K: thread_groups).
//
// int8 (weight-only int8 models, `--quantization int8`): weights symmetric per output channel; the activations are
// quantized per row on the fly (symmetric, scale max|x| / 127) and shifted by +128 into the unsigned bytes VPDPBUSD
// takes, the shift taken back with the column sums: sum (x_q + 128) w = sum x_q w + 128 sum w. The int32 sums never
// overflow below K = 2^31 / (255 * 127) ~ 66000.
#include "vec.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <type_traits>

using ps::bf16;

namespace {

#if defined(__AVX512F__)
constexpr int64_t kBlock = 16;  // output columns per packed block (one zmm of 32-bit lanes)

// Per packed weight type: the activation element a k step broadcasts, the accumulator, the multiply-add.
template <typename W>
struct Packed;

template <>
struct Packed<float> {
  using X = float;
  using Acc = __m512;
  static constexpr int64_t kStep = 1;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc madd(Acc acc, __m512i w, const X* x) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_set1_ps(*x), acc);
  }
};

inline __m512i broadcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

#if defined(__AVX512BF16__)
template <>
struct Packed<bf16> {
  using X = bf16;
  using Acc = __m512;
  static constexpr int64_t kStep = 2;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc madd(Acc acc, __m512i w, const X* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)broadcast32(x));
  }
};

template <>
struct Packed<int8_t> {
  using X = uint8_t;  // the row's quantized activations + 128
  using Acc = __m512i;
  static constexpr int64_t kStep = 4;
  static Acc zero() { return _mm512_setzero_si512(); }
  // Inline asm, not _mm512_dpbusd_epi32: GCC 12 copies each accumulator through another register and spills it to
  // the stack around every intrinsic call, ~3 extra instructions per multiply-add (the kernel ran at a third of
  // VPDPBUSD's rate).
  static Acc madd(Acc acc, __m512i w, const X* x) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(broadcast32(x)), "v"(w));
    return acc;
  }
};
#endif

inline void store_row(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
#if defined(__AVX512BF16__)
inline void store_row(bf16* y, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

inline __m512 load_bias(const float* b, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, b); }
inline __m512 load_bias(const bf16* b, __mmask16 mask) { return ps::load16_tail(b, mask); }

// Float accumulators -> y (+ bias).
template <typename Y>
struct FloatOut {
  Y* y;
  const Y* bias;
  int64_t n;
  void operator()(int64_t row, int64_t col, __m512 acc, __mmask16 mask) const {
    if (bias != nullptr) acc = _mm512_add_ps(acc, load_bias(bias + col, mask));
    store_row(y + row * n + col, acc, mask);
  }
};

// int32 sums of (x_q + 128) w -> y = (sum - 128 sum w) * row scale * column scale (+ bias).
template <typename Y>
struct Int8Out {
  Y* y;
  const Y* bias;
  int64_t n;
  const float* row_scale;
  const float* col_scale;
  const int32_t* col_shift;  // 128 * the column's weight sum
  void operator()(int64_t row, int64_t col, __m512i acc, __mmask16 mask) const {
    const __m512i sum = _mm512_sub_epi32(acc, _mm512_maskz_loadu_epi32(mask, col_shift + col));
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(row_scale[row]), _mm512_maskz_loadu_ps(mask, col_scale + col));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale);
    if (bias != nullptr) v = _mm512_add_ps(v, load_bias(bias + col, mask));
    store_row(y + row * n + col, v, mask);
  }
};

// The CPU family of an AMD CPU (0x19 Zen 3/4, 0x1A Zen 5); 0 on other vendors. The kernels' tuning choices below
// follow what was measured on each.
unsigned amd_family() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541 || d != 0x69746e65 || c != 0x444d4163) return 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;  // ("AuthenticAMD" above)
  const unsigned base = (a >> 8) & 0xf;
  return base == 0xf ? base + ((a >> 20) & 0xff) : base;
}

// How many k steps ahead of its loads a whole-K tile prefetches each block's stream into L1. With several row tiles
// (9+ rows) 16 steps (1 KiB): on Zen 4 +5-9% over none at 8-32 rows with 8 steps, and 16 a further ~10% at 1-32
// rows. One tile (up to 8 rows, every batch-1 decode step) takes the distance measured best on the CPU:
// AMD Zen 4 (family 0x19) 4 steps, the engine's decode steps of 1-8 sequences 1.05-1.17x faster than with 16 in 11
// of 12 cells (Qwen3 and SmolLM2 shapes, float32 and bfloat16); 16 elsewhere (Zen 5, Intel: unmeasured since 16
// was chosen). set_small_gemm_prefetch overrides it (benchmarks, tests).
constexpr int64_t kPrefetchSteps = 16;
int64_t one_tile_prefetch_measured_best() { return amd_family() == 0x19 ? 4 : kPrefetchSteps; }
std::atomic<int64_t> one_tile_prefetch{one_tile_prefetch_measured_best()};

// What a row tile prefetches besides the lines it reads, in one of two ways (`issue` at every k step):
//   * WholeK (the tile runs all of K): each block's own lines `distance` k steps ahead; the tiles after a group's
//     first, which compute from L2, also bring `per_step` lines of the thread's next group into L2, each tile its
//     own part.
//   * Chunked (the tiles take turns over chunks of K): the chunk after this one into L1, shared by all the chunk's
//     tiles through one cursor, `per_step` lines at a time, step by step across the group's blocks (the order its
//     first tile reads them).
struct WholeK {
  static constexpr bool kWholeK = true;
  int64_t distance = kPrefetchSteps;
  const char* line = nullptr;  // this tile's part of the next group
  int64_t per_step = 0;
  void issue(int64_t s) const {
    for (int64_t i = 0; i < per_step; ++i) _mm_prefetch(line + (s * per_step + i) * 64, _MM_HINT_T1);
  }
};

struct ChunkCursor {
  const char* line;  // the next line to prefetch
  int64_t left, per_step, blocks, block_bytes, block;
};

struct Chunked {
  static constexpr bool kWholeK = false;
  ChunkCursor* cursor;
  // Inlined: a call in the tile's loop would spill the accumulators (every zmm register is caller-saved).
  __attribute__((always_inline)) void issue(int64_t) const {
    ChunkCursor& c = *cursor;
    for (int64_t i = 0; i < c.per_step && c.left > 0; ++i, --c.left) {
      _mm_prefetch(c.line, _MM_HINT_T0);
      c.line += c.block_bytes;
      if (++c.block == c.blocks) c.block = 0, c.line += 64 - c.blocks * c.block_bytes;
    }
  }
};

// Rows [m0, m0 + MT) x blocks [b0, b0 + NB) of y, over k steps [s0, s1). `kept` holds the tile's sums between its
// chunks (unused when [s0, s1) is all of K); the sums start at zero at step 0 and go to y after the last step.
// Not inlined: inlined into the group loop, the whole-K tiles ran 2-7% slower at 64-128 rows than the same code
// alone (register allocation in one large function).
template <typename W, int MT, int NB, typename Ahead, typename Out>
__attribute__((noinline)) void tile(const typename Packed<W>::X* x, int64_t m0, const W* w, const Out& out,
                                    int64_t n, int64_t k, int64_t b0, int64_t s0, int64_t s1,
                                    typename Packed<W>::Acc* kept, Ahead ahead) {
  using P = Packed<W>;
  const int64_t steps = k / P::kStep, block_elems = steps * kBlock * P::kStep;
  if (Ahead::kWholeK) s0 = 0, s1 = steps;  // whole K, known at compile time: no kept sums in its code
  const W* wb = w + b0 * block_elems;
  typename P::Acc acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = s0 == 0 ? P::zero() : kept[m * NB + j];
  for (int64_t s = s0; s < s1; ++s) {
    ahead.issue(s - s0);
    if constexpr (Ahead::kWholeK)
      for (int j = 0; j < NB; ++j)  // a hint only: past the block's end it touches the next one, never faults
        _mm_prefetch(reinterpret_cast<const char*>(wb + j * block_elems + (s + ahead.distance) * kBlock * P::kStep),
                     _MM_HINT_T0);
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm512_loadu_si512(wb + j * block_elems + s * kBlock * P::kStep);
    for (int m = 0; m < MT; ++m) {
      const auto* xs = x + (m0 + m) * k + s * P::kStep;
      for (int j = 0; j < NB; ++j) acc[m][j] = P::madd(acc[m][j], wv[j], xs);
    }
  }
  if (s1 < steps) {
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NB; ++j) kept[m * NB + j] = acc[m][j];
    return;
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t col = (b0 + j) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, n - col);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    for (int m = 0; m < MT; ++m) out(m0 + m, col, acc[m][j], mask);
  }
}

// The same for a tile of `rows` (1-8) rows.
template <typename W, int NB, typename Ahead, typename Out>
inline void row_tile(const typename Packed<W>::X* x, int64_t m0, int64_t rows, const W* w, const Out& out, int64_t n,
                     int64_t k, int64_t b0, int64_t s0, int64_t s1, typename Packed<W>::Acc* kept, Ahead ahead) {
  switch (rows) {
    case 8: tile<W, 8, NB>(x, m0, w, out, n, k, b0, s0, s1, kept, ahead); break;
    case 7: tile<W, 7, NB>(x, m0, w, out, n, k, b0, s0, s1, kept, ahead); break;
    case 6: tile<W, 6, NB>(x, m0, w, out, n, k, b0, s0, s1, kept, ahead); break;
    case 5: tile<W, 5, NB>(x, m0, w, out, n, k, b0, s0, s1, kept, ahead); break;
    case 4: tile<W, 4, NB>(x, m0, w, out, n, k, b0, s0, s1, kept, ahead); break;
    case 3: tile<W, 3, NB>(x, m0, w, out, n, k, b0, s0, s1, kept, ahead); break;
    case 2: tile<W, 2, NB>(x, m0, w, out, n, k, b0, s0, s1, kept, ahead); break;
    case 1: tile<W, 1, NB>(x, m0, w, out, n, k, b0, s0, s1, kept, ahead); break;
    default: break;
  }
}
constexpr int64_t kGroup = 3;  // blocks per task: 3 x 8 accumulators + 3 weight vectors fit the registers
constexpr int64_t kTileRows = 8;
constexpr int64_t kChunkedMaxRows = 20;  // rows from 9 to this many take K in chunks (21-24: 0.88-1.08x)
constexpr int64_t kChunkSteps = 64;  // k steps per chunk (12 KiB of a group's weights)

// Whether the chunks run on this CPU: where they were measured faster. On AMD Zen 5 (family 0x1A) chunks took 9-20
// rows 1.07-1.28x faster; on AMD Zen 4 (0x19: 512-bit FMAs in two 256-bit halves, a 32 KiB L1) they were
// 0.78-1.00x the whole-K tiles at 12-20 rows, with 32 k steps per chunk no better. Other CPUs, unmeasured, keep the
// whole-K tiles. set_small_gemm_chunks overrides (tests).
bool chunks_measured_faster() { return amd_family() >= 0x1a; }
std::atomic<bool> chunks_on{chunks_measured_faster()};

// One thread's block groups [g0, g1), every row, in row tiles of up to 8.
//   * Up to 8 rows: one tile per group over the whole K, streaming the weights.
//   * 9-20 rows, where chunks_on: the tiles take turns over each chunk of K. Only the first tile's loads could
//     miss, the others read L1, and all of them prefetch the chunk after it (after a group's last, the next group's
//     first), so the stream runs under all their arithmetic. With the whole K per tile, the first tile streamed the
//     group and the others computed from L2 with nothing streaming under them: on Zen 5, 16 rows took about the
//     stream's time plus half the arithmetic's.
//   * More rows, or no chunks_on: the whole K per tile (the arithmetic is the larger part there; chunks measured
//     0.93-0.97x at 32-64 rows). The first tile streams its group, the later ones bring the next group into L2.
template <typename W, typename Out>
void thread_groups(const typename Packed<W>::X* x, int64_t rows, const W* w, const Out& out, int64_t n, int64_t k,
                   int64_t g0, int64_t g1) {
  using P = Packed<W>;
  const int64_t blocks = (n + kBlock - 1) / kBlock, steps = k / P::kStep, block_bytes = steps * 64;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const auto group_blocks = [&](int64_t g) { return std::min(kGroup, blocks - g * kGroup); };
  // Row tile t over group g's blocks, k steps [s0, s1).
  const auto run_tile = [&](int64_t t, int64_t g, int64_t s0, int64_t s1, typename P::Acc* kept, auto ahead) {
    const int64_t m0 = t * kTileRows, tile_rows = std::min(kTileRows, rows - m0), b0 = g * kGroup;
    const int64_t nb = group_blocks(g);
    if (nb == 3) row_tile<W, 3>(x, m0, tile_rows, w, out, n, k, b0, s0, s1, kept, ahead);
    else if (nb == 2) row_tile<W, 2>(x, m0, tile_rows, w, out, n, k, b0, s0, s1, kept, ahead);
    else row_tile<W, 1>(x, m0, tile_rows, w, out, n, k, b0, s0, s1, kept, ahead);
  };
  if (tiles == 1 || rows > kChunkedMaxRows || !chunks_on.load(std::memory_order_relaxed)) {
    // Each tile after the first prefetches its share of the next group (here one tile, or three and more).
    const int64_t distance = tiles == 1 ? one_tile_prefetch.load(std::memory_order_relaxed) : kPrefetchSteps;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t next_blocks = g + 1 < g1 ? group_blocks(g + 1) : 0;
      const int64_t per_step = tiles > 1 ? (next_blocks + tiles - 2) / (tiles - 1) : 0;
      const char* next_group = reinterpret_cast<const char*>(w) + (g + 1) * kGroup * block_bytes;
      for (int64_t t = 0; t < tiles; ++t) {
        const char* part = next_group + (t - 1) * steps * per_step * 64;
        run_tile(t, g, 0, steps, nullptr, t == 0 ? WholeK{distance} : WholeK{distance, part, per_step});
      }
    }
    return;
  }
  alignas(64) typename P::Acc kept[(kChunkedMaxRows + kTileRows - 1) / kTileRows][kTileRows * kGroup];
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t s0 = 0; s0 < steps; s0 += kChunkSteps) {
      const int64_t s1 = std::min(steps, s0 + kChunkSteps);
      const int64_t next_group = s1 < steps ? g : g + 1, next_step = s1 < steps ? s1 : 0;
      ChunkCursor cursor{};
      if (next_group < g1) {
        const int64_t next_blocks = group_blocks(next_group);
        const int64_t lines = next_blocks * std::min(kChunkSteps, steps - next_step);
        cursor = ChunkCursor{reinterpret_cast<const char*>(w) + next_group * kGroup * block_bytes + next_step * 64,
                             lines, (lines + tiles * (s1 - s0) - 1) / (tiles * (s1 - s0)), next_blocks, block_bytes, 0};
      }
      for (int64_t t = 0; t < tiles; ++t) run_tile(t, g, s0, s1, kept[t], Chunked{&cursor});
    }
  }
}

template <typename W, typename Out>
void small_gemm_kernel(const typename Packed<W>::X* x, int64_t rows, const W* w, const Out& out, int64_t n,
                       int64_t k) {
  if (rows == 0) return;  // the K chunks' cursor divides by the row tiles: none for an empty input
  const int64_t blocks = (n + kBlock - 1) / kBlock, groups = (blocks + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) { thread_groups<W>(x, rows, w, out, n, k, g0, g1); });
}

#if defined(__AVX512BF16__)
// bfloat16 on AMX tiles, for CPUs that have them (Sapphire Rapids and later), found at run time: the build's level
// stays "avx512bf16" and only these functions are compiled for the tile instructions. The packed bfloat16 layout
// above, [N/16][K/2][16][2], is already the B-tile layout of TDPBF16PS: the tile of block b and k pairs [p, p + 16)
// is 1 KiB at stride 64 bytes. Per pair of blocks (32 columns) a thread keeps 2 x 2 accumulator tiles (up to 32
// rows), loads each weight tile once for all rows and each x tile (16 rows x 32 k) once for both blocks. On an
// Intel Xeon this streamed the decoder's weights 1.3-1.5x faster than oneDNN's AMX kernels at 2-32 rows; one
// bfloat16 row goes on the tiles too (a 1-row A tile): on a 2-core Sapphire Rapids-class Xeon the VDPBF16PS path
// streamed a 151936 x 2048 LM head at 32.9 GB/s and Qwen3-30B-A3B's expert products at 29-32, the tiles at 2 rows
// at 35.5 and 32-34. int8 weights the same way on AMX-INT8 (TDPBUSD): the packed
// [N/16][K/4][16][4] layout is its B tile, the activations the quantized bytes VPDPBUSD takes; 2.3-4.4x fbgemm from
// 16 to 2048 rows.
namespace amx {
constexpr int64_t kRows = 32;  // rows per pass: two 16-row tiles
constexpr int64_t kPrefetchSteps = 4;  // weight tiles prefetched ahead

// Whether the CPU has AMX-BF16 and the OS lets this process use the tiles (Linux wants each process to ask once).
bool available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
// AMX-INT8 too (every CPU with AMX-BF16 so far has it; checked all the same).
bool int8_available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    return available() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1);
  }();
  return ok;
}
std::atomic<bool> enabled{true};  // set_amx_tiles(False) keeps the VDPBF16PS path (tests run both on AMX CPUs)

// The two weight types on tiles: bfloat16 x bfloat16 -> float32 (TDPBF16PS) and the int8 path's unsigned
// activation bytes (Packed<int8_t>::X) x int8 weights -> int32 (TDPBUSD). A tile row is 64 bytes: 32 k in bfloat16,
// 64 in int8. The tile numbers must be literals (GCC's tile intrinsics are asm macros), hence a macro.
#define PS_TILE_DOT(W, C, A, B)                                     \
  do {                                                              \
    if constexpr (std::is_same_v<W, bf16>) _tile_dpbf16ps(C, A, B); \
    else _tile_dpbusd(C, A, B);                                     \
  } while (0)
template <typename W>
using TileAcc = std::conditional_t<std::is_same_v<W, bf16>, float, int32_t>;
inline __m512 load_acc(const float* acc) { return _mm512_load_ps(acc); }
inline __m512i load_acc(const int32_t* acc) { return _mm512_load_si512(acc); }

// Tiles: accumulators C[m][j] = tmm(2m + j), x rows A[m] = tmm(4 + m), weights B[j] = tmm(6 + j). MT row tiles.
template <typename W, int MT, typename Out>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) void pass(const typename Packed<W>::X* x, int64_t m0,
                                                                 int64_t rows, const W* w, const Out& out, int64_t n,
                                                                 int64_t k, int64_t b0, int64_t b1) {
  using X = typename Packed<W>::X;
  constexpr int64_t kTileK = 64 / sizeof(X);
  alignas(64) TileAcc<W> acc[kRows][32];
  const int64_t block_elems = k * kBlock;
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two = b + 1 < b1;
    _tile_zero(0);
    _tile_zero(1);
    if (MT == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const W* w0 = w + b * block_elems;
    const W* w1 = w0 + block_elems;
    for (int64_t kk = 0; kk < k; kk += kTileK) {
      // Two row tiles: the weights' next tiles into L2 ahead of use, since the tile loads do not overlap their
      // misses with the products (bf16, 24-32 rows: 1.06-1.14x; with one row tile it cost 4-9%).
      for (int64_t line = 0; line < (MT == 2 ? 16 : 0); ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + (kk + kPrefetchSteps * kTileK) * kBlock) + 64 * line,
                     _MM_HINT_T1);
        if (two)
          _mm_prefetch(reinterpret_cast<const char*>(w1 + (kk + kPrefetchSteps * kTileK) * kBlock) + 64 * line,
                       _MM_HINT_T1);
      }
      _tile_loadd(4, x + m0 * k + kk, k * sizeof(X));
      if (MT == 2) _tile_loadd(5, x + (m0 + 16) * k + kk, k * sizeof(X));
      _tile_loadd(6, w0 + kk * kBlock, 64);
      PS_TILE_DOT(W, 0, 4, 6);
      if (MT == 2) PS_TILE_DOT(W, 2, 5, 6);
      if (two) {
        _tile_loadd(7, w1 + kk * kBlock, 64);
        PS_TILE_DOT(W, 1, 4, 7);
        if (MT == 2) PS_TILE_DOT(W, 3, 5, 7);
      }
    }
    _tile_stored(0, &acc[0][0], sizeof acc[0]);
    if (two) _tile_stored(1, &acc[0][16], sizeof acc[0]);
    if (MT == 2) {
      _tile_stored(2, &acc[16][0], sizeof acc[0]);
      if (two) _tile_stored(3, &acc[16][16], sizeof acc[0]);
    }
    for (int64_t j = 0; j < (two ? 2 : 1); ++j) {
      const int64_t col = (b + j) * kBlock, valid = std::min<int64_t>(kBlock, n - col);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
      for (int64_t r = 0; r < rows; ++r) out(m0 + r, col, load_acc(&acc[r][16 * j]), mask);
    }
  }
}

// One thread's block pairs [p0, p1), every row, in passes of up to kRows rows (each pass its own tile shapes).
template <typename W, typename Out>
__attribute__((target("amx-tile"))) void thread_blocks(const typename Packed<W>::X* x, int64_t rows, const W* w,
                                                       const Out& out, int64_t n, int64_t k, int64_t p0, int64_t p1) {
  const int64_t blocks = (n + kBlock - 1) / kBlock, b0 = 2 * p0, b1 = std::min(blocks, 2 * p1);
  for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
    const int64_t pass_rows = std::min(kRows, rows - m0), r0 = std::min<int64_t>(16, pass_rows),
                  r1 = pass_rows - r0;
    ps::TileConfig cfg;
    for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(r0), cfg.colsb[t] = 64;
    if (r1 > 0)
      for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(r1), cfg.colsb[t] = 64;
    for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    ps::load_tile_config(cfg);
    if (r1 > 0) pass<W, 2>(x, m0, pass_rows, w, out, n, k, b0, b1);
    else pass<W, 1>(x, m0, pass_rows, w, out, n, k, b0, b1);
  }
  _tile_release();
}

// x [rows, k] times the packed weight w on tiles (k a multiple of a tile row: 32 in bfloat16, 64 in int8).
template <typename W, typename Out>
void gemm(const typename Packed<W>::X* x, int64_t rows, const W* w, const Out& out, int64_t n, int64_t k) {
  const int64_t pairs = ((n + kBlock - 1) / kBlock + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) { thread_blocks<W>(x, rows, w, out, n, k, p0, p1); });
}
#undef PS_TILE_DOT
}  // namespace amx

// Row r of x [rows, k] -> q[r] = round(x / s) + 128 as bytes, s = max|x[r]| / 127 (1 for an all-zero row).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, uint8_t* q, float* scale) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      __m512 amax = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(ps::load16(xr + i)));
      float m = _mm512_reduce_max_ps(amax);
      for (; i < k; ++i) m = std::max(m, std::abs(ps::to_float(xr[i])));
      scale[r] = m > 0.f ? m / 127.f : 1.f;
      const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
      const __m512i shift = _mm512_set1_epi32(128);
      uint8_t* qr = q + r * k;
      for (i = 0; i + 16 <= k; i += 16) {
        const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(ps::load16(xr + i), inv)), shift);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm512_cvtusepi32_epi8(v));
      }
      for (; i < k; ++i)
        qr[i] = static_cast<uint8_t>(std::nearbyint(ps::to_float(xr[i]) * (m > 0.f ? 127.f / m : 0.f)) + 128);
    }
  });
}
#endif
#endif  // __AVX512F__

// Which weight dtypes this build runs natively: float32 with AVX-512; bfloat16 and int8 with AVX512-BF16 (whose
// build also targets AVX512-VNNI: every CPU with AVX512-BF16 has it).
bool supports(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  return dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kChar;
#elif defined(__AVX512F__)
  return dtype == torch::kFloat;
#else
  (void)dtype;
  return false;
#endif
}

int64_t k_step(at::ScalarType dtype) { return dtype == torch::kFloat ? 1 : dtype == torch::kBFloat16 ? 2 : 4; }

}  // namespace

// Whether small_gemm runs this weight dtype natively in this build and, given K (0: any), that K: bfloat16 packs K
// in pairs, int8 in quads.
bool native_small_gemm(at::ScalarType dtype, int64_t k) { return supports(dtype) && k % k_step(dtype) == 0; }

namespace ps {
// Whether bfloat16 small_gemm calls of more than one row (K a multiple of 32) run on AMX tiles.
bool amx_tiles() {
#if defined(__AVX512BF16__)
  return amx::available() && amx::enabled.load(std::memory_order_relaxed);
#else
  return false;
#endif
}
}  // namespace ps

// Turns the AMX path on or off (where available); returns amx_tiles() after the change.
bool set_amx_tiles(bool enable) {
#if defined(__AVX512BF16__)
  amx::enabled.store(enable);
#else
  (void)enable;
#endif
  return ps::amx_tiles();
}

// Whether small_gemm calls of 9-20 rows take K in chunks (never in builds without AVX-512).
bool small_gemm_chunks() {
#if defined(__AVX512F__)
  return chunks_on.load();
#else
  return false;
#endif
}

// Turns the chunks of K at 9-20 rows (thread_groups) on or off; returns whether they now run (never in builds
// without AVX-512). The default: chunks_measured_faster().
bool set_small_gemm_chunks(bool enable) {
#if defined(__AVX512F__)
  chunks_on.store(enable);
#else
  (void)enable;
#endif
  return small_gemm_chunks();
}

// The k steps a small_gemm call of up to 8 rows (one row tile) prefetches its weights ahead (0 in builds without
// AVX-512: no such tiles).
int64_t small_gemm_prefetch() {
#if defined(__AVX512F__)
  return one_tile_prefetch.load();
#else
  return 0;
#endif
}

// Sets that distance (0-64 k steps; a hint, the results do not change); returns small_gemm_prefetch() after it.
// The default: one_tile_prefetch_measured_best().
int64_t set_small_gemm_prefetch(int64_t steps) {
  TORCH_CHECK_VALUE(steps >= 0 && steps <= 64, "set_small_gemm_prefetch: 0-64 k steps, got ", steps);
#if defined(__AVX512F__)
  one_tile_prefetch.store(steps);
#endif
  return small_gemm_prefetch();
}

// [N, K] -> the packed blocks above (zero columns pad N to a multiple of 16). K a multiple of the dtype's k step.
torch::Tensor pack_small_gemm_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && supports(weight.scalar_type()),
              "pack_small_gemm_weight: a 2-D weight of a dtype this build runs natively (native_small_gemm)");
  const int64_t n = weight.size(0), k = weight.size(1), step = k_step(weight.scalar_type());
  TORCH_CHECK(native_small_gemm(weight.scalar_type(), k), "pack_small_gemm_weight: ", weight.scalar_type(),
              " packs K in groups of ", step, ", got K = ", k);
  const int64_t blocks = (n + 15) / 16;
  auto padded = torch::zeros({blocks * 16, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [B*16, K] -> [B, 16, K/step, step] -> [B, K/step, 16, step]
  return padded.view({blocks, 16, k / step, step}).permute({0, 2, 1, 3}).contiguous();
}

namespace {
void check_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                  const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && ps::is_act_dtype(x.scalar_type()), "small_gemm: x [M, K] in float32 or bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(1) * packed.size(3) == x.size(1) &&
                  packed.size(0) * 16 >= n && packed.size(0) * 16 < n + 16,
              "small_gemm: packed weight does not match x [M, K] and N");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "small_gemm: bias [N] of x's dtype");
}
}  // namespace

torch::Tensor small_gemm(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  check_packed(x, packed, n, bias);
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() && supports(x.scalar_type()),
              "small_gemm: x of the packed weight's dtype");
  [[maybe_unused]] const bool has_bias = bias.has_value() && bias->defined();  // used where a level runs the kernel
  auto y = torch::empty({x.size(0), n}, x.options());
#if defined(__AVX512F__)
  auto xc = x.contiguous();
  auto bc = has_bias ? bias->contiguous() : torch::Tensor();
  const auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const FloatOut<T> out{ps::ptr<T>(y), has_bias ? ps::ptr<T>(bc) : nullptr, n};
    small_gemm_kernel<T>(ps::ptr<T>(xc), xc.size(0), ps::ptr<T>(packed), out, n, xc.size(1));
  };
  if (x.scalar_type() == torch::kFloat) run(static_cast<float*>(nullptr));
#if defined(__AVX512BF16__)
  else if (xc.size(1) % 32 == 0 && ps::amx_tiles())
    amx::gemm<bf16>(ps::ptr<bf16>(xc), xc.size(0), ps::ptr<bf16>(packed),
                    FloatOut<bf16>{ps::ptr<bf16>(y), has_bias ? ps::ptr<bf16>(bc) : nullptr, n}, n, xc.size(1));
  else run(static_cast<bf16*>(nullptr));  // supports() let only float32 and bfloat16 through
#endif
#endif
  return y;
}

// x [M, K] (float32 or bfloat16) times an int8 weight packed by pack_small_gemm_weight, with its per-column scales
// (float32 [N]) and shifts (int32 [N]: 128 * the column's weight sum); y in x's dtype.
torch::Tensor small_gemm_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor col_scale, torch::Tensor col_shift,
                              int64_t n, c10::optional<torch::Tensor> bias) {
  check_packed(x, packed, n, bias);
  TORCH_CHECK(packed.scalar_type() == torch::kChar && supports(torch::kChar), "small_gemm_int8: an int8 packed weight "
              "in a build that runs it (native_small_gemm)");
  TORCH_CHECK(col_scale.scalar_type() == torch::kFloat && col_scale.numel() == n && col_scale.is_contiguous() &&
                  col_shift.scalar_type() == torch::kInt && col_shift.numel() == n && col_shift.is_contiguous(),
              "small_gemm_int8: column scales float32 [N] and shifts int32 [N]");
  [[maybe_unused]] const bool has_bias = bias.has_value() && bias->defined();  // used where a level runs the kernel
  auto y = torch::empty({x.size(0), n}, x.options());
#if defined(__AVX512BF16__)
  auto xc = x.contiguous();
  auto bc = has_bias ? bias->contiguous() : torch::Tensor();
  const int64_t rows = xc.size(0), k = xc.size(1);
  std::unique_ptr<uint8_t[]> xq(new uint8_t[rows * k]);  // every byte written by quantize_rows: no zero fill
  std::vector<float> row_scale(rows);
  ps::with_act_type(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    quantize_rows(ps::ptr<T>(xc), rows, k, xq.get(), row_scale.data());
    const Int8Out<T> out{ps::ptr<T>(y), has_bias ? ps::ptr<T>(bc) : nullptr, n, row_scale.data(),
                         ps::ptr<float>(col_scale), ps::ptr<int32_t>(col_shift)};
    // Two rows or more on AMX-INT8 tiles where the CPU has them: the packed int8 layout is TDPBUSD's B tiles.
    if (rows > 1 && k % 64 == 0 && ps::amx_tiles() && amx::int8_available())
      amx::gemm<int8_t>(xq.get(), rows, ps::ptr<int8_t>(packed), out, n, k);
    else
      small_gemm_kernel<int8_t>(xq.get(), rows, ps::ptr<int8_t>(packed), out, n, k);
  });
#endif
  return y;
}
