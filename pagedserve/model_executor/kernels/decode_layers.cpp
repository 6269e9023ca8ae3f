// A decode step's decoder layers in one native call: the same ops, in the same order, as the Python layers
// (models/llama.py), without the Python between them. At batch 1 that Python cost ~35 us per layer, about 1 ms of
// a 9-15 ms SmolLM2 step. Only for steps whose every row is a decode and whose every product runs on the native
// small GEMM (float32, bfloat16 or int8 weights) or the GGUF block kernel (quant_gemm.cpp), no tensor parallelism;
// the caller checks that and otherwise runs the Python layers. With multi-LoRA adapters in the step, each product
// is followed by its LoRA layer's batched delta (lora.cpp), as lora/layers.py runs it after the base product.
#include "ops.h"

#include <tuple>
#include <vector>

namespace {

constexpr int64_t kPerLayer = 20;  // tensors per layer in `weights`, in the order below
constexpr int64_t kLoRAPerLayer = 8;  // tensors per layer in `lora`: a and b of QKV, o, gate/up, down

c10::optional<torch::Tensor> present(const torch::Tensor& t) {  // an empty tensor stands for "none"
  return t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// x times one product's weight, w = {packed, bias, column scales, column shifts} (the last two for int8 weights
// only; GGUF blocks, uint8: w[2] their parts' layout), n output columns: the op Linear.forward calls for it.
torch::Tensor product(const torch::Tensor& x, const torch::Tensor* w, int64_t n) {
  if (w[0].scalar_type() == torch::kChar) return small_gemm_int8(x, w[0], w[2], w[3], n, present(w[1]));
  if (w[0].scalar_type() == torch::kByte) return gguf_gemm(x, w[0], w[2], present(w[1]));
  return small_gemm(x, w[0], n, present(w[1]));
}

}  // namespace

// x: [T, hidden] this step's hidden states (the embeddings before the first layer); residual: the residual stream,
// none before the first layer. weights, per layer: input norm, QKV product, q norm, k norm, o product,
// post-attention norm, gate/up product, down product, where a product is 4 tensors: packed weight, bias, column
// scales, column shifts (empty tensors: no bias, no q-k norms, no scales and shifts but for int8); widths, per
// layer: the QKV, o and gate/up output widths. caches: per layer K then V. cos, sin: [T, 1, D/2]. slot_mappings and
// block_tables: one per KV cache group (core/kv_cache_groups.py), layer i reading its group layer_groups[i]'s and
// attending to the last windows[i] positions (0: all). Returns (the last layer's MLP output, the residual stream
// before it), as the Python layers do. lora (empty: no adapter row in the step), per layer: lora_add's a and b of the
// QKV, o, gate/up and down projections; lora_rows: each row's slot.
std::tuple<torch::Tensor, torch::Tensor> decode_layers(torch::Tensor x, c10::optional<torch::Tensor> residual_opt,
                                                       std::vector<torch::Tensor> weights,
                                                       std::vector<int64_t> widths,
                                                       std::vector<torch::Tensor> caches, torch::Tensor cos,
                                                       torch::Tensor sin, std::vector<torch::Tensor> slot_mappings,
                                                       std::vector<torch::Tensor> block_tables,
                                                       torch::Tensor context_lens, std::vector<int64_t> layer_groups,
                                                       std::vector<int64_t> windows, int64_t num_heads,
                                                       int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                                                       std::vector<torch::Tensor> lora,
                                                       c10::optional<torch::Tensor> lora_rows,
                                                       std::vector<double> soft_caps,
                                                       std::vector<torch::Tensor> sandwich_norms, int64_t activation,
                                                       std::vector<torch::Tensor> extra_rope,
                                                       std::vector<int64_t> layer_rope) {
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(layers * 2 == static_cast<int64_t>(caches.size()) &&
                  static_cast<int64_t>(weights.size()) == layers * kPerLayer &&
                  static_cast<int64_t>(widths.size()) == layers * 3 &&
                  static_cast<int64_t>(layer_groups.size()) == layers &&
                  static_cast<int64_t>(windows.size()) == layers && slot_mappings.size() == block_tables.size(),
              "decode_layers: ", kPerLayer, " weight tensors, 3 widths, 2 caches, a group and a window per layer");
  for (int64_t g : layer_groups)
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(block_tables.size()), "decode_layers: no block table for group ", g);
  // Gemma's layer (each optional: empty for Llama's): per layer the attention's soft cap, its post-attention and
  // post-MLP norms (two per layer), GeGLU (activation 1) and RoPE tables per layer type (layer_rope[i]: 0 cos/sin,
  // j > 0 the pair extra_rope[2j - 2], [2j - 1])
  TORCH_CHECK((soft_caps.empty() || static_cast<int64_t>(soft_caps.size()) == layers) &&
                  (sandwich_norms.empty() || static_cast<int64_t>(sandwich_norms.size()) == 2 * layers) &&
                  (activation == 0 || activation == 1) && extra_rope.size() % 2 == 0 &&
                  (layer_rope.empty() || static_cast<int64_t>(layer_rope.size()) == layers),
              "decode_layers: a soft cap, two sandwich norms and a RoPE table index per layer, or none; activation 0 "
              "(silu) or 1 (gelu tanh)");
  for (int64_t r : layer_rope)
    TORCH_CHECK(r >= 0 && 2 * r <= static_cast<int64_t>(extra_rope.size()), "decode_layers: no RoPE table ", r);
  const bool with_lora = !lora.empty();
  TORCH_CHECK(!with_lora || (static_cast<int64_t>(lora.size()) == layers * kLoRAPerLayer && lora_rows.has_value()),
              "decode_layers: ", kLoRAPerLayer, " LoRA tensors per layer and the rows' slots, or none");
  const int64_t t = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::Tensor residual = residual_opt.has_value() ? *residual_opt : torch::Tensor();
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* w = weights.data() + i * kPerLayer;
    const int64_t* width = widths.data() + i * 3;
    const torch::Tensor* l = with_lora ? lora.data() + i * kLoRAPerLayer : nullptr;
    torch::Tensor h;
    if (!residual.defined()) {  // first layer: the embeddings are the residual stream
      residual = x;
      h = rms_norm(x, c10::nullopt, w[0], eps, c10::nullopt);
    } else {
      h = rms_norm(x, residual, w[0], eps, c10::nullopt);
    }
    const torch::Tensor qkv = product(h, w + 1, width[0]);
    if (with_lora) lora_add(qkv, h, l[0], l[1], *lora_rows, {q_size, kv_size, kv_size});
    const torch::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({t, num_heads + num_kv_heads, head_dim});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
    const torch::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
    if (w[5].numel() > 0) {  // Qwen3: per-head norms in place in the QKV output
      rms_norm(q, c10::nullopt, w[5], eps, q);
      rms_norm(k, c10::nullopt, w[6], eps, k);
    }
    const int64_t rope = layer_rope.empty() ? 0 : layer_rope[i];
    rotary_inplace(qk, rope == 0 ? cos : extra_rope[2 * rope - 2], rope == 0 ? sin : extra_rope[2 * rope - 1]);
    const int64_t g = layer_groups[i];
    write_kv(k, v, caches[2 * i], caches[2 * i + 1], slot_mappings[g]);
    const torch::Tensor o = paged_decode_attention(q, caches[2 * i], caches[2 * i + 1], block_tables[g], context_lens,
                                                   scale, c10::nullopt, windows[i],
                                                   soft_caps.empty() ? 0.0 : soft_caps[i]);
    h = product(o.view({t, q_size}), w + 7, width[1]);
    if (with_lora) lora_add(h, o.view({t, q_size}), l[2], l[3], *lora_rows, {width[1]});
    if (!sandwich_norms.empty()) h = rms_norm(h, c10::nullopt, sandwich_norms[2 * i], eps, c10::nullopt);
    h = rms_norm(h, residual, w[11], eps, c10::nullopt);
    const torch::Tensor gate_up = product(h, w + 12, width[2]);
    if (with_lora) lora_add(gate_up, h, l[4], l[5], *lora_rows, {width[2] / 2, width[2] / 2});
    const torch::Tensor act = activation == 1 ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up);
    x = product(act, w + 16, x.size(1));
    if (with_lora) lora_add(x, act, l[6], l[7], *lora_rows, {x.size(1)});
    if (!sandwich_norms.empty()) x = rms_norm(x, c10::nullopt, sandwich_norms[2 * i + 1], eps, c10::nullopt);
  }
  return {x, residual};
}
