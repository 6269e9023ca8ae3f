// Multi-LoRA's batched delta on CPU, by row index (Punica's BGMV, S-LoRA's idea): every row of a step adds its own
// adapter's B (A x) to a projection's output, y[r] += B[slot[r]] (A[slot[r]] x[r]), rows without an adapter
// (slot -1) left alone. Only the row's own slot is multiplied (the all-slot shrink with a one-hot mask it replaces
// did max_loras times the shrink's arithmetic), and the step's rows need not be sorted: the kernel groups them by
// slot itself, so a prefill's rows (one adapter per sequence, contiguous) and a decode step's (adapters interleaved)
// both run in tiles of up to kAdapterTileRows rows that share one read of their adapter's weights.
//
// Weights, in the model dtype (float32 or bfloat16), stacked in slots and laid out for this kernel (lora/layers.py
// writes them):
//   a [slots, in, S x R]: per slot the transposed A of every output slice s (S of them: 3 for a fused QKV, 2 for
//     gate/up, else 1) side by side, the rank padded with zero columns to R;
//   b [slots, R, out']: per slot B transposed (scaling folded in), slice s's output columns taking slice s's R ranks,
//     each slice's columns padded with zeros to a multiple of 16 (out' = the padded widths' sum).
// In builds with AVX512-BF16, bfloat16 weights come in pairs of k instead (VDPBF16PS's operand, as small_gemm.cpp
// packs them): a [slots, in/2, S x R, 2], b [slots, R/2, out', 2]; x and h are then bfloat16 too (h rounded once,
// as a bfloat16 layer's output is), at twice the float32 multiply-adds' rate.
// Both are "x times a row-major [k, n] matrix": the shrink h = x a[slot] (k = in, n = S x R), then per slice
// y[:, slice] += h[:, s R : (s + 1) R] b[slot][:, slice] (k = R). h stays in float32 registers and buffers; y is
// rounded once, when the delta is added (y = round(y + delta)). Every weight load is a whole vector (the padding):
// with masked loads in the loop GCC kept the accumulators on the stack, a store per multiply-add.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kAdapterTileRows = 8;  // rows sharing one pass over their slot's weights
constexpr int64_t kLanes = 16;    // output columns per accumulator vector

// Accumulator vectors per row and pass: up to 4 x 4 or 8 x 3 accumulators, with the pass's weight vectors, fit the
// 32 registers.
constexpr int group_vectors(int rows) { return rows > 4 ? 3 : 4; }

#if defined(__AVX512F__)
inline __m512 load_cols(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_cols(const ps::bf16* p, __mmask16 mask) { return ps::load16_tail(p, mask); }
inline void store_cols(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
// Rounded to nearest even, NaN kept, as ps::store16 rounds 16 of them.
inline void store_cols(ps::bf16* p, __m512 v, __mmask16 mask) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0))));
}
#endif

// Where a pass's results go, 16 columns of row m at a time: `Keep` stores the shrink's h (float32, or bfloat16 for
// the pairs), `Add` adds the delta to y's row (rows[m]), rounding once to y's dtype.
template <typename H>
struct Keep {
  H* h;
  int64_t ld;
#if defined(__AVX512F__)
  void operator()(int m, int64_t col, __m512 v, __mmask16 mask) const { store_cols(h + m * ld + col, v, mask); }
#else
  void operator()(int m, int64_t col, const float* v, int64_t count) const {
    for (int64_t c = 0; c < count; ++c) h[m * ld + col + c] = ps::from_float<H>(v[c]);
  }
#endif
};

template <typename T>
struct Add {
  T* y;
  int64_t ld;
  const int64_t* rows;
#if defined(__AVX512F__)
  void operator()(int m, int64_t col, __m512 v, __mmask16 mask) const {
    T* p = y + rows[m] * ld + col;
    store_cols(p, _mm512_add_ps(load_cols(p, mask), v), mask);
  }
#else
  void operator()(int m, int64_t col, const float* v, int64_t count) const {
    T* p = y + rows[m] * ld + col;
    for (int64_t c = 0; c < count; ++c) p[c] = ps::from_float<T>(ps::to_float(p[c]) + v[c]);
  }
#endif
};

// Columns [c0, c0 + NB x 16) of x [MT, k] (row stride xs) times w [k, n'] (row stride ld, n' >= c0 + NB x 16: whole
// vectors), each row's result handed to out, clipped to n (the last vector may be partial, none empty). x float32,
// or bfloat16 with w in pairs of k ([k/2][ld][2]). Not inlined (as small_gemm.cpp's tiles, for their registers).
#if defined(__AVX512F__)
template <int MT, int NB, typename XT, typename TW, typename Out>
__attribute__((noinline)) void columns(const XT* x, int64_t xs, int64_t k, const TW* w, int64_t ld, int64_t c0,
                                       int64_t n, const Out& out) {
  __mmask16 mask[NB];
  for (int j = 0; j < NB; ++j) {
    const int64_t valid = std::clamp<int64_t>(n - c0 - j * kLanes, 0, kLanes);
    mask[j] = static_cast<__mmask16>((1u << valid) - 1);
  }
  __m512 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<XT, ps::bf16>) {
    for (int64_t p = 0; p < k / 2; ++p) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + (p * ld + c0 + j * kLanes) * 2);
      for (int m = 0; m < MT; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * xs + 2 * p, sizeof pair);
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)wv[j], (__m512bh)xv);
      }
    }
  } else
