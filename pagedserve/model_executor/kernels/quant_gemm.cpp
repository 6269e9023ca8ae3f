// x W^T for weights in llama.cpp's block-quantized GGUF types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), read as
// 4/5/6/8-bit integers
// and never dequantized to float in memory: the activations are quantized on the fly to int8 per block of 32 (one
// float scale each, llama.cpp's Q8 trick), so every block product is an integer dot product (VPDPBUSD on
// AVX512-VNNI, VPMADDUBSW + VPMADDWD on AVX-512 and AVX2, plain C++ at the generic level), scaled in float once per
// block of 32 and 16 output columns.
//
// Layout. The GGUF rows ([N, row bytes] as stored) are repacked once at load (gguf_repack) into tiles of 16 output
// columns, each a run of "units" along K (32 k for Q8_0/Q4_0, one 256-k super-block for the K-quants), so that a
// 64-byte vector holds 4 consecutive k of each of the 16 columns: the layout VPDPBUSD multiplies against 4
// activation bytes broadcast to every lane. Quantized values keep their bits (4-bit nibbles two a byte, Q6_K's low
// nibbles and high 2 bits apart, Q8_0 bytes); scales stay float16 or 6-bit / int8 integers as stored. Bits per
// weight: Q8_0 8.5, Q4_0 4.5, Q4_1 5, Q5_0 6.5, Q5_1 7, Q4_K 4.625, Q5_K 6.625, Q6_K 6.56 (GGUF: 8.5, 4.5, 5, 5.5, 6,
// 4.5, 5.5, 6.56; the 5-bit types keep their fifth bit in Q6_K's 2-bit planes, one bit unused).
//
//   Q8_0 unit (32 k):  d[16] f16 | q[8 groups][16 cols][4] int8 (with VNNI stored as q + 128, VPDPBUSD's unsigned)
//   Q4_0 unit (32 k):  d[16] f16 | nib[4 chunks][16][4]: low nibbles group c, high nibbles group c + 4 (w = d (q - 8))
//   Q5_0 unit (32 k):  Q4_0's | hi[2][16][4] as Q6_K's (bit 5 zero)  (w = d (q - 16))
//   Q4_1 unit (32 k):  d[16] f16 | m[16] f16 | nib as Q4_0's  (w = d q + m)
//   Q5_1 unit (32 k):  Q4_1's | hi[2][16][4] as Q5_0's  (w = d q + m)
//   Q4_K unit (256 k): d[16] f16 | dmin[16] f16 | sc[8][16] u8 | m[8][16] u8 | 8 x nib[4][16][4]
//                      (w = d sc_j q - dmin m_j in sub-block j of 32)
//   Q5_K unit (256 k): Q4_K's header | 8 x (nib[4][16][4] | hi[2][16][4] as Q5_0's)  (as Q4_K, q 5-bit)
//   Q6_K unit (256 k): d[16] f16 | sc[16][16] int8 | 8 x (nib[4][16][4] | hi[2][16][4]: bits 2s..2s+1 of chunk h
//                      are the high 2 bits of group 4h + s)  (w = d sc_i (q - 32) in sub-block i of 16)
#include "ops.h"
#include "vec.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kTile = 16;  // output columns of a tile
constexpr int kQ8_0 = 8, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;  // ggml ids
constexpr bool with_min(int type) { return type == kQ4_1 || type == kQ5_1; }  // 32-k blocks with an offset m

struct TypeInfo {
  int block;       // k per GGUF block
  int raw_bytes;   // bytes of a GGUF block
  int unit_bytes;  // bytes of a packed unit (one GGUF block of 16 columns)
};

bool type_info(int64_t type, TypeInfo* info) {
  switch (type) {
    case kQ8_0: *info = {32, 34, 32 + 512}; return true;
    case kQ4_0: *info = {32, 18, 32 + 256}; return true;
    case kQ5_0: *info = {32, 22, 32 + 256 + 128}; return true;
    case kQ4_1: *info = {32, 20, 64 + 256}; return true;
    case kQ5_1: *info = {32, 24, 64 + 256 + 128}; return true;
    case kQ4_K: *info = {256, 144, 32 + 32 + 128 + 128 + 8 * 256}; return true;
    case kQ5_K: *info = {256, 176, 32 + 32 + 128 + 128 + 8 * 384}; return true;
    case kQ6_K: *info = {256, 210, 32 + 256 + 8 * 384}; return true;
    default: return false;
  }
}

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline float half_to_float(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }

// Q4_K's 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Value k (0..block) of a GGUF block as the packed layout keeps it: Q8_0 int8 bits, Q4_0/Q4_1/Q4_K 0..15,
// Q5_0/Q5_1/Q5_K 0..31, Q6_K 0..63.
inline uint8_t raw_value(int type, const uint8_t* blk, int k) {
  switch (type) {
    case kQ8_0: return blk[2 + k];
    case kQ4_0: return k < 16 ? blk[2 + k] & 0xF : blk[2 + k - 16] >> 4;
    case kQ4_1: return k < 16 ? blk[4 + k] & 0xF : blk[4 + k - 16] >> 4;  // d, m, qs[16]
    case kQ5_0:  // d, qh[4] (bit k: value k's bit 4), qs[16]
    case kQ5_1: {  // d, m, qh[4], qs[16]
      const uint8_t* qh_at = blk + (type == kQ5_0 ? 2 : 4);
      uint32_t qh;
      std::memcpy(&qh, qh_at, 4);
      return (k < 16 ? qh_at[4 + k] & 0xF : qh_at[4 + k - 16] >> 4) | (((qh >> k) & 1) << 4);
    }
    case kQ4_K:  // d, dmin, scales[12], qs[128]
    case kQ5_K: {  // d, dmin, scales[12], qh[32] (bit k / 32 of byte k % 32: value k's bit 4), qs[128]
      const uint8_t* qs = blk + (type == kQ4_K ? 16 : 48) + (k / 64) * 32;
      const int l = k % 32;
      const uint8_t low = (k % 64) < 32 ? qs[l] & 0xF : qs[l] >> 4;
      return type == kQ4_K ? low : low | (((blk[16 + l] >> (k / 32)) & 1) << 4);
    }
    default: {  // Q6_K: ql[128] qh[64] scales[16] d
      const int half = k / 128, r = k % 128, l = r % 32, quarter = r / 32;
      const uint8_t* ql = blk + half * 64;
      const uint8_t* qh = blk + 128 + half * 32;
      const uint8_t low = quarter == 0 ? ql[l] & 0xF : quarter == 1 ? ql[l + 32] & 0xF
                        : quarter == 2 ? ql[l] >> 4 : ql[l + 32] >> 4;
      return low | (((qh[l] >> (2 * quarter)) & 3) << 4);
    }
  }
}

