// The paged KV cache as the attention and KV-write kernels see it: where token t's K/V rows of KV head h lie, and
// the layouts of the cache tensors they accept.
#pragma once

#include "torch_slice.h"

#include <cstdint>

namespace ps {
namespace {  // internal linkage, as attention_math.h

// Where a cache element lies (in elements): block b, slot t, KV head h at b * block_stride + t * token_stride +
// h * head_stride. Token-major blocks [block_size, KVH, D] (GPU, tests): token_stride KVH * D, head_stride D;
// head-major blocks [KVH, block_size, D] (the runner's CPU layout): token_stride D, head_stride block_size * D, so
// that each KV head's keys of a block are one contiguous run (a step's K rows of one head stream from one place
// instead of block_size places). block_stride is twice the block when a block's K and V share one run.
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

// The caches' layout. k_cache and v_cache: [num_blocks, block_size, KVH, D] views, one dtype and strides, each block
// one dense run, token-major (a contiguous [block_size, KVH, D]) or head-major (the view of a [KVH, block_size, D]
// block), any stride between blocks: separate tensors, or the K and V halves of one [num_blocks, 2, ...] tensor,
// where a block's K and V are one contiguous run.
inline CacheLayout layout_of(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
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
}  // namespace ps
