"""The sparse MoE block of Mixtral / Qwen2-MoE / Qwen3-MoE: a linear router picks each token's top-k experts (softmax
in float32, optionally renormalised over the k), the experts' gated SiLU MLPs run over only their tokens
(experts.py: FusedMoE), and the outputs are summed with the routing weights; Qwen2-MoE adds a shared expert scaled
by a sigmoid gate.

Tensor parallel: like the dense MLP, every expert's (and the shared expert's) intermediate channels are split over
the ranks (gate/up by rows, down by columns); the router is replicated, so every rank routes each token to the same
experts, and one all-reduce sums the ranks' partial outputs.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.model_executor.layers.activation import silu_and_mul
from pagedserve.model_executor.layers.fused_moe.experts import FusedMoE
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.parallel_state import ParallelState
from pagedserve.model_executor.quantization.base import QuantizationConfig
from pagedserve.model_executor.quantization.gguf import GGUFExpertsMethod


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) as transformers routes: softmax over all experts in float32,
    top-k, renormalised over the k when the model says so. Renormalised, the softmax's denominator cancels: the
    softmax of the k top logits is the same weights, from one op on [T, k] (on [T, E], ATen's softmax entered a
    parallel region, 8 ms on a shared 2-core CPU)."""
    if renormalize:
        top, ids = torch.topk(router_logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    return torch.topk(probs, top_k, dim=-1)


def local_intermediate(size: int, parallel: ParallelState, what: str) -> int:
    """This rank's share of an expert's intermediate channels."""
    if size % parallel.tp_size:
        raise ValueError(f"{what} {size} is not divisible by tensor_parallel_size={parallel.tp_size}.")
    return size // parallel.tp_size


class SparseMoeBlock(nn.Module):
    """Parameters named for the checkpoint loader: gate.weight (the router), experts.w13_weight, experts.w2_weight, and
    with a shared expert shared_expert.{gate_up_proj,down_proj}.weight and shared_expert_gate.weight."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool,
                 shared_intermediate: int, parallel: ParallelState, quant_config: QuantizationConfig,
                 prefix: str) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.parallel = parallel
        # the router in the model dtype under every format, on the float layers' kernels (bfloat16 on an AVX2 CPU:
        # bf16_weight_gemm, not PyTorch's bfloat16 F.linear, which reads its weight once per row)
        self.gate = Linear(hidden, num_experts, False, quant_config.float_config, f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, hidden, local_intermediate(intermediate, parallel, "moe_intermediate_size"),
                                quant_config, f"{prefix}.experts")
        if parallel.tp_size > 1 and (isinstance(self.experts.method, GGUFExpertsMethod)
                                     or self.experts.checkpoint_experts is not None):
            raise ValueError("4-bit and GGUF MoE experts run with tensor_parallel_size=1.")
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate:
            shared = local_intermediate(shared_intermediate, parallel, "shared_expert_intermediate_size")
            self.shared_expert = nn.Module()
            self.shared_expert.gate_up_proj = Linear(hidden, 2 * shared, False, quant_config,
                                                     f"{prefix}.shared_expert.gate_up_proj")
            self.shared_expert.down_proj = Linear(shared, hidden, False, quant_config,
                                                  f"{prefix}.shared_expert.down_proj")
            self.shared_expert_gate = Linear(hidden, 1, False, quant_config.float_config,
                                             f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        y = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            s = self.shared_expert.down_proj(silu_and_mul(self.shared_expert.gate_up_proj(x), None))
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * s
        return self.parallel.all_reduce(y)