// 32 consecutive values (k0..k0+31 of a block) of 16 columns into the group layout: nib=false -> 8 groups of 64
// bytes; nib=true -> 4 chunks of 64 bytes, low nibble group c, high nibble group c + 4; hi2 (Q6_K) additionally
// writes the values' bits 4-5 in 2 chunks after the nibbles.
void pack32(int type, const uint8_t* const* blocks, int k0, bool nib, bool hi2, uint8_t* out) {
  uint8_t v[kTile][32];
  for (int c = 0; c < kTile; ++c)
    for (int k = 0; k < 32; ++k) v[c][k] = blocks[c] ? raw_value(type, blocks[c], k0 + k) : 0;
  if (!nib) {
    for (int g = 0; g < 8; ++g)
      for (int c = 0; c < kTile; ++c)
        for (int t = 0; t < 4; ++t) out[g * 64 + c * 4 + t] = v[c][4 * g + t];
    return;
  }
  for (int h = 0; h < 4; ++h)
    for (int c = 0; c < kTile; ++c)
      for (int t = 0; t < 4; ++t)
        out[h * 64 + c * 4 + t] = (v[c][4 * h + t] & 0xF) | ((v[c][4 * (h + 4) + t] & 0xF) << 4);
  if (!hi2) return;
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < kTile; ++c)
      for (int t = 0; t < 4; ++t) {
        uint8_t b = 0;
        for (int s = 0; s < 4; ++s) b |= ((v[c][4 * (4 * h + s) + t] >> 4) & 3) << (2 * s);
        out[256 + h * 64 + c * 4 + t] = b;
      }
}

// One unit (a GGUF block of each of 16 columns; null: a padding column) in the packed layout.
void pack_unit(int type, const uint8_t* const* blocks, uint8_t* out) {
  auto put16 = [&](int offset, auto&& value) {  // 16 per-column bytes or halves
    for (int c = 0; c < kTile; ++c) value(c, out + offset);
  };
  switch (type) {
    case kQ8_0:
    case kQ4_0:
    case kQ5_0:
      put16(0, [&](int c, uint8_t* o) { std::memcpy(o + 2 * c, blocks[c] ? blocks[c] : (const uint8_t*)"\0\0", 2); });
      pack32(type, blocks, 0, type != kQ8_0, type == kQ5_0, out + 32);
      return;
    case kQ4_1:
    case kQ5_1:
      for (int c = 0; c < kTile; ++c) {  // d, then m
        static const uint8_t zero[4] = {};
        const uint8_t* b = blocks[c] ? blocks[c] : zero;
        std::memcpy(out + 2 * c, b, 2);
        std::memcpy(out + 32 + 2 * c, b + 2, 2);
      }
      pack32(type, blocks, 0, true, type == kQ5_1, out + 64);
      return;
    case kQ4_K:
    case kQ5_K:
      for (int c = 0; c < kTile; ++c) {
        static const uint8_t zero[16] = {};
        const uint8_t* b = blocks[c] ? blocks[c] : zero;
        std::memcpy(out + 2 * c, b, 2);
        std::memcpy(out + 32 + 2 * c, b + 2, 2);
        for (int j = 0; j < 8; ++j) scale_min_k4(j, b + 4, out + 64 + j * 16 + c, out + 192 + j * 16 + c);
      }
      for (int j = 0; j < 8; ++j) {
        if (type == kQ4_K) pack32(type, blocks, 32 * j, true, false, out + 320 + j * 256);
        else pack32(type, blocks, 32 * j, true, true, out + 320 + j * 384);
      }
      return;
    default:  // Q6_K
      for (int c = 0; c < kTile; ++c) {
        static const uint8_t zero[210] = {};
        const uint8_t* b = blocks[c] ? blocks[c] : zero;
        std::memcpy(out + 2 * c, b + 208, 2);
        for (int i = 0; i < 16; ++i) out[32 + i * 16 + c] = b[192 + i];
      }
      for (int j = 0; j < 8; ++j) pack32(type, blocks, 32 * j, true, true, out + 288 + j * 384);
  }
}