#endif
  {
    for (int64_t kk = 0; kk < k; ++kk) {
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = ps::load16(w + kk * ld + c0 + j * kLanes);
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * xs + kk]);
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MT; ++m) out(m, c0 + j * kLanes, acc[m][j], mask[j]);
}
#else
template <int MT, int NB, typename XT, typename TW, typename Out>
void columns(const XT* x, int64_t xs, int64_t k, const TW* w, int64_t ld, int64_t c0, int64_t n, const Out& out) {
  float acc[MT][NB * kLanes] = {};
  const int64_t width = std::min<int64_t>(NB * kLanes, n - c0);
  for (int64_t kk = 0; kk < k; ++kk) {
    const TW* wr = w + kk * ld + c0;
    for (int m = 0; m < MT; ++m) {
      const float xv = x[m * xs + kk];
#pragma omp simd
      for (int64_t c = 0; c < NB * kLanes; ++c) acc[m][c] += xv * ps::to_float(wr[c]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int64_t c = 0; c < width; c += kLanes) out(m, c0 + c, acc[m] + c, std::min(kLanes, width - c));
}
#endif

inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// All n columns of x [MT, k] times w [k, n' >= n padded to 16], in passes of NB vectors (the last pass narrower).
template <int MT, typename XT, typename TW, typename Out>
void product(const XT* x, int64_t xs, int64_t k, const TW* w, int64_t ld, int64_t n, const Out& out) {
  constexpr int NB = group_vectors(MT);
  for (int64_t c0 = 0; c0 < n; c0 += NB * kLanes) {
    const int64_t left = (n - c0 + kLanes - 1) / kLanes;
    if (left >= NB) columns<MT, NB>(x, xs, k, w, ld, c0, n, out);
    else if (left == 3) columns<MT, 3>(x, xs, k, w, ld, c0, n, out);
    else if (left == 2) columns<MT, 2>(x, xs, k, w, ld, c0, n, out);
    else columns<MT, 1>(x, xs, k, w, ld, c0, n, out);
  }
}

template <typename XT, typename TW, typename Out>
void product_rows(int64_t rows, const XT* x, int64_t xs, int64_t k, const TW* w, int64_t ld, int64_t n,
                  const Out& out) {
  switch (rows) {
    case 8: product<8>(x, xs, k, w, ld, n, out); break;
    case 7: product<7>(x, xs, k, w, ld, n, out); break;
    case 6: product<6>(x, xs, k, w, ld, n, out); break;
    case 5: product<5>(x, xs, k, w, ld, n, out); break;
    case 4: product<4>(x, xs, k, w, ld, n, out); break;
    case 3: product<3>(x, xs, k, w, ld, n, out); break;
    case 2: product<2>(x, xs, k, w, ld, n, out); break;
    default: product<1>(x, xs, k, w, ld, n, out); break;
  }
}

// Pairs: bfloat16 weights in pairs of k, x and h bfloat16 (builds with AVX512-BF16); else x and h float32.
template <typename T, bool Pairs>
void lora_kernel(T* y, int64_t y_stride, const T* x, int64_t x_stride, const T* a, const T* b,
                 const std::vector<int64_t>& tile_rows, const std::vector<int64_t>& tile_start,
                 const std::vector<int64_t>& tile_slot, int64_t in, int64_t b_width,
                 const std::vector<int64_t>& slices, int64_t rank) {
  const int64_t num_slices = static_cast<int64_t>(slices.size()), shrunk = num_slices * rank;
  const int64_t tiles = static_cast<int64_t>(tile_slot.size());
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    using XT = std::conditional_t<Pairs, ps::bf16, float>;
    constexpr int64_t kColumn = Pairs ? 2 : 1;  // elements per weight column and k step
    std::vector<XT> xf(kAdapterTileRows * in), h(kAdapterTileRows * shrunk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t* rows = tile_rows.data() + tile_start[t];
      const int64_t m = tile_start[t + 1] - tile_start[t], slot = tile_slot[t];
      for (int64_t i = 0; i < m; ++i) {
        const T* xr = x + rows[i] * x_stride;
        XT* xo = xf.data() + i * in;
#pragma omp simd
        for (int64_t c = 0; c < in; ++c) xo[c] = ps::from_float<XT>(ps::to_float(xr[c]));
      }
      product_rows(m, xf.data(), in, in, a + slot * in * shrunk, shrunk, shrunk, Keep<XT>{h.data(), shrunk});
      int64_t offset = 0, padded_offset = 0;
      for (int64_t s = 0; s < num_slices; ++s) {
        product_rows(m, h.data() + s * rank, shrunk, rank, b + slot * rank * b_width + padded_offset * kColumn,
                     b_width, slices[s], Add<T>{y + offset, y_stride, rows});
        offset += slices[s];
        padded_offset += padded(slices[s]);
      }
    }
  });
}

}  // namespace

