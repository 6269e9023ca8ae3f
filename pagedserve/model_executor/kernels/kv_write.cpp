// New K/V rows written into the paged cache at their slots, converted to the cache's dtype.
#include "ops.h"
#include "paged_cache.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

using ps::CacheLayout;
using ps::from_float;
using ps::layout_of;
using ps::to_float;

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
