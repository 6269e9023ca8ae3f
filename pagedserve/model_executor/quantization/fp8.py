"""FP8 (e4m3) weights, dequantized to the model dtype at load: the CPU has no FP8 GEMM, so they then run as float
weights (`--linear-backend`). Two checkpoint formats hold them:

  * vLLM's / transformers' "fp8" (quant_method "fp8"; Qwen3-*-FP8, DeepSeek): weight [N, K] float8_e4m3fn with either
    one scale per block of weight_block_size [bn, bk] (weight_scale_inv [ceil(N / bn), ceil(K / bk)]: despite its
    name the multiplier, w = q * s) or one per tensor (weight_scale); activation_scheme "static" adds an input_scale
    (read, not used: activations stay float here). `ignored_layers` / `modules_to_not_convert` stay float.
  * compressed-tensors' float-quantized scheme (compressed_tensors.py): weight_scale per channel or per tensor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.model_executor.quantization.base import LinearMethodBase
from pagedserve.model_executor.quantization.packed import (
    CheckpointQuantizationConfig,
    add_param,
    drop_params,
)
from pagedserve.model_executor.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from pagedserve.model_executor.layers.linear import Linear


class Fp8DequantLinearMethod(UnquantizedLinearMethod):
    def __init__(self, backend: str, block_size: tuple[int, int] | None, static_input_scale: bool) -> None:
        super().__init__(backend)
        self.block_size = block_size  # None: weight_scale per output channel or per tensor
        self.static_input_scale = static_input_scale

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        super().create_weights(layer, in_features, out_features, bias)  # float: fp8 converts exactly as it loads
        layer.weight.output_dim = 0
        if self.block_size is None:  # a tensor's one scale broadcasts over its rows
            add_param(layer, "weight_scale", (out_features, 1), torch.float32, output_dim=0)
        else:
            bn, bk = self.block_size
            if out_features % bn:
                raise ValueError(f"quantization='fp8': {out_features} outputs are not whole blocks of {bn}.")
            add_param(layer, "weight_scale_inv", (out_features // bn, -(-in_features // bk)), torch.float32,
                      output_dim=0, packed_factor=bn)
        if self.static_input_scale:
            add_param(layer, "input_scale", (1,), torch.float32, output_dim=None)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight times its scales, in place (the model dtype); an MoE expert's too."""
        w = layer.weight.data
        if self.block_size is None:
            scale = layer.weight_scale.data
        else:
            bn, bk = self.block_size
            scale = layer.weight_scale_inv.data.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:, :w.shape[1]]
        return w.mul_(scale.to(w.dtype))

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.dequantize(layer)
        drop_params(layer, "weight_scale", "weight_scale_inv", "input_scale")
        super().process_weights_after_loading(layer)


class Fp8Config(CheckpointQuantizationConfig):
    name = "fp8"

    def read_checkpoint_config(self, cfg: dict) -> None:
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization='fp8' reads e4m3 weights, the checkpoint has {fmt!r}.")
        block = cfg.get("weight_block_size")
        self.method = Fp8DequantLinearMethod(self.float_config.method.backend, tuple(block) if block else None,
                                             cfg.get("activation_scheme", "dynamic") == "static")
        self.ignored = list(cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or [])

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        return self.float_config.method if self.leaves_float(prefix, self.ignored) else self.method
