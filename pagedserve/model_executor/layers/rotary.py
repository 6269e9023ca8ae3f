"""Rotary position embedding (Neox style, as HF Llama/Qwen/Mistral), with the default, linear and llama3 scalings."""
from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (rotate halves); cos/sin precomputed per position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # float32 throughout, as transformers computes it, so positions round the same way
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D/2] each; looked up once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], ops: ModuleType | None) -> torch.Tensor:
    """x: [T, heads, D]. Returns x rotated (in place by `ops.rotary_inplace`, the attention backend's fused op,
    when there is one)."""
    cos, sin = cos_sin
    if ops is not None:
        ops.rotary_inplace(x, cos, sin)
        return x
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
