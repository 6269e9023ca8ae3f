"""AWQ checkpoints (AutoAWQ's GEMM version; config.json's quantization_config, quant_method "awq"): 4-bit weights with
zero points in groups of `group_size` input channels, repacked once at load onto the int4 kernel (int4.py), exactly
(w = (q - zero) * scale).

Tensors per linear (K inputs, N outputs, G = K / group_size):
  qweight [K, N / 8] int32 - 8 values a word along the output dimension, interleaved: nibble i (bits 4i..4i+3) holds
                             output 8j + AWQ_ORDER[i] of word j;
  qzeros  [G, N / 8] int32 - the zero points, packed the same way;  scales [G, N] float16;  bias [N].
`modules_to_not_convert` names layers left in float (and the LM head always is).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.model_executor.quantization.base import LinearMethodBase
from pagedserve.model_executor.quantization.int4 import Int4LinearMethod, Int4Weights
from pagedserve.model_executor.quantization.packed import (
    CheckpointQuantizationConfig,
    add_bias_and_int4_state,
    add_param,
    check_group_size,
    unpack_int4,
    zero_point_int4_weights,
)

if TYPE_CHECKING:
    from pagedserve.model_executor.layers.linear import Linear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class AWQLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        group = check_group_size("awq", self.group_size, in_features)
        groups = in_features // group
        add_param(layer, "qweight", (in_features, out_features // 8), torch.int32, output_dim=1, packed_factor=8)
        add_param(layer, "qzeros", (groups, out_features // 8), torch.int32, output_dim=1, packed_factor=8)
        add_param(layer, "scales", (groups, out_features), torch.float32, output_dim=1)
        add_bias_and_int4_state(layer, out_features, bias, group)

    checkpoint_params = ("qweight", "qzeros", "scales")

    def int4_weights(self, layer: nn.Module) -> Int4Weights:
        q = unpack_int4(layer.qweight.data, 1, AWQ_ORDER)  # [K, N]
        zeros = unpack_int4(layer.qzeros.data, 1, AWQ_ORDER)  # [G, N]
        return zero_point_int4_weights(q.t(), zeros.t(), layer.scales.data.t(), layer.int4_group_size)


class AWQConfig(CheckpointQuantizationConfig):
    name = "awq"

    def read_checkpoint_config(self, cfg: dict) -> None:
        bits = cfg.get("bits", cfg.get("w_bit", 4))
        if bits != 4 or not cfg.get("zero_point", True) or cfg.get("version", "gemm").lower() != "gemm":
            raise ValueError("quantization='awq' supports AutoAWQ's GEMM checkpoints: 4-bit, with zero points; got "
                             f"bits={bits}, zero_point={cfg.get('zero_point')}, version={cfg.get('version')}.")
        self.method = AWQLinearMethod(int(cfg.get("group_size", cfg.get("q_group_size", 128))))
        self.not_converted = list(cfg.get("modules_to_not_convert") or [])

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        return self.float_config.method if self.leaves_float(prefix, self.not_converted) else self.method
