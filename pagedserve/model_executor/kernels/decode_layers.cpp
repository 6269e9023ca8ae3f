// A decode step's decoder layers in one native call: the same ops, in the same order, as the Python layers
// (models/llama.py), without the Python between them. At batch 1 that Python cost ~35 us per layer, about 1 ms of
// a 9-15 ms SmolLM2 step (BENCHMARKS.md section 6, "Twelfth pass"). Only for steps whose every row is a decode
// and whose every product runs on the native small GEMM (float32 or bfloat16 weights, no tensor parallelism);
// the caller checks that and otherwise runs the Python layers.
#include <torch/extension.h>

#include <tuple>
#include <vector>

// layer_ops.cpp, small_gemm.cpp, paged_attention.cpp
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> out);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> out);

namespace {

constexpr int64_t kPerLayer = 12;  // tensors per layer in `weights`, in the order below

c10::optional<torch::Tensor> present(const torch::Tensor& t) {  // an empty tensor stands for "none"
  return t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

}  // namespace

// x: [T, hidden] this step's hidden states (the embeddings before the first layer); residual: the residual stream,
// none before the first layer. weights, per layer: input norm, QKV packed, QKV bias, q norm, k norm, o packed,
// o bias, post-attention norm, gate/up packed, gate/up bias, down packed, down bias (empty tensors: no bias / no
// q-k norms); widths, per layer: the QKV, o and gate/up output widths. caches: per layer K then V. cos, sin:
// [T, 1, D/2]. Returns (the last layer's MLP output, the residual stream before it), as the Python layers do.
std::tuple<torch::Tensor, torch::Tensor> decode_layers(torch::Tensor x, c10::optional<torch::Tensor> residual_opt,
                                                       std::vector<torch::Tensor> weights,
                                                       std::vector<int64_t> widths,
                                                       std::vector<torch::Tensor> caches, torch::Tensor cos,
                                                       torch::Tensor sin, torch::Tensor slot_mapping,
                                                       torch::Tensor block_tables, torch::Tensor context_lens,
                                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                                       double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(layers * 2 == static_cast<int64_t>(caches.size()) &&
                  static_cast<int64_t>(weights.size()) == layers * kPerLayer &&
                  static_cast<int64_t>(widths.size()) == layers * 3,
              "decode_layers: ", kPerLayer, " weight tensors, 3 widths and 2 caches per layer");
  const int64_t t = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::Tensor residual = residual_opt.has_value() ? *residual_opt : torch::Tensor();
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* w = weights.data() + i * kPerLayer;
    const int64_t* width = widths.data() + i * 3;
    torch::Tensor h;
    if (!residual.defined()) {  // first layer: the embeddings are the residual stream
      residual = x;
      h = rms_norm(x, c10::nullopt, w[0], eps, c10::nullopt);
    } else {
      h = rms_norm(x, residual, w[0], eps, c10::nullopt);
    }
    const torch::Tensor qkv = small_gemm(h, w[1], width[0], present(w[2]));
    const torch::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({t, num_heads + num_kv_heads, head_dim});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
    const torch::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
    if (w[3].numel() > 0) {  // Qwen3: per-head norms in place in the QKV output
      rms_norm(q, c10::nullopt, w[3], eps, q);
      rms_norm(k, c10::nullopt, w[4], eps, k);
    }
    rotary_inplace(qk, cos, sin);
    write_kv(k, v, caches[2 * i], caches[2 * i + 1], slot_mapping);
    const torch::Tensor o = paged_decode_attention(q, caches[2 * i], caches[2 * i + 1], block_tables, context_lens,
                                                   scale, c10::nullopt);
    h = small_gemm(o.view({t, q_size}), w[5], width[1], present(w[6]));
    h = rms_norm(h, residual, w[7], eps, c10::nullopt);
    x = small_gemm(silu_and_mul(small_gemm(h, w[8], width[2], present(w[9]))), w[10], x.size(1), present(w[11]));
  }
  return {x, residual};
}