// y [T, out] += each row's adapter delta, in place (see above). x [T, in]; a [slots, in, S x R]; b [slots, R, out']
// (out': the slices' widths padded to 16, summed); row_slots int64 [T], a slot or -1; slices: the S output slice
// widths (summing to out). y, x, a, b of one dtype; R a multiple of 16.
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor row_slots,
              std::vector<int64_t> slices) {
  TORCH_CHECK(ps::is_act_dtype(y.scalar_type()) && x.scalar_type() == y.scalar_type() &&
                  a.scalar_type() == y.scalar_type() && b.scalar_type() == y.scalar_type(),
              "lora_add: y, x, a and b of one dtype, float32 or bfloat16");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.stride(1) == 1 && x.stride(1) == 1 && x.size(0) == y.size(0),
              "lora_add: y [T, out] and x [T, in] with contiguous rows");
  int64_t total = 0, padded_total = 0;
  for (int64_t s : slices) total += s, padded_total += padded(s);
  TORCH_CHECK(total == y.size(1), "lora_add: the slices must sum to y's width");
  const bool pairs = a.dim() == 4;  // (k halved, a pair per column)
  TORCH_CHECK(!pairs || (lora_bf16_pairs() && a.scalar_type() == torch::kBFloat16 && a.size(3) == 2 &&
                         b.dim() == 4 && b.size(3) == 2),
              "lora_add: weights in pairs of k are bfloat16 [.., 2], for builds with AVX512-BF16 (lora_bf16_pairs)");
  const int64_t k_rows = pairs ? 2 : 1;
  TORCH_CHECK(a.dim() == b.dim() && (a.dim() == 3 || pairs) && a.is_contiguous() && b.is_contiguous() &&
                  a.size(0) == b.size(0) && a.size(1) * k_rows == x.size(1) && b.size(2) == padded_total &&
                  (b.size(1) * k_rows) % kLanes == 0 &&
                  a.size(2) == static_cast<int64_t>(slices.size()) * b.size(1) * k_rows,
              "lora_add: a [slots, in, S x R] and b [slots, R, out'] contiguous (R a multiple of 16, out' the "
              "slices' widths padded to 16; in pairs of k: [slots, in/2, S x R, 2] and [slots, R/2, out', 2]), "
              "matching x, y and the S slices");
  auto slots = row_slots.contiguous();
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == y.size(0),
              "lora_add: row_slots int64 [T]");
  const int64_t rows = y.size(0), num_slots = a.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  // Rows grouped by slot (a counting sort, rows in order within a slot), then cut into tiles of kAdapterTileRows.
  std::vector<int64_t> count(num_slots + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(sp[r] >= -1 && sp[r] < num_slots, "lora_add: row slot ", sp[r], " outside [-1, ", num_slots, ")");
    if (sp[r] >= 0) ++count[sp[r] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) count[s + 1] += count[s];
  std::vector<int64_t> order(count[num_slots]), next(count.begin(), count.end() - 1);
  for (int64_t r = 0; r < rows; ++r)
    if (sp[r] >= 0) order[next[sp[r]]++] = r;
  std::vector<int64_t> tile_start{0}, tile_slot;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t i = count[s]; i < count[s + 1]; i += kAdapterTileRows) {
      tile_slot.push_back(s);
      tile_start.push_back(std::min(i + kAdapterTileRows, count[s + 1]));
    }
  if (tile_slot.empty()) return;
  const int64_t rank = b.size(1) * k_rows;
  if (pairs) {
#if defined(__AVX512BF16__)
    lora_kernel<ps::bf16, true>(ps::ptr<ps::bf16>(y), y.stride(0), ps::ptr<ps::bf16>(x), x.stride(0),
                                ps::ptr<ps::bf16>(a), ps::ptr<ps::bf16>(b), order, tile_start, tile_slot, x.size(1),
                                b.size(2), slices, rank);
#endif
    return;
  }
  ps::with_act_type(y.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    lora_kernel<T, false>(ps::ptr<T>(y), y.stride(0), ps::ptr<T>(x), x.stride(0), ps::ptr<T>(a), ps::ptr<T>(b),
                          order, tile_start, tile_slot, x.size(1), b.size(2), slices, rank);
  });
}

// Whether this build takes bfloat16 LoRA weights in pairs of k (AVX512-BF16's VDPBF16PS; lora/layers.py lays them
// out so where it does).
bool lora_bf16_pairs() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}
