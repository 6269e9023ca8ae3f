// The experts of one MoE layer in one native call (layers/fused_moe/experts.py): for each expert with rows (the
// tokens routed to it, gathered here), y = act(rows W13^T + b13) W2^T + b2 on its weights, then each token's output
// is the sum of its experts' rows scaled by their routing weights. The products, by the stack's kind: packed for
// small_gemm (float32, bfloat16 [E, N/16, ...]) or small_gemm_int8 (int8, with scales and shifts); on CPUs where the
// small GEMM does not run the dtype (AVX2), GGUF blocks for gguf_gemm (uint8 [E, bytes] with the parts' layout: a
// GGUF file's experts kept as stored, or int8 experts as Q8_0) or bfloat16 as stored for bf16_weight_gemm ([E, N, K]).
//
// Why one call: each small_gemm call is its own parallel region, so a layer of ~110 active experts (16-32 tokens on
// Qwen3-30B-A3B) cost ~220 thread barriers, each stalled whenever a thread is descheduled. Here, with at least two
// experts per thread, the experts are spread over the threads in one parallel region and each product runs on its
// thread alone (ATen runs a parallel_for nested in a parallel region inline); with fewer (decode of one or two
// tokens: 8-16 experts) each product keeps all the threads over its columns, as before. The gather and the weighted
// sum are here too, not ATen's index/index_add_: on 2 threads those ops entered a parallel region each, and
// index_add_ (scatter_add_) took 50-110 ms for 8 rows of 2048 on a shared 2-core VM (0.2 ms on 1 thread); the sum
// runs on the calling thread up to kCombineSerialMacs multiply-adds (every decode step), in parallel above.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace {
constexpr int64_t kSilu = 0, kSwigluOai = 1;
constexpr int64_t kCombineSerialMacs = 1 << 20;  // a 32-token decode step of 8 experts x 2048 is 524288

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
                      const c10::optional<torch::Tensor>& layout, const c10::optional<torch::Tensor>& bias) {
  c10::optional<torch::Tensor> b;
  if (bias.has_value() && bias->defined()) b = bias->select(0, e);
  if (scale.has_value() && scale->defined())
    return small_gemm_int8(x, packed.select(0, e), scale->select(0, e), shift->select(0, e), n, b);
  if (packed.scalar_type() == torch::kByte)  // blocks repacked by gguf_repack, every expert's parts alike
    return gguf_gemm(x, packed.select(0, e), *layout, b);
  if (packed.dim() == 3) return bf16_weight_gemm(x, packed.select(0, e), b);  // bfloat16 [E, N, K] as stored
  return small_gemm(x, packed.select(0, e), n, b);
}

// out[t] = sum over the pairs p of token t of weight[p] * y[p], in float32; pairs_of[first[t], first[t + 1]) are
// token t's rows of y (a token with none gets zeros).
template <typename T>
void combine(const T* y, const float* weight, const std::vector<int64_t>& first,
             const std::vector<int64_t>& pairs_of, int64_t n, T* out) {
  const int64_t tokens = static_cast<int64_t>(first.size()) - 1;
  const int64_t pairs_per_token = static_cast<int64_t>(pairs_of.size()) / std::max<int64_t>(1, tokens);
  const int64_t macs_per_token = std::max<int64_t>(1, pairs_per_token) * n;
  at::parallel_for(0, tokens, std::max<int64_t>(1, kCombineSerialMacs / macs_per_token), [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(n);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = first[t]; i < first[t + 1]; ++i) {
        const int64_t p = pairs_of[i];
        const float w = weight[p];
        const T* row = y + p * n;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) acc[c] += w * ps::to_float(row[c]);
      }
      T* o = out + t * n;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = ps::from_float<T>(acc[c]);
    }
  });
}
}  // namespace

torch::Tensor fused_moe_experts(torch::Tensor x, torch::Tensor pair_tokens, torch::Tensor pair_weights,
                                std::vector<int64_t> counts, torch::Tensor w13, torch::Tensor w2, int64_t n13,
                                int64_t n2, c10::optional<torch::Tensor> scale13, c10::optional<torch::Tensor> shift13,
                                c10::optional<torch::Tensor> scale2, c10::optional<torch::Tensor> shift2,
                                c10::optional<torch::Tensor> layout13, c10::optional<torch::Tensor> layout2,
                                c10::optional<torch::Tensor> b13, c10::optional<torch::Tensor> b2, int64_t activation,
                                double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && ps::is_act_dtype(x.scalar_type()), "fused_moe_experts: x [T, H] float32 or bfloat16");
  const auto given = [](const c10::optional<torch::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK((w13.scalar_type() == torch::kByte) == given(layout13) &&
                  (w2.scalar_type() == torch::kByte) == given(layout2),
              "fused_moe_experts: a uint8 (GGUF block) stack comes with its parts' layout, and only it");
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == w13.size(0) && w2.size(0) == w13.size(0),
              "fused_moe_experts: one count per expert of the packed stacks");
  TORCH_CHECK(pair_tokens.dim() == 1 && pair_tokens.scalar_type() == torch::kLong && pair_weights.dim() == 1 &&
                  pair_weights.scalar_type() == torch::kFloat && pair_weights.numel() == pair_tokens.numel(),
              "fused_moe_experts: pair_tokens int64 [P] and pair_weights float32 [P]");
  TORCH_CHECK_VALUE(activation == kSilu || activation == kSwigluOai, "fused_moe_experts: activation 0 or 1");
  std::vector<int64_t> experts, starts;
  int64_t start = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] > 0) experts.push_back(e), starts.push_back(start);
    start += counts[e];
  }
  const int64_t pairs = pair_tokens.numel(), tokens = x.size(0);
  TORCH_CHECK(start == pairs, "fused_moe_experts: the counts sum to ", start, ", there are ", pairs, " pairs");
  const auto tok = pair_tokens.contiguous();
  const int64_t* token_of = tok.data_ptr<int64_t>();
  std::vector<int64_t> first(tokens + 1, 0), pairs_of(pairs);  // each token's pairs: a counting sort by token
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK_VALUE(token_of[p] >= 0 && token_of[p] < tokens, "fused_moe_experts: pair ", p, " names token ",
                      token_of[p], " of ", tokens);
    ++first[token_of[p] + 1];
  }
  for (int64_t t = 0; t < tokens; ++t) first[t + 1] += first[t];
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) pairs_of[next[token_of[p]]++] = p;
  auto y = torch::empty({pairs, n2}, x.options());
  const auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = experts[i];
      auto rows = x.index_select(0, tok.narrow(0, starts[i], counts[e]));
      auto h = project(rows, w13, e, n13, scale13, shift13, layout13, b13);
      y.narrow(0, starts[i], counts[e]).copy_(project(activate(h, activation, alpha, limit), w2, e, n2, scale2, shift2,
                                                      layout2, b2));
    }
  };
  const int64_t n = static_cast<int64_t>(experts.size());
  if (n >= 2 * at::get_num_threads()) at::parallel_for(0, n, 1, run);
  else run(0, n);
  auto out = torch::empty({tokens, n2}, x.options());
  const auto w = pair_weights.contiguous();
  ps::with_act_type(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    combine<T>(ps::ptr<T>(y), w.data_ptr<float>(), first, pairs_of, n2, ps::ptr<T>(out));
  });
  return out;
}
