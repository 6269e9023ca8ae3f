"""Gated activations of a fused [gate | up] projection."""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F


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
