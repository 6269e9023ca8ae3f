"""Gated activations of a fused [gate | up] projection, and the pointwise ones a linear layer may fuse into its
GEMM (Linear.forward's `activation`)."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PointwiseActivation:
    """An activation applied to a product's output: `fn` in PyTorch, and oneDNN's post-op (attr, algorithm) that
    applies it inside the GEMM while the output tile is still in cache (one pass over [rows, out] less)."""
    fn: Callable[[torch.Tensor], torch.Tensor]
    onednn_attr: str
    onednn_algorithm: str


# Hugging Face's hidden_act names (BERT-style MLPs)
POINTWISE_ACTIVATIONS = {
    "gelu": PointwiseActivation(F.gelu, "gelu", "none"),  # erf
    "gelu_new": PointwiseActivation(lambda x: F.gelu(x, approximate="tanh"), "gelu", "tanh"),
    "gelu_pytorch_tanh": PointwiseActivation(lambda x: F.gelu(x, approximate="tanh"), "gelu", "tanh"),
    "relu": PointwiseActivation(F.relu, "relu", ""),
}


def silu_and_mul(gate_up: torch.Tensor, ops: ModuleType | None) -> torch.Tensor:
    """silu(gate) * up (one kernel by `ops.silu_and_mul`, the attention backend's fused op, when there is one)."""
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor, ops: ModuleType | None = None) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up: GeGLU (Gemma's `gelu_pytorch_tanh`); one kernel by
    `ops.gelu_tanh_and_mul` where the backend's fused ops have it (the native CPU ones)."""
    if ops is not None and hasattr(ops, "gelu_tanh_and_mul"):
        return ops.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class SwigluOAI:
    """gpt-oss's clamped SwiGLU on a [rows, 2I] gate | up product (vLLM's "swigluoai"): (up + 1) * gate *
    sigmoid(alpha * gate), gate clamped to <= limit and up to [-limit, limit]."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
