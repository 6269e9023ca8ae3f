// The experts of one MoE layer in one native call (layers/fused_moe/experts.py): for each expert with rows,
// y = act(rows W13^T + b13) W2^T + b2 on its weights, by the stack's kind: packed for small_gemm (float32, bfloat16
// [E, N/16, ...]) or small_gemm_int8 (int8, with scales and shifts); on CPUs where the small GEMM does not run the
// dtype (AVX2), Q8_0 blocks for gguf_gemm (uint8 [E, bytes]: int8 experts) or bfloat16 as stored for
// bf16_weight_gemm ([E, N, K]).
//
// Why one call: each small_gemm call is its own parallel region, so a layer of ~110 active experts (16-32 tokens on
// Qwen3-30B-A3B) cost ~220 thread barriers, each stalled whenever a thread is descheduled. Here, with at least two
// experts per thread, the experts are spread over the threads in one parallel region and each product runs on its
// thread alone (ATen runs a parallel_for nested in a parallel region inline); with fewer (decode of one or two
// tokens: 8-16 experts) each product keeps all the threads over its columns, as before.
#include "ops.h"

#include <ATen/Parallel.h>

namespace {
constexpr int64_t kSilu = 0, kSwigluOai = 1;

torch::Tensor activate(const torch::Tensor& h, int64_t activation, double alpha, double limit) {
  if (activation == kSilu) return silu_and_mul(h);
  // gpt-oss: (up + 1) * gate * sigmoid(alpha * gate), gate clamped to <= limit and up to [-limit, limit]
  const int64_t half = h.size(1) / 2;
  auto gate = h.narrow(1, 0, half).clamp_max(limit);
  auto up = h.narrow(1, half, half).clamp(-limit, limit);
  return up.add(1).mul_(gate.mul(gate.mul(alpha).sigmoid()));
}

torch::Tensor project(const torch::Tensor& x, const torch::Tensor& packed, int64_t e, int64_t n,
                      const c10::optional<torch::Tensor>& scale, const c10::optional<torch::Tensor>& shift,
                      const c10::optional<torch::Tensor>& bias) {
  c10::optional<torch::Tensor> b;
  if (bias.has_value() && bias->defined()) b = bias->select(0, e);
  if (scale.has_value() && scale->defined())
    return small_gemm_int8(x, packed.select(0, e), scale->select(0, e), shift->select(0, e), n, b);
  if (packed.scalar_type() == torch::kByte) {  // Q8_0 blocks repacked by gguf_repack: one part of n columns
    auto layout = torch::empty({1, 2}, torch::kLong);
    layout.data_ptr<int64_t>()[0] = 8;  // Q8_0's ggml type id
    layout.data_ptr<int64_t>()[1] = n;
    return gguf_gemm(x, packed.select(0, e), layout, b);
  }
  if (packed.dim() == 3) return bf16_weight_gemm(x, packed.select(0, e), b);  // bfloat16 [E, N, K] as stored
  return small_gemm(x, packed.select(0, e), n, b);
}
}  // namespace

torch::Tensor fused_moe_experts(torch::Tensor rows, std::vector<int64_t> counts, torch::Tensor w13, torch::Tensor w2,
                                int64_t n13, int64_t n2, c10::optional<torch::Tensor> scale13,
                                c10::optional<torch::Tensor> shift13, c10::optional<torch::Tensor> scale2,
                                c10::optional<torch::Tensor> shift2, c10::optional<torch::Tensor> b13,
                                c10::optional<torch::Tensor> b2, int64_t activation, double alpha, double limit) {
  TORCH_CHECK(rows.dim() == 2 && static_cast<int64_t>(counts.size()) == w13.size(0) && w2.size(0) == w13.size(0),
              "fused_moe_experts: rows [P, H] and one count per expert of the packed stacks");
  TORCH_CHECK_VALUE(activation == kSilu || activation == kSwigluOai, "fused_moe_experts: activation 0 or 1");
  std::vector<int64_t> experts, starts;
  int64_t start = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] > 0) experts.push_back(e), starts.push_back(start);
    start += counts[e];
  }
  TORCH_CHECK(start == rows.size(0), "fused_moe_experts: the counts sum to ", start, ", rows has ", rows.size(0));
  auto out = torch::empty({rows.size(0), n2}, rows.options());
  const auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = experts[i];
      auto h = project(rows.narrow(0, starts[i], counts[e]), w13, e, n13, scale13, shift13, b13);
      out.narrow(0, starts[i], counts[e]).copy_(
          project(activate(h, activation, alpha, limit), w2, e, n2, scale2, shift2, b2));
    }
  };
  const int64_t n = static_cast<int64_t>(experts.size());
  if (n >= 2 * at::get_num_threads()) at::parallel_for(0, n, 1, run);
  else run(0, n);
  return out;
}
