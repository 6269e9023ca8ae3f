"""The linear layer: y = x W^T (+ b), its weight held and multiplied by the method its quantization config gives it
(quantization/: unquantized with its GEMM backends, int8, ...). Models call the layer, never the method."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.model_executor.layers.activation import PointwiseActivation
from pagedserve.model_executor.quantization.base import (
    NativeLinearTensors,
    QuantizationConfig,
)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, quant_config: QuantizationConfig,
                 prefix: str = "") -> None:
        """prefix: the layer's name in the model (e.g. "layers.0.mlp.down_proj"), for formats that treat some
        layers differently."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.linear_method = quant_config.get_linear_method(self, prefix)
        self.linear_method.create_weights(self, in_features, out_features, bias)

    def process_weights_after_loading(self) -> None:
        self.linear_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor, activation: PointwiseActivation | None = None) -> torch.Tensor:
        """x W^T (+ b), then `activation` (fused into the GEMM where the method can)."""
        if not x.numel():  # no rows (a pooling step whose chunks pool none): the native small GEMM faults on M = 0
            return x.new_empty(*x.shape[:-1], self.out_features)
        if activation is not None:
            return self.linear_method.apply_activated(self, x, activation)
        return self.linear_method.apply(self, x)

    def native_decode_tensors(self) -> NativeLinearTensors | None:
        return self.linear_method.native_decode_tensors(self)
