// Decode attention straight from the paged KV cache: no gathered or padded copy of any context.
//
// One task per sequence when there are enough sequences to fill the threads (each token's K/V row, all KV
// heads, is then one contiguous read), else per KV head or per query head. A task's query heads share every
// K/V row they read: pass 1 scores all keys, pass 2 sums values weighted by the softmax. Queries, accumulation and output are float32 whatever the cache dtype
// (float32, bfloat16 or float16): a bfloat16 cache halves the bytes that decode attention streams.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Cache element -> float. bfloat16 is read as its bits (a shift), which the compiler vectorizes.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16_bits) {
  const uint32_t u = static_cast<uint32_t>(bf16_bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

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

inline void softmax_inplace(float* s, int64_t len) {
  const float m = *std::max_element(s, s + len);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
};

template <typename T>
void decode_kernel(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, float* out, Shape s, float scale) {
  const int64_t group = s.num_heads / s.num_kv_heads, d = s.head_dim;
  const int64_t row = s.num_kv_heads * d;  // stride between consecutive token slots
  // Query heads per task: all of them when sequences alone keep every thread busy (one contiguous read of each
  // K/V row), one KV head's group when that gives enough tasks, else single heads (batch 1: 9 tasks, not 3).
  const int64_t threads = at::get_num_threads();
  const int64_t heads = s.num_seqs >= threads ? s.num_heads
                        : s.num_seqs * s.num_kv_heads >= 2 * threads ? group : 1;
  const int64_t tasks_per_seq = s.num_heads / heads;
  at::parallel_for(0, s.num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * d), acc(heads * d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq, h0 = (task % tasks_per_seq) * heads;  // first query head
      const int64_t len = context_lens[seq];
      const int64_t* table = block_tables + seq * s.max_blocks;
      const float* qs = q + (seq * s.num_heads + h0) * d;
      for (int64_t i = 0; i < heads * d; ++i) qf[i] = qs[i] * scale;
      scores.resize(heads * len);
      for (int64_t t = 0; t < len; ++t) {
        const T* k_row = k_cache + (table[t / s.block_size] * s.block_size + t % s.block_size) * row;
        for (int64_t h = 0; h < heads; ++h)
          scores[h * len + t] = dot(qf.data() + h * d, k_row + ((h0 + h) / group) * d, d);
      }
      for (int64_t h = 0; h < heads; ++h) softmax_inplace(scores.data() + h * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* v_row = v_cache + (table[t / s.block_size] * s.block_size + t % s.block_size) * row;
        for (int64_t h = 0; h < heads; ++h)
          axpy(scores[h * len + t], v_row + ((h0 + h) / group) * d, acc.data() + h * d, d);
      }
      std::copy(acc.begin(), acc.end(), out + (seq * s.num_heads + h0) * d);
    }
  });
}

}  // namespace

// q: [S, H, D] float32; k_cache, v_cache: [num_blocks, block_size, KVH, D] float32, bfloat16 or float16;
// block_tables: [S, max_blocks] int64; context_lens: [S] int64. Returns [S, H, D] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be contiguous float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong);
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const Shape s{q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), bt.size(1)};
  const float sc = static_cast<float>(scale);
  const auto* qp = q.data_ptr<float>();
  const auto* tp = bt.data_ptr<int64_t>();
  const auto* lp = lens.data_ptr<int64_t>();
  auto* op = out.data_ptr<float>();
  switch (k_cache.scalar_type()) {
    case torch::kFloat:
      decode_kernel(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, lp, op, s, sc);
      break;
    case torch::kBFloat16:
      decode_kernel(qp, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                    reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), tp, lp, op, s, sc);
      break;
    case torch::kHalf:
      decode_kernel(qp, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), tp, lp, op, s, sc);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV cache dtype ", k_cache.scalar_type());
  }
  return out;
}

// layer_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm(residual) (float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] projection (float32)");
  m.def("rotary_inplace", &rotary_inplace, "Neox-style rotary embedding in place (float32)");
}
