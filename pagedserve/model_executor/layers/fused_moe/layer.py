"""The sparse MoE block of Mixtral / Qwen2-MoE / Qwen3-MoE: a linear router picks each token's top-k experts (softmax
in float32, optionally renormalised over the k), the experts' gated SiLU MLPs run over only their tokens, and the
outputs are summed with the routing weights; Qwen2-MoE adds a shared expert scaled by a sigmoid gate.

The expert weights are stacked ([E, 2I, H] gate|up and [E, H, I] down) so the computation is grouped: the
(token, slot) pairs are sorted by expert id once, each expert runs one GEMM pair over its contiguous run of rows, and
the weighted rows are scattered back with one index_add. The Python loop is over experts that received tokens, never
over tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model_executor.layers.activation import silu_and_mul


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) as transformers routes: softmax over all experts in float32,
    top-k, renormalised over the k when the model says so."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k weight[t, k] * expert_{id[t, k]}(x[t]) for every token; x [T, H], w13 [E, 2I, H], w2 [E, H, I]."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token_of = order // k
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # one host sync per layer
    rows = x[token_of]
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            h = F.linear(rows[start:start + n], w13[e])
            out[start:start + n] = F.linear(silu_and_mul(h, None), w2[e])
            start += n
    out = out * topk_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out)


class SparseMoeBlock(nn.Module):
    """Parameters named for the checkpoint loader: gate.weight, experts.w13_weight, experts.w2_weight, and with a
    shared expert shared_expert.{gate_up_proj,down_proj}.weight and shared_expert_gate.weight."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool,
                 shared_intermediate: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.experts = nn.Module()
        self.experts.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype),
                                               requires_grad=False)
        self.experts.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype),
                                              requires_grad=False)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate:
            self.shared_expert = nn.Module()
            self.shared_expert.gate_up_proj = nn.Linear(hidden, 2 * shared_intermediate, bias=False, dtype=dtype)
            self.shared_expert.down_proj = nn.Linear(shared_intermediate, hidden, bias=False, dtype=dtype)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        y = fused_experts(x, self.experts.w13_weight, self.experts.w2_weight, weights, ids)
        if self.shared_expert is not None:
            s = self.shared_expert.down_proj(silu_and_mul(self.shared_expert.gate_up_proj(x), None))
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * s
        return y
