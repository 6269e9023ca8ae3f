"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum; config.json's quantization_config, quant_method "gptq"): 4-bit
weights in groups of input channels (group_size 32/64/128/..., or -1 for one group per row), symmetric or with zero
points, optionally act-order (desc_act: groups assigned by g_idx, not by position). Repacked once at load onto the
int4 kernel (int4.py), exactly: w = (q - zero) * scale is q * scale + lo with lo = -zero * scale.

Tensors per linear (K inputs, N outputs, G groups):
  qweight [K / 8, N] int32 - 8 values a word along the input dimension, value i in bits 4i..4i+3;
  qzeros  [G, N / 8] int32 - the zero points, 8 a word along the output dimension; the original ("gptq") checkpoint
                             format stores zero - 1 (vLLM's kernels add the 1 back), "gptq_v2" the zero itself;
  scales  [G, N] float16;  g_idx [K] int32 - the group of each input channel;  bias [N] where the model has one.
With act-order the groups are not contiguous runs of inputs: the input channels are sorted by group once (the
weight's rows here, the activations' columns in every product, as vLLM's exllama path does).
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


class GPTQLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int, zero_offset: int) -> None:
        self.group_size = group_size
        self.zero_offset = zero_offset  # added to the stored zero points: 1 in the original checkpoint format

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        group = check_group_size("gptq", self.group_size, in_features)
        groups = in_features // group
        add_param(layer, "qweight", (in_features // 8, out_features), torch.int32, output_dim=1)
        add_param(layer, "qzeros", (groups, out_features // 8), torch.int32, output_dim=1, packed_factor=8)
        add_param(layer, "scales", (groups, out_features), torch.float32, output_dim=1)
        add_param(layer, "g_idx", (in_features,), torch.int32, output_dim=None, shared_by_shards=True)
        add_bias_and_int4_state(layer, out_features, bias, group)

    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def int4_weights(self, layer: nn.Module) -> Int4Weights:
        q = unpack_int4(layer.qweight.data, 0)  # [K, N]
        zeros = unpack_int4(layer.qzeros.data, 1) + self.zero_offset  # [G, N]
        return zero_point_int4_weights(q.t(), zeros.t(), layer.scales.data.t(), layer.int4_group_size,
                                       layer.g_idx.data)


class GPTQConfig(CheckpointQuantizationConfig):
    name = "gptq"

    def read_checkpoint_config(self, cfg: dict) -> None:
        if cfg.get("bits", 4) != 4:
            raise ValueError(f"quantization='gptq' supports 4-bit weights, the checkpoint has {cfg.get('bits')}.")
        fmt = cfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization='gptq': unknown checkpoint_format {fmt!r} (gptq, gptq_v2).")
        if cfg.get("lm_head", False):
            raise ValueError("quantization='gptq': a quantized LM head (lm_head: true) is not supported yet.")
        self.method = GPTQLinearMethod(int(cfg.get("group_size", 128)), 1 if fmt == "gptq" else 0)

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        return self.float_config.method if self.leaves_float(prefix, []) else self.method
