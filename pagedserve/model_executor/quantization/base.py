"""The contract of a weight format: a QuantizationConfig hands each linear layer its LinearMethod, which creates the
layer's parameters (what the checkpoint loads into), turns them into what its kernels read once loaded
(`process_weights_after_loading`: quantize, pack, drop the float copy) and multiplies (`apply`).

A new format (GGUF, GPTQ/AWQ, compressed-tensors, FP8) is one file with a config and a method, and one line in
registry.py; the layers and models do not change.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedserve.model_executor.layers.activation import PointwiseActivation
    from pagedserve.model_executor.layers.linear import Linear


@dataclass(frozen=True)
class NativeLinearTensors:
    """One linear's tensors as the native whole-stack decode reads them (kernels/decode_layers.cpp): the native
    small GEMM's packed weight (or GGUF blocks repacked for kernels/quant_gemm.cpp, uint8), the bias, for int8
    weights the per-column scales and shifts, for GGUF blocks their parts' (type, width) layout; `max_rows`: the
    most rows the native kernel takes for this weight (the stack runs only steps within it)."""
    packed_weight: torch.Tensor
    bias: torch.Tensor | None
    int8_scale: torch.Tensor | None
    int8_shift: torch.Tensor | None
    max_rows: int
    gguf_layout: torch.Tensor | None = None


class LinearMethodBase(ABC):
    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        """The parameters the checkpoint loads into (float [out, in] weight and optional bias by default)."""
        layer.weight = nn.Parameter(torch.empty(out_features, in_features))
        layer.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Once loaded and converted to the model dtype: whatever the kernels read instead of the parameters."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T (+ b) for x [..., in_features]."""

    def apply_activated(self, layer: Linear, x: torch.Tensor, activation: PointwiseActivation) -> torch.Tensor:
        """activation(x W^T (+ b)): by default the product, then the activation (a GEMM backend may fuse it)."""
        return activation.fn(self.apply(layer, x))

    def native_decode_tensors(self, layer: Linear) -> NativeLinearTensors | None:
        """The layer's tensors for the native whole-stack decode, or None when its products do not run on the
        native small GEMM (the stack then does not run)."""
        return None


class QuantizationConfig(ABC):
    name: ClassVar[str]
    # The config of the layers no format quantizes, in the model dtype on the same `--linear-backend`: an MoE router
    # (as vLLM builds its gate without a quant_config: int8 rounding would move the top-k choice)
    float_config: QuantizationConfig

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        """The method of the linear layer `prefix` (e.g. "layers.0.mlp.down_proj"; formats that leave some layers
        unquantized decide by it)."""
