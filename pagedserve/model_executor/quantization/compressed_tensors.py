"""compressed-tensors checkpoints (llm-compressor's; config.json's quantization_config, quant_method
"compressed-tensors"): each of its `config_groups` gives the layers it targets a scheme; `ignore`d and untargeted
layers are float. The schemes run here:

  * W4A16, format "pack-quantized": 4-bit weights per group (or per channel), symmetric or with zero points -
    repacked once onto the int4 kernel (int4.py), exactly. Tensors (N outputs, K inputs, G groups): weight_packed
    [N, K / 8] int32 (8 values a word along the input dimension, value i in bits 4i..4i+3, each the signed value
    + 8), weight_scale [N, G], weight_zero_point [N / 8, G] int32 (packed along the outputs, + 8 as well; asymmetric
    only), weight_shape [2]; with the older act-order "group" (alias "dynamic") weight_g_idx [K], the group of each
    input channel, as GPTQ's g_idx (act-order "weight" keeps groups in place and needs nothing).
  * W8A8 int8, format "int-quantized": int8 weights with one scale per output channel (or one per tensor) and
    activations quantized per token as they come - pagedserve's int8 path (int8.py), whose native kernels quantize
    each row of activations exactly so (symmetric, max|x| / 127): the int8 small GEMM, or where the build has none
    (AVX2 without VNNI) the block-quantized kernel on Q8_0 blocks of scale 1. Tensors: weight [N, K] int8,
    weight_scale [N, 1] (one per tensor broadcasts).
  * FP8 weights, format "float-quantized" / "naive-quantized": weight [N, K] float8_e4m3fn, weight_scale [N, 1] or
    per tensor - dequantized to the model dtype at load (fp8.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedserve.model_executor.quantization.base import LinearMethodBase
from pagedserve.model_executor.quantization.fp8 import Fp8DequantLinearMethod
from pagedserve.model_executor.quantization.int4 import Int4LinearMethod, Int4Weights
from pagedserve.model_executor.quantization.int8 import Int8LinearMethod, clear_int8_weights
from pagedserve.model_executor.quantization.packed import (
    CheckpointQuantizationConfig,
    add_bias_and_int4_state,
    add_param,
    check_group_size,
    drop_params,
    layer_names,
    matches,
    unpack_int4,
    zero_point_int4_weights,
)

if TYPE_CHECKING:
    from pagedserve.model_executor.layers.linear import Linear


class CompressedTensorsW4A16(Int4LinearMethod):
    def __init__(self, group_size: int, symmetric: bool, group_actorder: bool) -> None:
        self.group_size, self.symmetric, self.group_actorder = group_size, symmetric, group_actorder

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        group = check_group_size("compressed-tensors", self.group_size, in_features)
        groups = in_features // group
        add_param(layer, "weight_packed", (out_features, in_features // 8), torch.int32, output_dim=0)
        add_param(layer, "weight_scale", (out_features, groups), torch.float32, output_dim=0)
        add_param(layer, "weight_shape", (2,), torch.int64, output_dim=None)
        if not self.symmetric:
            add_param(layer, "weight_zero_point", (out_features // 8, groups), torch.int32, output_dim=0,
                      packed_factor=8)
        if self.group_actorder:
            add_param(layer, "weight_g_idx", (in_features,), torch.int32, output_dim=None, shared_by_shards=True)
        add_bias_and_int4_state(layer, out_features, bias, group)

    checkpoint_params = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")

    def int4_weights(self, layer: nn.Module) -> Int4Weights:
        q = unpack_int4(layer.weight_packed.data, 1)  # [N, K]: the signed values + 8
        zeros = unpack_int4(layer.weight_zero_point.data, 0) if not self.symmetric \
            else torch.full_like(layer.weight_scale.data, 8, dtype=torch.int32)
        return zero_point_int4_weights(q, zeros, layer.weight_scale.data, layer.int4_group_size,
                                       layer.weight_g_idx.data if self.group_actorder else None)


class CompressedTensorsW8A8Int8(Int8LinearMethod):
    per_token_activations = True

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        add_param(layer, "weight", (out_features, in_features), torch.int8, output_dim=0)
        add_param(layer, "weight_scale", (out_features, 1), torch.float32, output_dim=0)  # a tensor's: broadcast
        layer.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        clear_int8_weights(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.set_int8_weight(layer, layer.weight.data, layer.weight_scale.data.flatten().float(),
                             layer.weight_scale.dtype)
        drop_params(layer, "weight", "weight_scale")


def _method_for_scheme(scheme: dict[str, Any], fmt: str | None, linear_backend: str) -> LinearMethodBase:
    weights, inputs = scheme.get("weights") or {}, scheme.get("input_activations")
    fmt = scheme.get("format") or fmt
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    if fmt == "pack-quantized" and bits == 4 and kind == "int" and inputs is None \
            and strategy in ("group", "channel"):
        group_actorder = weights.get("actorder") in ("group", "dynamic")  # a weight_g_idx per layer
        return CompressedTensorsW4A16(weights["group_size"] if strategy == "group" else -1,
                                      bool(weights.get("symmetric", True)), group_actorder)
    if fmt in ("int-quantized", "naive-quantized") and bits == 8 and kind == "int" and weights.get("symmetric", True) \
            and strategy in ("channel", "tensor") and inputs is not None and inputs.get("dynamic") \
            and inputs.get("strategy") == "token" and inputs.get("num_bits") == 8:
        return CompressedTensorsW8A8Int8()
    if fmt in ("float-quantized", "naive-quantized") and bits == 8 and kind == "float" \
            and strategy in ("channel", "tensor"):
        return Fp8DequantLinearMethod(linear_backend, None, inputs is not None and not inputs.get("dynamic", False))
    raise ValueError(f"quantization='compressed-tensors': scheme {scheme} (format {fmt}) is not supported; "
                     "supported: W4A16 pack-quantized, W8A8 int8 with dynamic per-token activations, FP8 weights.")


class CompressedTensorsConfig(CheckpointQuantizationConfig):
    name = "compressed-tensors"

    def read_checkpoint_config(self, cfg: dict) -> None:
        backend = self.float_config.method.backend
        self.ignore = list(cfg.get("ignore") or [])
        # (targets, method) per config group, each method built once and shared by the layers it targets
        self.groups = [(list(group.get("targets") or []), _method_for_scheme(group, cfg.get("format"), backend))
                       for group in (cfg.get("config_groups") or {}).values()]

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        names = layer_names(prefix)
        if all(matches(name, self.ignore) for name in names):
            return self.float_config.method
        methods = {id(method): method for name in names
                   for method in [next((m for targets, m in self.groups if matches(name, targets)), None)]}
        if len(methods) != 1:
            raise ValueError(f"quantization='compressed-tensors': the checkpoint's layers {names} (one layer here) "
                             "are quantized differently or partly ignored.")
        method = next(iter(methods.values()))
        return self.float_config.method if method is None else method
