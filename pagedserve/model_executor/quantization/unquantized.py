"""Float weights (the model dtype: float32, bfloat16, float16) and the GEMM backends that multiply them
(`--linear-backend`):

  * "torch": F.linear (MKL on x86; cuBLAS on a GPU, where it is the only backend);
  * "onednn": the weight pre-packed once for oneDNN (`mkldnn._linear_pointwise`), which picks much better kernels
    than MKL for the small-M products of decode on some CPUs; below ONEDNN_MIN_ROWS rows (float32) it hands over
    to F.linear on the unpacked weight (kept too: the layer holds two copies of its weight);
  * "native" (what "auto" picks on a CPU with oneDNN): the weight also packed for the native small GEMM
    (kernels/small_gemm.cpp: AVX-512 float32, AVX512-BF16 bfloat16), which streams each weight byte once per call
    for all the step's rows; it runs products of up to `native_gemm_max_rows(dtype)` rows (decode, spec-decode
    verification, short prefill chunks), oneDNN the larger ones; the unpacked weight is dropped (two copies, as
    "onednn"). Where the kernel does not run this dtype (AVX2-only CPUs, bfloat16 without AVX512-BF16, an odd K
    in bfloat16) it is "onednn"; where oneDNN cannot take bfloat16 either (AVX2 without AVX-512), bfloat16 products
    of every row count run on the native bf16_weight_gemm (kernels/bf16_weight_gemm.cpp: the weight as stored,
    widened to float32 in registers) instead of F.linear, whose bfloat16 path there reads the weight once per row.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model_executor.kernels import cpu_flags, cpu_kernels
from pagedserve.model_executor.quantization.base import (
    LinearMethodBase,
    NativeLinearTensors,
    QuantizationConfig,
)

if TYPE_CHECKING:
    from pagedserve.model_executor.layers.activation import PointwiseActivation
    from pagedserve.model_executor.layers.linear import Linear

LINEAR_BACKENDS = ("auto", "torch", "onednn", "native")

# MKL's F.linear beats pre-packed oneDNN at a single float32 row on some Intel CPUs, while at 2 rows (speculative
# decoding verifies 2-5 rows per request) MKL's product with a wide LM head can be several times slower than
# oneDNN's on AMD Zen 4: from 2 rows on, oneDNN. In bfloat16 pre-packed oneDNN is faster at every row count.
ONEDNN_MIN_ROWS = 2
# Up to this many rows the "native" backend runs the packed small GEMM, above it oneDNN: the native kernel is
# 1.2-1.9x faster than oneDNN from 1 to 32 rows in float32 and bfloat16, and level with it from 64 to 2048 rows.
NATIVE_GEMM_MAX_ROWS = 128
# On CPUs with AMX-BF16 the native kernel runs bfloat16 products on the tiles, which stream the weights
# faster than oneDNN's AMX kernels up to 32 rows and level or behind from 64; where the OS denies the tiles, its
# VDPBF16PS kernel beats oneDNN's tiles only up to 6 rows.
NATIVE_BF16_AMX_MAX_ROWS = 32
NATIVE_BF16_NO_TILES_MAX_ROWS = 6


def native_gemm_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which the native small GEMM runs a float32 / bfloat16 product (oneDNN above)."""
    if dtype != torch.bfloat16 or "amx_bf16" not in cpu_flags():
        return NATIVE_GEMM_MAX_ROWS
    ops = cpu_kernels()
    return NATIVE_BF16_AMX_MAX_ROWS if ops is not None and ops.amx_tiles() else NATIVE_BF16_NO_TILES_MAX_ROWS


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack a weight of this dtype here: its bfloat16 path needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT, and on an AVX2-only CPU the reorder raises (products above the small GEMM's rows go to
    F.linear there)."""
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class UnquantizedLinearMethod(LinearMethodBase):
    def __init__(self, backend: str) -> None:
        if backend not in LINEAR_BACKENDS[1:]:
            raise ValueError(f"unknown linear backend {backend!r}")
        self.backend = backend

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        super().create_weights(layer, in_features, out_features, bias)
        layer.onednn_weight = layer.small_gemm_weight = None  # packed copies, once loaded
        layer.bf16_weight_gemm = False  # bfloat16 products on bf16_weight_gemm (neither of the above takes them)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.backend == "torch":
            return
        w = layer.weight.detach()
        if onednn_takes(w.dtype):
            layer.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w, None)
        ops = cpu_kernels() if self.backend == "native" and w.dtype in (torch.float32, torch.bfloat16) else None
        if ops is not None and ops.native_small_gemm(w.dtype, w.shape[1]):
            layer.small_gemm_weight = ops.pack_small_gemm_weight(w)
            layer.native_max_rows = native_gemm_max_rows(w.dtype)
            if layer.onednn_weight is not None:
                # every product now reads a packed copy (the small GEMM's up to its row limit, oneDNN's above): the
                # float weight would only double the model's memory (a tied LM head lets go of its reference only)
                layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
        elif ops is not None and layer.onednn_weight is None and w.dtype == torch.bfloat16 and w.is_contiguous() \
                and ops.native_bf16_weight_gemm(w.shape[1]):
            layer.bf16_weight_gemm = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        native = layer.small_gemm_weight is not None or layer.bf16_weight_gemm
        if x.dim() != 2 and native:  # the native kernels take [rows, K]
            return self.apply(layer, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], layer.out_features)
        if self._small_gemm_runs(layer, x):
            return cpu_kernels().small_gemm(x, layer.small_gemm_weight, layer.out_features, layer.bias)
        if layer.bf16_weight_gemm and x.dtype == torch.bfloat16:
            return cpu_kernels().bf16_weight_gemm(x, layer.weight, layer.bias)
        if self._onednn_runs(layer, x):
            return torch.ops.mkldnn._linear_pointwise(x, layer.onednn_weight, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)

    def apply_activated(self, layer: Linear, x: torch.Tensor, activation: PointwiseActivation) -> torch.Tensor:
        """A product that runs on oneDNN takes the activation as its post-op (BERT's GELU after up_proj: 11.4 ->
        10.2 ms per float32 layer of 2,112 x 384 x 1,536 on AMD Zen 5); elsewhere it follows the product."""
        if x.dim() == 2 and not self._small_gemm_runs(layer, x) and self._onednn_runs(layer, x):
            return torch.ops.mkldnn._linear_pointwise(x, layer.onednn_weight, layer.bias, activation.onednn_attr, [],
                                                      activation.onednn_algorithm)
        return activation.fn(self.apply(layer, x))

    @staticmethod
    def _small_gemm_runs(layer: Linear, x: torch.Tensor) -> bool:
        small = layer.small_gemm_weight
        return small is not None and x.shape[0] <= layer.native_max_rows and x.dtype == small.dtype

    @staticmethod
    def _onednn_runs(layer: Linear, x: torch.Tensor) -> bool:
        """Whether a product the native small GEMM does not take goes to oneDNN (else F.linear)."""
        return layer.onednn_weight is not None and (x.shape[0] >= ONEDNN_MIN_ROWS or x.dtype != torch.float32)

    def native_decode_tensors(self, layer: Linear) -> NativeLinearTensors | None:
        if layer.small_gemm_weight is None:
            return None
        return NativeLinearTensors(layer.small_gemm_weight, layer.bias, None, None, layer.native_max_rows)


class UnquantizedConfig(QuantizationConfig):
    """Weights as the checkpoint has them (in the model dtype), multiplied by `linear_backend` (device None: the
    CPU)."""
    name = "none"

    def __init__(self, linear_backend: str = "auto", device: torch.device | None = None) -> None:
        if linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {linear_backend!r}.")
        if device is not None and device.type != "cpu":  # oneDNN and the small GEMM are CPU kernels
            linear_backend = "torch"
        elif linear_backend == "auto":
            linear_backend = "native" if torch.backends.mkldnn.is_available() else "torch"
        self.method = UnquantizedLinearMethod(linear_backend)
        self.float_config = self

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        return self.method
