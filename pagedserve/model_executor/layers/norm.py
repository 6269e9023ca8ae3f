"""RMSNorm, optionally fused with the residual add before it; Gemma's (1 + w) variant."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model_executor.attention.backend import AttentionBackend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, attn_backend: AttentionBackend | None = None) -> None:
        """attn_backend: whose fused ops (one kernel for the add and the norm) run the norm; None: PyTorch's."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.attn_backend = attn_backend

    def _ops(self, x: torch.Tensor):
        return None if self.attn_backend is None else self.attn_backend.fused_ops(x)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x); with `residual`: residual += x (in place), then RMSNorm(residual) - a decoder layer's
        residual add fused with the norm after it."""
        ops = self._ops(x) if x.dim() == 2 or (x.dim() == 3 and residual is None) else None
        if ops is not None:
            return ops.rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)

    def forward_inplace(self, x: torch.Tensor) -> bool:
        """RMSNorm of x ([T, heads, D], e.g. the q or k heads inside the QKV output) written over x by the fused
        op; False (x untouched) when there is none."""
        ops = self._ops(x)
        if ops is None:
            return False
        ops.rms_norm(x, None, self.weight, self.eps, x)
        return True


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w, the norm multiplies by (1 + w), in float32 as Hugging Face does.
    Folded once after loading (`fold_weight`) into a float32 weight, so the forward is RMSNorm's. Activations of
    another dtype (bfloat16) take the native CPU op, which reads a float32 weight beside them (as the native
    whole-stack decode does), or elsewhere PyTorch's float32 path."""

    def fold_weight(self) -> None:
        self.weight = nn.Parameter(1.0 + self.weight.detach().float(), requires_grad=False)

    def _ops(self, x: torch.Tensor):
        return super()._ops(x) if x.dtype == self.weight.dtype or x.device.type == "cpu" else None
