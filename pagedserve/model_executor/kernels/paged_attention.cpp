// Decode attention straight from the paged KV cache: no gathered or padded copy of any context.
//
// One task per (sequence, KV head). Its G = H / KVH query heads share every K/V row they read, so each
// row of the context is read from memory exactly once per step: pass 1 scores all keys, pass 2 sums
// values weighted by the softmax. Accumulation is in float32 whatever the cache dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim;  // stride between consecutive token slots
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t len = context_lens[seq];
      const int64_t* table = block_tables + seq * max_blocks;
      const T* qs = q + (seq * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = static_cast<float>(qs[i]) * scale;
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* key = k_cache + (table[t / block_size] * block_size + t % block_size) * row + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qf.data() + g * head_dim, key, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float m = *std::max_element(s, s + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - m));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* value = v_cache + (table[t / block_size] * block_size + t % block_size) * row + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + t], value, acc.data() + g * head_dim, head_dim);
      }
      T* o = out + (seq * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// q: [S, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_tables: [S, max_blocks] int64;
// context_lens: [S] int64. Returns [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong);
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0),
                            q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), bt.size(1),
                            static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
}