// ------------------------------------------------------------------------------------------------ vector traits
// V::C columns per vector; W a vector of 4 bytes per column, I of int32 per column, F of float per column.
#if defined(__AVX512F__)
struct Vec {
  static constexpr int C = 16;
  using W = __m512i;
  using F = __m512;
#if defined(__AVX512VNNI__)
  static constexpr bool kVnni = true;
#else
  static constexpr bool kVnni = false;
#endif
  static W load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static W lo4(W v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static W hi4(W v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  static W bits45(W v, int s) {  // ((v >> 2s) & 3) << 4 per byte
    return _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(2 * s)), _mm512_set1_epi8(3)), 4);
  }
  static W or_(W a, W b) { return _mm512_or_si512(a, b); }
  static W bcast(const int8_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
  }
  static W zero() { return _mm512_setzero_si512(); }
  // acc + per column sum of 4 (unsigned w) x (signed x); w * x pairs stay within int16 for w < 128
  static W dot_us(W acc, W w, W x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
  }
  // int16 pair sums of (unsigned w) x (signed x), their sum, and their widening to int32 per column: without VNNI
  static W pairs(W w, W x) { return _mm512_maddubs_epi16(w, x); }
  static W add16(W a, W b) { return _mm512_add_epi16(a, b); }
  static W keep(W v) {  // an opaque copy: the running sum stays one register (see dot_groups)
    asm("" : "+v"(v));
    return v;
  }
  static W widen(W s16) { return _mm512_madd_epi16(s16, _mm512_set1_epi16(1)); }
  // acc + per column sum of 4 (signed w) x (signed x), without VNNI: |w| x sign(w) x
  static W dot_ss(W acc, W w, W x) {
    const __mmask64 neg = _mm512_movepi8_mask(w);
    return dot_us(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
  }
  static W sub(W a, int32_t s) { return _mm512_sub_epi32(a, _mm512_set1_epi32(s)); }
  static W add(W a, W b) { return _mm512_add_epi32(a, b); }
  static W mullo(W a, W b) { return _mm512_mullo_epi32(a, b); }
  static W load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F cvt(W v) { return _mm512_cvtepi32_ps(v); }
  static F set1(float f) { return _mm512_set1_ps(f); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F load_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F load_u8f(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__)
struct Vec {
  static constexpr int C = 8;
  using W = __m256i;
  using F = __m256;
  static constexpr bool kVnni = false;
  static W load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static W lo4(W v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static W hi4(W v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  static W bits45(W v, int s) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3)), 4);
  }
  static W or_(W a, W b) { return _mm256_or_si256(a, b); }
  static W bcast(const int8_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
  }
  static W zero() { return _mm256_setzero_si256(); }
  static W dot_us(W acc, W w, W x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
  }
  static W pairs(W w, W x) { return _mm256_maddubs_epi16(w, x); }
  static W add16(W a, W b) { return _mm256_add_epi16(a, b); }
  static W keep(W v) {  // an opaque copy: the running sum stays one register (see dot_groups)
    asm("" : "+x"(v));
    return v;
  }
  static W widen(W s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }
  static W dot_ss(W acc, W w, W x) { return dot_us(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w)); }
  static W sub(W a, int32_t s) { return _mm256_sub_epi32(a, _mm256_set1_epi32(s)); }
  static W add(W a, W b) { return _mm256_add_epi32(a, b); }
  static W mullo(W a, W b) { return _mm256_mullo_epi32(a, b); }
  static W load_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F cvt(W v) { return _mm256_cvtepi32_ps(v); }
  static F set1(float f) { return _mm256_set1_ps(f); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F load_f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static F load_u8f(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#else
// The generic level: one column a "vector" (W: its 4 bytes in a uint32, or an int32 sum), the same arithmetic.
struct Vec {
  static constexpr int C = 1;
  using W = uint32_t;
  using F = float;
  static constexpr bool kVnni = true;  // no int16 pairs to saturate: the unsigned form with an offset is exact
  static W load(const uint8_t* p) {
    W v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static W lo4(W v) { return v & 0x0F0F0F0Fu; }
  static W hi4(W v) { return (v >> 4) & 0x0F0F0F0Fu; }
  static W bits45(W v, int s) { return ((v >> (2 * s)) & 0x03030303u) << 4; }
  static W or_(W a, W b) { return a | b; }
  static W bcast(const int8_t* x) { return load(reinterpret_cast<const uint8_t*>(x)); }
  static W zero() { return 0; }
  static W dot_us(W acc, W w, W x) {
    int32_t s = static_cast<int32_t>(acc);
    for (int t = 0; t < 4; ++t) s += int32_t((w >> (8 * t)) & 0xFF) * int32_t(int8_t((x >> (8 * t)) & 0xFF));
    return static_cast<W>(s);
  }
  static W dot_ss(W acc, W w, W x) { return dot_us(acc, w, x); }  // unused (kVnni)
  static W sub(W a, int32_t s) { return static_cast<W>(static_cast<int32_t>(a) - s); }
  static W add(W a, W b) { return a + b; }
  static W mullo(W a, W b) { return static_cast<W>(static_cast<int32_t>(a) * static_cast<int32_t>(b)); }
  static W load_i8(const uint8_t* p) { return static_cast<W>(static_cast<int32_t>(static_cast<int8_t>(*p))); }
  static F fzero() { return 0.f; }
  static F cvt(W v) { return static_cast<float>(static_cast<int32_t>(v)); }
  static F set1(float f) { return f; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static F fnma(F a, F b, F c) { return c - a * b; }
  static F load_f16(const uint8_t* p) { return half_to_float(rd16(p)); }
  static F load_u8f(const uint8_t* p) { return static_cast<float>(*p); }
  static F loadf(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
};
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
#define PS_UNROLL_TILE _Pragma("GCC unroll 16")
#else
#define PS_UNROLL_TILE _Pragma("GCC unroll 1")
#endif

// ------------------------------------------------------------------------------------------------ activations
// Rows of x quantized per block of 32: q = round(x / d), d = max|x| / 127 over the block, or with one d per row
// (max|x| over the whole row: per-token quantization, what a W8A8 checkpoint's activations were calibrated with);
// with each block's sum of q (and of its two halves, for Q6_K's sub-blocks of 16), which take back the weights'
// unsigned offsets and Q4_K's mins.
struct ActQ {
  int64_t k;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum, sum16;
  const int8_t* row(int64_t m) const { return q.data() + m * k; }
};

template <typename T>
void quantize_acts(const T* x, int64_t m_rows, int64_t k, bool per_row, ActQ& a) {
  const int64_t nb = k / 32;
  a.k = k;
  a.q.resize(m_rows * k);
  a.d.resize(m_rows * nb);
  a.sum.resize(m_rows * nb);
  a.sum16.resize(m_rows * nb * 2);
  std::vector<float> row_amax(per_row ? m_rows : 0);
#pragma omp parallel for schedule(static) if (per_row && m_rows * k >= 65536)
  for (int64_t m = 0; m < static_cast<int64_t>(row_amax.size()); ++m)
    for (int64_t j = 0; j < k; ++j) row_amax[m] = std::max(row_amax[m], std::fabs(ps::to_float(x[m * k + j])));
#pragma omp parallel for schedule(static) if (m_rows * k >= 65536)
  for (int64_t i = 0; i < m_rows * nb; ++i) {
    const T* src = x + i * 32;
    float v[32], amax = 0.f;
    for (int j = 0; j < 32; ++j) {
      v[j] = ps::to_float(src[j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    if (per_row) amax = row_amax[i / nb];
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* q = a.q.data() + i * 32;
    int32_t s0 = 0, s1 = 0;
    for (int j = 0; j < 32; ++j) {
      q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
      (j < 16 ? s0 : s1) += q[j];
    }
    a.d[i] = d;
    a.sum[i] = s0 + s1;
    a.sum16[2 * i] = s0;
    a.sum16[2 * i + 1] = s1;
  }
}

// ------------------------------------------------------------------------------------------------ the tile kernel
// The largest value a type's packed weights take as unsigned bytes (Q8_0: stored as w + 128, VNNI only).
constexpr int value_max(int type) {
  return type == kQ8_0 ? 255 : type == kQ6_K ? 63 : (type == kQ5_0 || type == kQ5_1 || type == kQ5_K) ? 31 : 15;
}

// The N groups' dot products summed for R rows (activations x[r]) and NH column vectors (group g of vector h: w(h, g),
// read from a decoded chunk or decoded from the tile right here) into out[r * NH + h]: each weight vector is taken
// once for the R rows and each activation broadcast once for the NH vectors, so a pass of rows costs about one
// multiply per 32 weight-activation products and few loads. With VNNI: VPDPBUSD into int32 (in 4 independent chains
// for a lone row and vector: one chain of 8 dependent VPDPBUSD made a one-row product latency-bound, at about half the
// speed). Without: VPMADDUBSW's int16 pair sums (|pair| <= 2 VMAX 127, the activations being -127..127) are added as
// int16 for as many groups as cannot overflow (8 for 4-bit values, 4 for 5-bit, 2 for 6-bit) and widened to int32
// once per run: 2 instructions a group instead of 3. Q8_0's signed values (VMAX 0 here) take |w| x sign(w) x, widened
// every group. (V: names dependent, the generic level has no pairs().)
template <int N, int VMAX, int R, int NH, typename V = Vec, typename Values>
[[gnu::always_inline]] inline void dot_groups(const Values& w, const int8_t* const* x, typename V::W* out) {
  using W = typename V::W;
  if constexpr (V::kVnni || VMAX == 0) {  // one int32 dot product per group: VPDPBUSD, or |w| x sign(w) x
    // a lone row and vector in independent chains: 4 for VPDPBUSD, 2 for the longer signed form
    constexpr int kLoneChains = V::kVnni ? 4 : 2;
    constexpr int kChains = R * NH >= 4 ? 1 : N < kLoneChains ? N : kLoneChains;
    W s[R * NH][kChains];
    for (int i = 0; i < R * NH; ++i)
      for (int c = 0; c < kChains; ++c) s[i][c] = V::zero();
    for (int g = 0; g < N; ++g) {
      W wv[NH];
      for (int h = 0; h < NH; ++h) wv[h] = w(h, g);
      for (int r = 0; r < R; ++r) {
        const W xb = V::bcast(x[r] + 4 * g);
        for (int h = 0; h < NH; ++h) {
          W& chain = s[r * NH + h][g % kChains];
          if constexpr (V::kVnni) chain = V::dot_us(chain, wv[h], xb);
          else chain = V::dot_ss(chain, wv[h], xb);
        }
      }
    }
    for (int i = 0; i < R * NH; ++i) {
      for (int c = 1; c < kChains; ++c) s[i][0] = V::add(s[i][0], s[i][c]);
      out[i] = s[i][0];
    }
  } else {
    constexpr int kRun = 32767 / (2 * 127 * VMAX);
    static_assert(kRun >= 1 && N % (kRun < N ? kRun : N) == 0, "int16 pair sums would overflow");
    constexpr int run = kRun < N ? kRun : N;
    // With 2 or more sums, each one a register added to in order (V::keep): otherwise GCC reassociates the additions
    // into trees whose terms all stay live, and spills (one row's two vectors: the scales and the loop bound went to
    // the stack). With one, the tree is what hides VPADDW's latency; with two, the other sum's chain hides it.
    constexpr bool kPinned = R * NH >= 2;
    for (int g0 = 0; g0 < N; g0 += run) {
      W s16[R * NH];
      for (int i = 0; i < R * NH; ++i) s16[i] = V::zero();
#pragma GCC unroll 8
      for (int g = g0; g < g0 + run; ++g) {
        W wv[NH];
        for (int h = 0; h < NH; ++h) wv[h] = w(h, g);
        for (int r = 0; r < R; ++r) {
          const W xb = V::bcast(x[r] + 4 * g);
          for (int h = 0; h < NH; ++h) {
            s16[r * NH + h] = V::add16(s16[r * NH + h], V::pairs(wv[h], xb));
            if constexpr (kPinned) s16[r * NH + h] = V::keep(s16[r * NH + h]);
          }
        }
      }
      for (int i = 0; i < R * NH; ++i) out[i] = g0 == 0 ? V::widen(s16[i]) : V::add(out[i], V::widen(s16[i]));
    }
  }
}

// A 32-k block of one vector's columns (C of the tile's 16) is decoded as the dot products take it: the 8 groups'
// values as unsigned bytes (Q8_0: its signed bytes, stored as w + 128 with VNNI) and its BlockScales: the float
// scale per column (d, or d x the sub-block scale), with a min the float offset per column per unit of the
// activations' block sum (Q4_1/Q5_1: m; Q4_K/Q5_K: -dmin x the sub-block min), and Q6_K's two int sub-block scales
// (its d in `scale`).
struct BlockScales {
  Vec::F scale;
  Vec::F minc;
  Vec::W sc0, sc1;
};

// 32-k blocks per unit (a K-quant super-block holds 8).
constexpr int blocks_per_unit(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K ? 8 : 1; }

// Group g (4 k) of block j of unit p for vector h of the tile, as the dot products take it: the nibble split, the
// fifth / high two bits. Decoded where the dot product takes it (up to one pass of rows: a block's values are never
// all in registers at once), or once into a decoded chunk (more rows).
template <int TYPE>
[[gnu::always_inline]] inline Vec::W group_values(const uint8_t* p, int j, int h, int g) {
  const int col4 = h * Vec::C * 4;
  if constexpr (TYPE == kQ8_0) {
    return Vec::load(p + 32 + g * 64 + col4);  // with VNNI stored as w + 128 (gguf_repack)
  } else {
    const uint8_t* nib = TYPE == kQ4_K ? p + 320 + j * 256 : TYPE == kQ5_K ? p + 320 + j * 384
                       : TYPE == kQ6_K ? p + 288 + j * 384 : p + (with_min(TYPE) ? 64 : 32);
    const Vec::W raw = Vec::load(nib + (g % 4) * 64 + col4);
    Vec::W v = g < 4 ? Vec::lo4(raw) : Vec::hi4(raw);
    if constexpr (TYPE == kQ5_0 || TYPE == kQ5_1 || TYPE == kQ5_K || TYPE == kQ6_K)  // bits 2s..2s+1 of chunk g / 4
      v = Vec::or_(v, Vec::bits45(Vec::load(nib + 256 + (g / 4) * 64 + col4), g % 4));
    return v;
  }
}

// The scales of block j of unit p for vector h of the tile, into the caller's s: a block object returned by value
// kept its scales in memory, a store and a reload per block in the one-row loop.
template <int TYPE>
[[gnu::always_inline]] inline void unpack_scales(const uint8_t* p, int j, int h, BlockScales& s) {
  const int col2 = h * Vec::C * 2, col1 = h * Vec::C;
  if constexpr (TYPE == kQ8_0 || TYPE == kQ4_0 || TYPE == kQ5_0 || with_min(TYPE)) {
    s.scale = Vec::load_f16(p + col2);
    if constexpr (with_min(TYPE)) s.minc = Vec::load_f16(p + 32 + col2);
  } else if constexpr (TYPE == kQ4_K || TYPE == kQ5_K) {
    s.scale = Vec::mul(Vec::load_f16(p + col2), Vec::load_u8f(p + 64 + j * 16 + col1));
    const Vec::F dmin = Vec::load_f16(p + 32 + col2);
    s.minc = Vec::mul(Vec::set1(-1.f), Vec::mul(dmin, Vec::load_u8f(p + 192 + j * 16 + col1)));
  } else {  // Q6_K
    s.scale = Vec::load_f16(p + col2);
    s.sc0 = Vec::load_i8(p + 32 + (2 * j) * 16 + col1);
    s.sc1 = Vec::load_i8(p + 32 + (2 * j + 1) * 16 + col1);
  }
}

// acc[r * H + h] + block bi (0..K/32) of NH consecutive vectors of columns (values w(h, g), scales s[h]) times the
// activations of rows m0 + r of that block, for R rows (H: the vectors of the COLS columns a pass covers).
template <int TYPE, int R, int NH, int COLS, typename Values>
[[gnu::always_inline]] inline void accumulate(const Values& w, const BlockScales* s, const ActQ& a,
                                              int64_t m0, int64_t bi, typename Vec::F* acc) {
  using W = typename Vec::W;
  constexpr int H = COLS / Vec::C;
  const int64_t nb = a.k / 32;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.row(m0 + r) + bi * 32;
  W sum[R * NH];
  if constexpr (TYPE == kQ6_K) {  // two sub-blocks of 16, each with its scale
    W s0[R * NH], s1[R * NH];
    const int8_t* x1[R];
    for (int r = 0; r < R; ++r) x1[r] = x[r] + 16;
    dot_groups<4, value_max(TYPE), R, NH>(w, x, s0);
    dot_groups<4, value_max(TYPE), R, NH>([&](int h, int g) __attribute__((always_inline)) { return w(h, g + 4); },
                                          x1, s1);
    for (int r = 0; r < R; ++r) {
      const int64_t b = (m0 + r) * nb + bi;
      for (int h = 0; h < NH; ++h)
        sum[r * NH + h] = Vec::add(Vec::mullo(Vec::sub(s0[r * NH + h], 32 * a.sum16[2 * b]), s[h].sc0),
                                   Vec::mullo(Vec::sub(s1[r * NH + h], 32 * a.sum16[2 * b + 1]), s[h].sc1));
    }
  } else {
    constexpr bool signed_values = TYPE == kQ8_0 && !Vec::kVnni;
    dot_groups<8, signed_values ? 0 : value_max(TYPE), R, NH>(w, x, sum);
    if constexpr (!signed_values && !with_min(TYPE) && TYPE != kQ4_K && TYPE != kQ5_K) {
      // the values' unsigned offset (8, 16; Q8_0 with VNNI: 128) times the block's activation sum
      constexpr int offset = TYPE == kQ8_0 ? 128 : TYPE == kQ5_0 ? 16 : 8;
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < NH; ++h)
          sum[r * NH + h] = Vec::sub(sum[r * NH + h], offset * a.sum[(m0 + r) * nb + bi]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t b = (m0 + r) * nb + bi;
    const typename Vec::F xd = Vec::set1(a.d[b]);
    for (int h = 0; h < NH; ++h)
      acc[r * H + h] = Vec::fma(Vec::cvt(sum[r * NH + h]), Vec::mul(s[h].scale, xd), acc[r * H + h]);
    if constexpr (with_min(TYPE) || TYPE == kQ4_K || TYPE == kQ5_K) {  // + the min times the block's activation sum
      const typename Vec::F xsum = Vec::set1(a.d[b] * static_cast<float>(a.sum[b]));
      for (int h = 0; h < NH; ++h) acc[r * H + h] = Vec::fma(s[h].minc, xsum, acc[r * H + h]);
    }
  }
}

// R rows (m0..) of COLS columns (one tile, or several side by side): out[r][0..COLS) = (first ? 0 : out[r]) + x_r . w
// over the blocks that `blocks` visits. blocks(use) calls use(bi, h, w, s) for each block bi it covers and vector h
// (and, NH > 1, the NH - 1 vectors after it): the values w(0..NH, g) and scales s[NH], decoded from the tile
// (TileBlocks) or read from a DecodedChunk.
template <int TYPE, int R, int NH, int COLS, typename Blocks>
void rows_over_blocks(const Blocks& blocks, const ActQ& a, int64_t m0, bool first, float* out) {
  using F = typename Vec::F;
  constexpr int H = COLS / Vec::C;
  F acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = first ? Vec::fzero() : Vec::loadf(out + r * COLS + h * Vec::C);
  blocks([&](int64_t bi, int h, const auto& w, const BlockScales* s) __attribute__((always_inline)) {
    accumulate<TYPE, R, NH, COLS>(w, s, a, m0, bi, &acc[0][h]);
  });
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) Vec::store(out + r * COLS + h * Vec::C, acc[r][h]);
}

// Rows 0..m_rows in passes of 4 rows (the 1-3 left over in one pass).
template <int TYPE, int NH, int COLS, typename Blocks>
void rows_in_passes(const Blocks& blocks, const ActQ& a, int64_t m_rows, bool first, float* out) {
  constexpr int kRows = 4;  // rows per pass over the blocks (their accumulators stay in registers)
  int64_t m0 = 0;
  for (; m0 + kRows <= m_rows; m0 += kRows)
    rows_over_blocks<TYPE, kRows, NH, COLS>(blocks, a, m0, first, out + m0 * COLS);
  switch (m_rows - m0) {
    case 3: rows_over_blocks<TYPE, 3, NH, COLS>(blocks, a, m0, first, out + m0 * COLS); break;
    case 2: rows_over_blocks<TYPE, 2, NH, COLS>(blocks, a, m0, first, out + m0 * COLS); break;
    case 1: rows_over_blocks<TYPE, 1, NH, COLS>(blocks, a, m0, first, out + m0 * COLS); break;
    default: break;
  }
}

// A decode step's products stream their weights from memory once (they are in no cache), at every row count: as a
// pass of rows (TileBlocks, up to 4 rows) or the chunk decoding (more rows) reaches a block, it asks for the block
// kPrefetchBlocks on (16 x 32 k: two K-quant units, 16 of a 32-k type; past a tile's end, the next pass's tiles':
// tiles lie one after another), Q8_0's three tiles at once (TilesBlocks) for their unit kTilesPrefetchUnits on.
// Streaming from DRAM on a 2-vCPU Zen 5 (BENCHMARKS.md sections 49, 51): a Q4_K product from 28 to 44 GB/s at one
// row, the Q6_K LM head from 25 to 40, Q4_0 1.1-1.3x at one row and 1.1-1.7x at 4; at 8-32 rows, where the decoded
// chunk had no prefetch and ran at 5-10 GB/s, half the speed of the same product in cache, Q4_K_M's products
// 1.2-1.9x and Q4_0's 1.3-1.55x; Q8_0 unchanged by a farther distance.
constexpr int kPrefetchBlocks = 16;
constexpr int kTilesPrefetchUnits = 2;

[[gnu::always_inline]] inline void prefetch_slice(const uint8_t* unit_ahead, int slice_bytes, int slice) {
  for (int line = 0; line < slice_bytes; line += 64) __builtin_prefetch(unit_ahead + slice * slice_bytes + line, 0, 3);
}

// The tile's blocks decoded from it as a pass of rows reaches them: unit by unit, NH vectors at a time, and in a
// K-quant unit the 8 blocks of those vectors in turn (they share its d and dmin).
template <int TYPE, int NH>
struct TileBlocks {
  const uint8_t* tile;
  int64_t units;
  int unit_bytes;
  template <typename Use>
  [[gnu::always_inline]] void operator()(Use&& use) const {
    constexpr int H = kTile / Vec::C, per_unit = blocks_per_unit(TYPE);
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* p = tile + u * unit_bytes;
      // Unrolled, the accumulators stay in registers: in memory, each block's FMA waits on the last's store. Not at
      // the generic level, whose 16 one-column "vectors" would not fit the registers anyway: unrolled, they took the
      // compiler minutes per build.
      PS_UNROLL_TILE
      for (int h = 0; h < H; h += NH)
        for (int j = 0; j < per_unit; ++j) {
          if (h == 0) prefetch_slice(p + kPrefetchBlocks / per_unit * unit_bytes, unit_bytes / per_unit, j);
          BlockScales s[NH];
          for (int v = 0; v < NH; ++v) unpack_scales<TYPE>(p, j, h + v, s[v]);
          use(u * per_unit + j, h,
              [&](int v, int g) __attribute__((always_inline)) { return group_values<TYPE>(p, j, h + v, g); }, s);
        }
    }
  }
};

// The 32-k blocks of NT consecutive tiles (tile_bytes apart), every vector of the NT x 16 columns at once, read from
// the tiles as a pass of rows reaches them: Q8_0's, whose stored values are the dot products' operands (no decoding).
template <int TYPE, int NT>
struct TilesBlocks {
  const uint8_t* tile;
  int64_t tile_bytes, units;
  int unit_bytes;
  template <typename Use>
  [[gnu::always_inline]] void operator()(Use&& use) const {
    constexpr int HT = kTile / Vec::C, H = NT * HT;
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* p[H];
      BlockScales s[H];
      for (int h = 0; h < H; ++h) {
        p[h] = tile + h / HT * tile_bytes + u * unit_bytes;
        if (h % HT == 0) prefetch_slice(p[h] + kTilesPrefetchUnits * unit_bytes, unit_bytes, 0);
        unpack_scales<TYPE>(p[h], 0, h % HT, s[h]);
      }
      use(u, 0, [&](int h, int g) __attribute__((always_inline)) { return group_values<TYPE>(p[h], 0, h % HT, g); },
          s);
    }
  }
};

// The blocks of a chunk of NT tiles decoded: block b0 + i of vector h (of the NT x 16 columns) has values w[i][h] and
// scales s[i][h].
template <int NT>
struct DecodedChunk {
  static constexpr int kBlocks = 8;  // 256 k: 6 KB a tile (18 KB for three), L1-sized
  static constexpr int H = NT * kTile / Vec::C;
  Vec::W w[kBlocks][H][8];
  BlockScales s[kBlocks][H];
};

#if defined(__AVX2__) && !defined(__AVX512F__)
// Q8_0 at 2-4 rows on AVX2 (no VNNI): one pass of the R rows over both vectors of the tile at once. Its signed values
// take |w| x sign(w) x as dot_groups' VMAX 0 form does, but |w| is taken once per group for all R rows, each activation
// broadcast once for both vectors, and the pass's float sums live in `out` (L1) instead of registers, so that a
// block's 2 x R int32 sums stay in registers with no spill: rows_in_passes ran the tile twice (a vector at a time) and
// its 2-row loop spilled. (Beyond 4 rows this loop was measured no faster than the decoded chunk: both are bound by
// VPSIGNB, VPMADDUBSW and VPMADDWD, which share ports on a Zen 3: 3 per 32 products, where fbgemm's 7-bit activations
// need 2. An unsigned operand with an offset, w + 128 or x + 128, would save VPSIGNB, but VPMADDUBSW's pair sums then
// reach 2 x 255 x 127 and saturate int16. VPSIGNB has no 512-bit form: the AVX-512 levels keep dot_groups.)

// sum += t in sum's own register: an opaque in-place add, so that GCC neither reassociates the sums into trees
// (V::keep's reason) nor computes each into a new register and copies it back (which took 2 of the 16 to the stack).
[[gnu::always_inline]] inline void add_in_place(__m256i& sum, __m256i t) {
  asm("vpaddd %1, %0, %0" : "+x"(sum) : "x"(t));
}

template <int R>
void q8_0_rows(const uint8_t* tile, int64_t units, int unit_bytes, const ActQ& a, float* out /* [R][16] */) {
  const int64_t nb = a.k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) Vec::store(out + r * kTile + h * Vec::C, Vec::fzero());
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* p = tile + u * unit_bytes;
    __m256i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = Vec::zero();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i w0 = Vec::load(p + 32 + g * 64), w1 = Vec::load(p + 32 + g * 64 + 32);
      const __m256i abs0 = _mm256_abs_epi8(w0), abs1 = _mm256_abs_epi8(w1);
      for (int r = 0; r < R; ++r) {
        const __m256i xb = Vec::bcast(a.row(r) + u * 32 + 4 * g);
        add_in_place(sum[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(abs0, _mm256_sign_epi8(xb, w0)), ones));
        add_in_place(sum[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(abs1, _mm256_sign_epi8(xb, w1)), ones));
      }
    }
    const Vec::F scale0 = Vec::load_f16(p), scale1 = Vec::load_f16(p + 16);
    for (int r = 0; r < R; ++r) {
      const Vec::F xd = Vec::set1(a.d[r * nb + u]);
      float* o = out + r * kTile;
      Vec::store(o, Vec::fma(Vec::cvt(sum[r][0]), Vec::mul(scale0, xd), Vec::loadf(o)));
      Vec::store(o + Vec::C, Vec::fma(Vec::cvt(sum[r][1]), Vec::mul(scale1, xd), Vec::loadf(o + Vec::C)));
    }
  }
}
#endif

// All rows of NT consecutive tiles (tile_bytes apart): out [m_rows][NT x 16]. Up to one pass of rows (NT = 1), each
// block is decoded from the tile as the pass reaches it: one row of a 32-k type takes both vectors of the tile at once
// (each activation broadcast serves both, and the values are decoded group by group where the dot product takes
// them); otherwise one vector at a time (two vectors' sums for 2-4 rows, and a K-quant's d and dmin for both, would
// not fit the 16 AVX2 registers). Beyond, decoding per pass would redo the nibble split, the high bits and the scales
// for every 4 rows (most of a 6-bit block's work), so the tiles are decoded once, a chunk of blocks at a time into an
// L1-sized buffer, and every row runs over the chunk, all NT x 16 columns at once: both AVX2 halves of a tile, or,
// with AVX-512 (a tile one vector), three tiles, so that each activation broadcast serves three VPDPBUSD (with one
// tile, one broadcast per VPDPBUSD held the many-row product at about 200 GMAC/s a core on a Zen 4, where our int8
// small GEMM reaches 320-430; three tiles: 1.2-1.6x, BENCHMARKS section 45). Q8_0's values need no decoding with
// VNNI (stored as the unsigned operand): its passes read the three tiles themselves (TilesBlocks), which on a Zen 5
// was 1.1-1.27x the decoded chunk at 16 rows and 1.0-1.13x at 64 on one thread (the chunk's stores and reloads of
// every value gone), over the whole K (in stretches of 8 blocks, as the chunk, 0.91-0.96x at 64 rows); a 4-bit type's
// passes decoding its nibbles themselves ran 0.76-0.94x the chunk. Up to kQ8TilesMaxRows only: on two threads, the
// engine's, the chunk ran 1.2-1.46x these passes at 64 and 256 rows (their three tiles over the whole K, 52-156 KB,
// re-read for every 4 rows; BENCHMARKS.md section 51). Q8_0 takes this path at 1-4 rows too (gguf_gemm). (Q8_0 at
// 2-4 rows on AVX2: q8_0_rows, both vectors at once.)
constexpr int64_t kQ8TilesMaxRows = 16;

template <int TYPE, int NT>
void tile_all_rows(const uint8_t* tile, int64_t tile_bytes, int64_t units, int unit_bytes, const ActQ& a,
                   int64_t m_rows, float* out /* [m_rows][NT x 16] */) {
  constexpr int HT = kTile / Vec::C, per_unit = blocks_per_unit(TYPE);
  if constexpr (NT == 1) {
    if (m_rows == 1 && per_unit == 1)
      return rows_over_blocks<TYPE, 1, HT, kTile>(TileBlocks<TYPE, HT>{tile, units, unit_bytes}, a, 0, true, out);
#if defined(__AVX2__) && !defined(__AVX512F__)
    if constexpr (TYPE == kQ8_0) switch (m_rows) {
      case 2: return q8_0_rows<2>(tile, units, unit_bytes, a, out);
      case 3: return q8_0_rows<3>(tile, units, unit_bytes, a, out);
      case 4: return q8_0_rows<4>(tile, units, unit_bytes, a, out);
      default: break;
    }
#endif
    if (m_rows <= 4)
      return rows_in_passes<TYPE, 1, kTile>(TileBlocks<TYPE, 1>{tile, units, unit_bytes}, a, m_rows, true, out);
  }
  if constexpr (TYPE == kQ8_0 && NT > 1) {
    if (m_rows <= kQ8TilesMaxRows)
      return rows_in_passes<TYPE, NT * HT, NT * kTile>(TilesBlocks<TYPE, NT>{tile, tile_bytes, units, unit_bytes}, a,
                                                       m_rows, true, out);
  }
  using Chunk = DecodedChunk<NT>;
  Chunk chunk;
  const int64_t blocks = units * per_unit;
  // the unit kPrefetchBlocks past block bi's in tile nt: past the tile's end, the same tile of the next pass (NT
  // tiles on)
  const auto unit_ahead = [&](int64_t bi, int nt) __attribute__((always_inline)) {
    const int64_t u = (bi + kPrefetchBlocks) / per_unit;
    return tile + (u < units ? nt * tile_bytes + u * unit_bytes : (NT + nt) * tile_bytes + (u - units) * unit_bytes);
  };
  for (int64_t b0 = 0; b0 < blocks; b0 += Chunk::kBlocks) {
    const int64_t b1 = std::min<int64_t>(blocks, b0 + Chunk::kBlocks);
    for (int64_t bi = b0; bi < b1; ++bi)
      for (int h = 0; h < Chunk::H; ++h) {
        const uint8_t* p = tile + h / HT * tile_bytes + bi / per_unit * unit_bytes;
        if (h % HT == 0) prefetch_slice(unit_ahead(bi, h / HT), unit_bytes / per_unit, bi % per_unit);
        for (int g = 0; g < 8; ++g) chunk.w[bi - b0][h][g] = group_values<TYPE>(p, bi % per_unit, h % HT, g);
        unpack_scales<TYPE>(p, bi % per_unit, h % HT, chunk.s[bi - b0][h]);
      }
    auto decoded = [&](auto&& use) __attribute__((always_inline)) {
      for (int64_t bi = b0; bi < b1; ++bi) {
        const auto& values = chunk.w[bi - b0];
        use(bi, 0, [&](int h, int g) __attribute__((always_inline)) { return values[h][g]; }, chunk.s[bi - b0]);
      }
    };
    rows_in_passes<TYPE, Chunk::H, NT * kTile>(decoded, a, m_rows, b0 == 0, out);
  }
}

// Tiles decoded side by side for more than 4 rows (tile_all_rows): three with AVX-512 (4 rows x 3 vectors: 12 int32
// sums and 12 float accumulators of the 32 registers; two tiles measured 0.9-1.0x three), one with AVX2 (whose tile
// is already two vectors of its 16 registers) and at the generic level.
#if defined(__AVX512F__)
constexpr int kTilesPerPass = 3;
#else
constexpr int kTilesPerPass = 1;
#endif

// NT (1 or kTilesPerPass) consecutive tiles of one type, all rows: out [m_rows][NT x 16].
template <int NT>
void run_tiles(int64_t type, const uint8_t* tile, int64_t tile_bytes, int64_t units, int unit_bytes, const ActQ& a,
               int64_t m_rows, float* out) {
  switch (type) {
    case kQ8_0: return tile_all_rows<kQ8_0, NT>(tile, tile_bytes, units, unit_bytes, a, m_rows, out);
    case kQ4_0: return tile_all_rows<kQ4_0, NT>(tile, tile_bytes, units, unit_bytes, a, m_rows, out);
    case kQ5_0: return tile_all_rows<kQ5_0, NT>(tile, tile_bytes, units, unit_bytes, a, m_rows, out);
    case kQ4_1: return tile_all_rows<kQ4_1, NT>(tile, tile_bytes, units, unit_bytes, a, m_rows, out);
    case kQ5_1: return tile_all_rows<kQ5_1, NT>(tile, tile_bytes, units, unit_bytes, a, m_rows, out);
    case kQ4_K: return tile_all_rows<kQ4_K, NT>(tile, tile_bytes, units, unit_bytes, a, m_rows, out);
    case kQ5_K: return tile_all_rows<kQ5_K, NT>(tile, tile_bytes, units, unit_bytes, a, m_rows, out);
    default: return tile_all_rows<kQ6_K, NT>(tile, tile_bytes, units, unit_bytes, a, m_rows, out);
  }
}

}  // namespace

bool native_gguf_type(int64_t type) {
  TypeInfo info;
  return type_info(type, &info);
}

torch::Tensor gguf_repack(torch::Tensor raw, int64_t type, int64_t n, int64_t k) {
  TypeInfo info;
  TORCH_CHECK(type_info(type, &info), "gguf_repack: ggml type ", type, " has no native kernel");
  TORCH_CHECK(k % info.block == 0, "gguf_repack: K=", k, " is not a multiple of the type's block ", info.block);
  const int64_t units = k / info.block, row_bytes = units * info.raw_bytes;
  TORCH_CHECK(raw.scalar_type() == torch::kByte && raw.dim() == 2 && raw.size(0) == n && raw.size(1) >= row_bytes,
              "gguf_repack: raw blocks [N, row bytes] uint8");
  raw = raw.contiguous();
  const int64_t tiles = (n + kTile - 1) / kTile, stride = raw.size(1);
  torch::Tensor packed = torch::empty({tiles * units * info.unit_bytes}, torch::kByte);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* blocks[kTile];
      for (int c = 0; c < kTile; ++c) {
        const int64_t col = t * kTile + c;
        blocks[c] = col < n ? src + col * stride + u * info.raw_bytes : nullptr;
      }
      uint8_t* unit = dst + (t * units + u) * info.unit_bytes;
      pack_unit(static_cast<int>(type), blocks, unit);
      // Q8_0's values as VPDPBUSD takes them, unsigned w + 128, once here instead of on every read
      if (type == kQ8_0 && Vec::kVnni)
        for (int i = 32; i < info.unit_bytes; ++i) unit[i] ^= 0x80;
    }
  return packed;
}

torch::Tensor gguf_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor layout,
                        c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> col_scale,
                        bool per_row_activations) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "gguf_gemm: x [M, K] float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 1 && packed.is_contiguous(),
              "gguf_gemm: packed weight: the parts' repacked blocks one after another, flat uint8");
  TORCH_CHECK(layout.scalar_type() == torch::kLong && layout.dim() == 2 && layout.size(1) == 2 && layout.size(0) > 0 &&
                  layout.is_contiguous(), "gguf_gemm: layout [parts, 2] int64 (type, width)");
  x = x.contiguous();
  const int64_t m_rows = x.size(0), k = x.size(1), parts = layout.size(0);
  TORCH_CHECK(k % 32 == 0, "gguf_gemm: K must be a multiple of 32");
  const int64_t* part = layout.data_ptr<int64_t>();
  int64_t n_total = 0, bytes = 0;
  std::vector<int64_t> first_tile{0}, col0, offset;
  std::vector<TypeInfo> infos(parts);
  for (int64_t s = 0; s < parts; ++s) {
    const int64_t type = part[2 * s], width = part[2 * s + 1];
    TORCH_CHECK(type_info(type, &infos[s]) && k % infos[s].block == 0 && width > 0, "gguf_gemm: type ", type,
                " with K=", k, " and width ", width);
    const int64_t tiles = (width + kTile - 1) / kTile;
    col0.push_back(n_total);
    offset.push_back(bytes);
    n_total += width;
    bytes += tiles * (k / infos[s].block) * infos[s].unit_bytes;
    first_tile.push_back(first_tile.back() + tiles);
  }
  TORCH_CHECK(packed.numel() == bytes, "gguf_gemm: packed weight of ", packed.numel(), " bytes does not match its "
              "layout and K=", k, " (", bytes, " bytes)");
  // reused (a decode step calls this for every projection of every layer); a reference, as the OpenMP threads below
  // must read the calling thread's copy, not their own
  thread_local ActQ reused;
  ActQ& a = reused;
  ps::with_act_type(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    quantize_acts(ps::ptr<T>(x), m_rows, k, per_row_activations, a);
  });
  torch::Tensor out = torch::empty({m_rows, n_total}, x.options());
  // the optional per-column vectors as float32 (nullptr: absent)
  const auto column_floats = [n_total](const c10::optional<torch::Tensor>& t, const char* what) {
    if (!t.has_value() || !t->defined()) return torch::Tensor();
    torch::Tensor f = t->to(torch::kFloat).contiguous();
    TORCH_CHECK(f.numel() == n_total, "gguf_gemm: ", what, " of ", n_total, " outputs");
    return f;
  };
  const torch::Tensor bias_f = column_floats(bias, "bias"), col_scale_f = column_floats(col_scale, "col_scale");
  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const float* col_scale_ptr = col_scale_f.defined() ? col_scale_f.data_ptr<float>() : nullptr;
  // the work: runs of per_pass(s) consecutive tiles of part s (several for more than 4 rows, and for Q8_0 at every
  // row count: three tiles a pass at 1-4 rows ran 1.03-1.07x / 1.15-1.21x one at 1 / 4 rows on a Zen 5, where Q4_0's
  // decoded nibbles gained at 2 rows and lost at 4), then the part's last tiles that do not fill one, a tile each;
  // part s's runs are [first_run[s], first_run[s + 1])
  const auto per_pass = [&](int64_t s) { return m_rows > 4 || part[2 * s] == kQ8_0 ? kTilesPerPass : 1; };
  std::vector<int64_t> first_run{0};
  for (int64_t s = 0; s < parts; ++s) {
    const int64_t tiles = first_tile[s + 1] - first_tile[s];
    first_run.push_back(first_run.back() + tiles / per_pass(s) + tiles % per_pass(s));
  }
  const int64_t all_runs = first_run.back();
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  ps::with_act_type(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = ps::ptr<T>(out);
#pragma omp parallel
    {
      std::vector<float> buf(m_rows * kTile * kTilesPerPass);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < all_runs; ++r) {
        const size_t s = std::upper_bound(first_run.begin(), first_run.end(), r) - first_run.begin() - 1;
        const int64_t run = per_pass(s), j = r - first_run[s], full = (first_tile[s + 1] - first_tile[s]) / run;
        const int64_t t = j < full ? j * run : full * run + (j - full), n_tiles = j < full ? run : 1;
        const int64_t units = k / infos[s].block, tile_bytes = units * infos[s].unit_bytes;
        const uint8_t* tile = weights + offset[s] + t * tile_bytes;
        if (n_tiles == kTilesPerPass)
          run_tiles<kTilesPerPass>(part[2 * s], tile, tile_bytes, units, infos[s].unit_bytes, a, m_rows, buf.data());
        else
          run_tiles<1>(part[2 * s], tile, tile_bytes, units, infos[s].unit_bytes, a, m_rows, buf.data());
        const int64_t width = n_tiles * kTile, c0 = t * kTile;
        const int64_t cols = std::min<int64_t>(width, part[2 * s + 1] - c0);
        for (int64_t m = 0; m < m_rows; ++m)
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t col = col0[s] + c0 + c;
            const float y = buf[m * width + c] * (col_scale_ptr ? col_scale_ptr[col] : 1.f);
            o[m * n_total + col] = ps::from_float<T>(y + (bias_ptr ? bias_ptr[col] : 0.f));
          }
      }
    }
  });
  return out;
}
