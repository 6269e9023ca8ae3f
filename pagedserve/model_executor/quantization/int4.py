"""Weight-only int4 (`--quantization int4`, CPU): round-to-nearest per group of 128 input channels (64 or 32 where
the width is not a multiple of 128), asymmetric (a scale and a float zero per group), packed two weights a byte -
an eighth of float32's weight bytes. The checkpoint's float weights are quantized as they load.

The product is torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, the tinygemm layout torchao and gpt-fast use:
weights unpacked and dequantized in registers, float activations). pagedserve's own native int4 small GEMM (and the
whole-stack decode over it) is not built yet, so these layers run outside the native decode loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.model_executor.quantization.base import LinearMethodBase, QuantizationConfig
from pagedserve.model_executor.quantization.unquantized import UnquantizedConfig

if TYPE_CHECKING:
    from pagedserve.model_executor.layers.linear import Linear

GROUP_SIZES = (128, 64, 32)  # the first that divides the input width; the kernel takes these
KERNEL_GROUP_SIZES = (256, 128, 64, 32)  # what torch's CPU int4 kernel takes


def group_size_for(in_features: int) -> int:
    for g in GROUP_SIZES:
        if in_features % g == 0:
            return g
    raise ValueError(f"quantization='int4' needs linear input widths that are multiples of 32, got {in_features}.")


def quantize_rtn_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] in 0..15, scale [N, K/g], minimum [N, K/g]) with w ~= q * scale + minimum per group."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    return q.reshape(n, k).to(torch.int32), scale, lo


def dequantize_rtn_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    groups = q.float().reshape(n, scale.shape[1], -1)
    return (groups * scale[..., None] + lo[..., None]).reshape(n, k)


@dataclass
class Int4Weights:
    """w[n, k] = q[n, k] * scale[n, k // group_size] + lo[n, k // group_size] (q in 0..15): what RTN and the int4
    checkpoint formats (GPTQ, AWQ, compressed-tensors: lo = -zero * scale) all are; with act-order the input channels
    of q sorted by group (input_perm: x's columns in that order). dtype: of the scales the layer computes with."""

    q: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor
    group_size: int
    dtype: torch.dtype
    input_perm: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """float32 w [N, K] in the checkpoint's input order."""
        w = dequantize_rtn_int4(self.q, self.scale.float(), self.lo.float())
        if self.input_perm is not None:
            w = w[:, self.input_perm.argsort()]
        return w


def set_int4_kernel_weight(layer: Linear, weights: Int4Weights) -> None:
    """The kernel's copy of `weights` on `layer`. A group of a multiple of the kernel's group sizes (a whole row: per
    channel) is cut into kernel groups that share its scale and lo, exactly."""
    q, group_size = weights.q, weights.group_size
    kernel_group = next((g for g in KERNEL_GROUP_SIZES if group_size % g == 0), None)
    if kernel_group is None or q.shape[0] % 16:
        raise ValueError(f"The CPU int4 kernel needs groups of a multiple of 32 input channels and output widths "
                         f"that are multiples of 16; got group size {group_size}, {q.shape[0]} outputs.")
    repeat = group_size // kernel_group
    scale = weights.scale.float().repeat_interleave(repeat, dim=1)
    lo = weights.lo.float().repeat_interleave(repeat, dim=1)
    layer.int4_weight = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    # the kernel dequantizes (q - 8) * scale + zero: its zero is the group's value at q = 8
    zeros = lo + 8 * scale
    layer.int4_scale_zeros = torch.stack([scale.t(), zeros.t()], dim=-1).to(weights.dtype).contiguous()
    layer.int4_group_size = kernel_group
    layer.int4_input_perm = weights.input_perm


class Int4LinearMethod(LinearMethodBase):
    """RTN int4 of a float checkpoint; the int4 checkpoint formats subclass it, each reading its own tensors
    (`int4_weights`, then `checkpoint_params` dropped). An MoE layer's experts take the same `int4_weights` of each
    expert's projections (layers/fused_moe/experts.py)."""

    checkpoint_params: tuple[str, ...] = ("weight",)

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        super().create_weights(layer, in_features, out_features, bias)
        layer.int4_weight = layer.int4_scale_zeros = None
        layer.int4_group_size = group_size_for(in_features)
        layer.int4_input_perm = None  # GPTQ's act-order: the input channels in the order of their groups

    def int4_weights(self, layer: nn.Module) -> Int4Weights:
        w = layer.weight.detach()
        q, scale, lo = quantize_rtn_int4(w, layer.int4_group_size)
        return Int4Weights(q, scale, lo, layer.int4_group_size, w.dtype)

    def process_weights_after_loading(self, layer: Linear) -> None:
        set_int4_kernel_weight(layer, self.int4_weights(layer))
        for name in self.checkpoint_params:  # kept only as empty placeholders
            if getattr(layer, name, None) is not None:
                setattr(layer, name, nn.Parameter(torch.empty(0, dtype=getattr(layer, name).dtype),
                                                  requires_grad=False))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if layer.int4_input_perm is not None:
            rows = rows.index_select(1, layer.int4_input_perm)
        y = torch._weight_int4pack_mm_for_cpu(rows.to(layer.int4_scale_zeros.dtype), layer.int4_weight,
                                              layer.int4_group_size, layer.int4_scale_zeros).to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)


class Int4Config(QuantizationConfig):
    name = "int4"

    def __init__(self, linear_backend: str = "auto", device: torch.device | None = None) -> None:
        if device is not None and device.type != "cpu":
            raise ValueError("quantization='int4' is implemented for the CPU only.")
        self.method = Int4LinearMethod()
        self.float_config = UnquantizedConfig(linear_backend, device)

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        return self.method
