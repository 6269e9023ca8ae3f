// The entry points of the kernel files, as bindings.cpp exposes them to Python (and decode_layers.cpp calls them).
#pragma once

#include "torch_slice.h"

#include <cstdint>
#include <tuple>
#include <vector>

// decode_attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> out, int64_t window, double soft_cap = 0.0,
                                     c10::optional<torch::Tensor> sinks = c10::nullopt);
// prefill_attention.cpp
bool native_prefill(int64_t head_dim);
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_ids,
                             int64_t first, double scale, torch::Tensor out, bool causal, int64_t window,
                             double soft_cap, c10::optional<torch::Tensor> sinks);
// kv_write.cpp
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);
// layer_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> out);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up);
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor argmax_rows(torch::Tensor logits);
const char* kernel_isa();
// small_gemm.cpp
bool native_small_gemm(at::ScalarType dtype, int64_t k);
torch::Tensor pack_small_gemm_weight(torch::Tensor weight);
bool set_amx_tiles(bool enable);
bool set_small_gemm_chunks(bool enable);
bool small_gemm_chunks();
int64_t set_small_gemm_prefetch(int64_t steps);
int64_t small_gemm_prefetch();
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias);
torch::Tensor small_gemm_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor col_scale, torch::Tensor col_shift,
                              int64_t n, c10::optional<torch::Tensor> bias);
// decode_layers.cpp
std::tuple<torch::Tensor, torch::Tensor> decode_layers(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                       std::vector<torch::Tensor> weights, std::vector<int64_t> widths,
                                                       std::vector<torch::Tensor> caches, torch::Tensor cos,
                                                       torch::Tensor sin, std::vector<torch::Tensor> slot_mappings,
                                                       std::vector<torch::Tensor> block_tables,
                                                       torch::Tensor context_lens, std::vector<int64_t> layer_groups,
                                                       std::vector<int64_t> windows, int64_t num_heads,
                                                       int64_t num_kv_heads, int64_t head_dim, double eps,
                                                       double scale, std::vector<torch::Tensor> lora,
                                                       c10::optional<torch::Tensor> lora_rows,
                                                       std::vector<double> soft_caps,
                                                       std::vector<torch::Tensor> sandwich_norms, int64_t activation,
                                                       std::vector<torch::Tensor> extra_rope,
                                                       std::vector<int64_t> layer_rope);
// moe_experts.cpp
torch::Tensor fused_moe_experts(torch::Tensor x, torch::Tensor pair_tokens, torch::Tensor pair_weights,
                                std::vector<int64_t> counts, torch::Tensor w13, torch::Tensor w2, int64_t n13,
                                int64_t n2, c10::optional<torch::Tensor> scale13, c10::optional<torch::Tensor> shift13,
                                c10::optional<torch::Tensor> scale2, c10::optional<torch::Tensor> shift2,
                                c10::optional<torch::Tensor> layout13, c10::optional<torch::Tensor> layout2,
                                c10::optional<torch::Tensor> b13, c10::optional<torch::Tensor> b2, int64_t activation,
                                double alpha, double limit);
// bf16_weight_gemm.cpp
bool native_bf16_weight_gemm(int64_t k);
torch::Tensor bf16_weight_gemm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
// lora.cpp
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor row_slots,
              std::vector<int64_t> slices);
bool lora_bf16_pairs();
// quant_gemm.cpp
bool native_gguf_type(int64_t type);
torch::Tensor gguf_repack(torch::Tensor raw, int64_t type, int64_t n, int64_t k);
torch::Tensor gguf_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor layout, c10::optional<torch::Tensor> bias,
                        c10::optional<torch::Tensor> col_scale = c10::nullopt, bool per_row_activations = false);
