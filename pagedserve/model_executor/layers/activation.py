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


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up: GeGLU (Gemma's `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
