"""Weight-only int8 (`--quantization int8`, CPU): per-output-channel scales, activations quantized per call - a
quarter of the weight bytes, for memory-bound decode. The checkpoint's float weights are quantized as they load.

Where the build runs int8 natively (VPDPBUSD, or TDPBUSD tiles on AMX-INT8 CPUs) the native small GEMM takes every
product, prefill included, and holds the only int8 copy: it quantizes the activations per row and measured
1.2-1.9x faster than fbgemm at 1-2048 rows (2.3-4.4x on AMX-INT8 tiles), with a perplexity 0.03% above float32
against fbgemm's 1.1% (tools/int8_quality.py). Elsewhere (and in the tests) fbgemm's dynamic int8, one activation
scale per tensor - except for a W8A8 checkpoint, whose activations must be quantized per token as it was calibrated:
there the weights become Q8_0 blocks of scale 1 for the native block-quantized kernel (int8 dot products on AVX2
too), which quantizes each row of activations with one scale and multiplies each column by its channel's scale.
"""
from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.quantization.base import (
    LinearMethodBase,
    NativeLinearTensors,
    QuantizationConfig,
)
from pagedserve.model_executor.quantization.gguf import NATIVE_TYPES
from pagedserve.model_executor.quantization.unquantized import UnquantizedConfig

if TYPE_CHECKING:
    from pagedserve.model_executor.layers.linear import Linear

NATIVE_INT8_MAX_ROWS = sys.maxsize  # the native kernel takes every int8 product where it runs them at all


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scales float64 [N]) with w ~ q * scales[:, None]: symmetric, one scale per output channel (row)."""
    scales = w.abs().amax(dim=1).clamp(min=1e-8).double() / 127.0
    return (w.double() / scales[:, None]).round().clamp(-128, 127).to(torch.int8), scales


# The float16 range a per-channel scale must lie in to be stored as a Q8_0 block's scale without losing precision
# (normal numbers: below, float16 subnormals keep fewer mantissa bits)
_Q8_0_SCALE_RANGE = (2.0 ** -14, 65504.0)


def clear_int8_weights(layer: nn.Module) -> None:
    """No int8 copy yet: set_int8_weight gives the layer the one its product runs on."""
    layer.small_gemm_weight = layer.fbgemm_weight = layer.q8_0_weight = layer.int8_scale = layer.int8_shift = None


def q8_0_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """A per-channel int8 weight (q [N, K], scales [N]) as GGUF Q8_0 rows ([N, K / 32 * 34] uint8: each block of 32
    its channel's scale in float16, then the 32 int8 values), the same weights in the layout the native block-quantized
    kernel (kernels/quant_gemm.cpp) runs with int8 dot products on AVX2 too; None where K is not a multiple of 32 or a
    scale is outside float16's normal range."""
    n, k = q.shape
    if k % 32 or not bool(((scales >= _Q8_0_SCALE_RANGE[0]) & (scales <= _Q8_0_SCALE_RANGE[1])).all()):
        return None
    d = scales.to(torch.float16).view(torch.uint8).reshape(n, 1, 2).expand(n, k // 32, 2)
    return torch.cat([d, q.view(torch.uint8).reshape(n, k // 32, 32)], dim=2).reshape(n, -1).contiguous()


Q8_0_TYPE = NATIVE_TYPES["Q8_0"][0]


class Int8LinearMethod(LinearMethodBase):
    per_token_activations = False  # True: activations quantized per row wherever the product runs (W8A8)

    def __init__(self, allow_native: bool = True) -> None:
        self.allow_native = allow_native  # False: fbgemm only, for comparisons and tests

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        super().create_weights(layer, in_features, out_features, bias)
        clear_int8_weights(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight.detach()
        q, scales = quantize_per_channel(w)
        self.set_int8_weight(layer, q, scales, w.dtype)
        # every product reads an int8 copy now: the float weight would only add to the model's memory (a tied LM
        # head lets go of its reference only; the embedding keeps the tensor)
        layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)

    def set_int8_weight(self, layer: Linear, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """The kernels' copy of w = q * scales[:, None] (q int8 [N, K], one scale per output channel): quantized
        here, or as a W8A8 checkpoint stores it (compressed-tensors)."""
        ops = cpu_kernels() if self.allow_native and dtype in (torch.float32, torch.bfloat16) else None
        n, k = q.shape
        if ops is not None and ops.native_small_gemm(torch.int8, k):
            layer.small_gemm_weight = ops.pack_small_gemm_weight(q)
            layer.int8_scale = scales.float()
            layer.int8_shift = 128 * q.sum(dim=1, dtype=torch.int32)  # takes back the kernel's +128 on x
        elif self.per_token_activations and ops is not None and ops.native_gguf_type(Q8_0_TYPE) \
                and (unit_rows := q8_0_rows(q, torch.ones(n))) is not None:  # channel scales on the output columns
            layer.q8_0_weight = (ops.gguf_repack(unit_rows, Q8_0_TYPE, n, k),
                                 torch.tensor([[Q8_0_TYPE, n]], dtype=torch.int64))
            layer.int8_scale = scales.float()
        else:
            scales = scales.double()
            with warnings.catch_warnings():  # torch flags quantized dtypes as deprecated; fbgemm still runs them
                warnings.simplefilter("ignore")
                qweight = torch._make_per_channel_quantized_tensor(
                    q, scales, torch.zeros_like(scales, dtype=torch.long), 0)
            bias = None if layer.bias is None else layer.bias.detach().float()
            layer.fbgemm_weight = torch.ops.quantized.linear_prepack(qweight, bias)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.fbgemm_weight is not None:
            return torch.ops.quantized.linear_dynamic(x.float(), layer.fbgemm_weight, True).to(x.dtype)
        if x.dim() != 2:  # the native kernels take [rows, K]
            return self.apply(layer, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], layer.out_features)
        if layer.q8_0_weight is not None:
            return cpu_kernels().gguf_gemm(x, *layer.q8_0_weight, layer.bias, layer.int8_scale,
                                           per_row_activations=True)
        return cpu_kernels().small_gemm_int8(x, layer.small_gemm_weight, layer.int8_scale, layer.int8_shift,
                                             layer.out_features, layer.bias)

    def native_decode_tensors(self, layer: Linear) -> NativeLinearTensors | None:
        if layer.small_gemm_weight is None:
            return None
        return NativeLinearTensors(layer.small_gemm_weight, layer.bias, layer.int8_scale, layer.int8_shift,
                                   NATIVE_INT8_MAX_ROWS)


class Int8Config(QuantizationConfig):
    name = "int8"

    def __init__(self, linear_backend: str = "auto", device: torch.device | None = None,
                 allow_native: bool = True) -> None:
        if device is not None and device.type != "cpu":
            raise ValueError("quantization='int8' is implemented for the CPU only.")
        self.method = Int8LinearMethod(allow_native)
        self.float_config = UnquantizedConfig(linear_backend, device)

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        return self.method
