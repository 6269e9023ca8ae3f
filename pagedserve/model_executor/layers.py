"""Building blocks of the decoder: RMSNorm, rotary embedding (incl. llama3 scaling), fused linears."""
from __future__ import annotations

import math
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model_executor.attention import uses_triton
from pagedserve.model_executor.kernels import cpu_flags, cpu_kernels


NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def native_ops(x: torch.Tensor):
    """The compiled fused ops (kernels/layer_ops.cpp) when they apply to x (float32 or bfloat16 on CPU), else None.

    On CPU at decode batch sizes these small ops cost more in per-op dispatch than in arithmetic: RMSNorm alone
    is six ATen ops (and in bfloat16 PyTorch adds conversions to float32 and back around each)."""
    if x.dtype not in NATIVE_DTYPES or x.device.type != "cpu":
        return None
    return cpu_kernels()


def fused_ops(x: torch.Tensor):
    """A decoder layer's small ops (RMSNorm with the residual add, rotary in place, silu * mul), one kernel each:
    the Triton ones (triton_layer_ops.py) wherever attention runs on Triton (CUDA by default; a CPU under
    PAGEDSERVE_ATTENTION_BACKEND=triton, as the tests run it), else the compiled CPU ones (native_ops); None where
    neither applies, and PyTorch's ops run."""
    if x.dtype in (torch.float32, torch.bfloat16, torch.float16) and uses_triton(x.device.type):
        from pagedserve.model_executor import triton_layer_ops  # imports triton: only where it runs

        return triton_layer_ops
    return native_ops(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x); with `residual`: residual += x (in place), then RMSNorm(residual) - a decoder layer's
        residual add fused with the norm after it."""
        ops = fused_ops(x) if x.dim() == 2 or (x.dim() == 3 and residual is None) else None
        if ops is not None:
            return ops.rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)

    def forward_inplace(self, x: torch.Tensor) -> bool:
        """RMSNorm of x ([T, heads, D], e.g. the q or k heads inside the QKV output) written over x by the native
        op; False (x untouched) when it does not apply."""
        ops = fused_ops(x)
        if ops is None:
            return False
        ops.rms_norm(x, None, self.weight, self.eps, x)
        return True


# Measured in BENCHMARKS.md (section 6): on the decoder's matrices MKL's F.linear beat pre-packed oneDNN at 1-3
# rows in float32 on the Intel machine of that section, losing from 4 rows on; on the AMD Zen 4 machine of section
# 10, MKL's 2-row product with the demo model's LM head (8192x256) took 3.8 ms against oneDNN's 0.53 ms (1 thread),
# and speculative decoding verifies 2-5 rows per request: from 2 rows on, oneDNN. In bfloat16 pre-packed oneDNN is
# faster at every row count. (The "onednn" backend; "native" replaces these small products, below.)
ONEDNN_MIN_ROWS = 2

# Up to this many rows the "native" backend runs the packed small GEMM (kernels/small_gemm.cpp), above it oneDNN.
# Measured on AMD Zen 4 (BENCHMARKS.md section 6, "small-M GEMM"): the native kernel 1.2-1.9x faster than oneDNN
# from 1 to 32 rows in float32 and bfloat16, level with it (within 5%) from 64 to 2048 rows.
NATIVE_GEMM_MAX_ROWS = 128
# On CPUs with AMX-BF16 the native kernel runs bfloat16 products of 2+ rows on the tiles (small_gemm.cpp), which
# streamed the weights 1.3-1.5x faster than oneDNN's AMX kernels at 2-32 rows on an Intel Xeon and level or behind
# from 64 (Qwen3's shape); where the OS denies the tiles, the VDPBF16PS kernel against oneDNN's tiles won only up to
# 6 rows (1.3-1.6x; 0.4x at 32). BENCHMARKS.md section 6, "Eighth pass".
NATIVE_BF16_AMX_MAX_ROWS = 32
NATIVE_BF16_NO_TILES_MAX_ROWS = 6
# int8 weights (`--quantization int8`): wherever the build runs them natively (VPDPBUSD, or TDPBUSD tiles on AMX-INT8
# CPUs) the native kernel takes every product, prefill included, and fbgemm's dynamic int8 only the builds without it
# (and the tests). Measured against fbgemm: on AMD Zen 5, 1.2-1.5x at 1-256 rows and 1.15-1.9x at 512-2048 rows on
# both shapes (BENCHMARKS.md section 6, "Tenth pass"); on an Intel Xeon's AMX-INT8 tiles 2.3-4.4x ("Ninth pass").
# It also quantizes the activations per row where fbgemm takes one scale per tensor: perplexity +0.03% over float32
# against fbgemm's +1.1% (`python -m pagedserve.tools.int8_quality`).
NATIVE_INT8_MAX_ROWS = sys.maxsize


def native_gemm_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which the native small GEMM runs a `dtype` product (float32 / bfloat16: oneDNN above; int8 weights:
    every row count)."""
    if dtype == torch.int8:
        return NATIVE_INT8_MAX_ROWS
    if dtype != torch.bfloat16 or "amx_bf16" not in cpu_flags():
        return NATIVE_GEMM_MAX_ROWS
    ops = cpu_kernels()
    return NATIVE_BF16_AMX_MAX_ROWS if ops is not None and ops.amx_tiles() else NATIVE_BF16_NO_TILES_MAX_ROWS


class Linear(nn.Module):
    """y = x W^T (+ b). One class, so the GEMM backend is chosen in one place (`set_backend`).

    Backends (CPU):
      * "torch": F.linear (MKL on x86);
      * "onednn": the weight pre-packed once for oneDNN (`mkldnn._linear_pointwise`), which picks much better
        kernels than MKL for the small-M products of decode on some CPUs; below ONEDNN_MIN_ROWS rows (float32) it
        hands over to F.linear on the unpacked weight (kept too: the model holds two copies of its weights);
      * "native" (what "auto" picks on CPU when the native kernels are built): the weight also packed for the
        native small GEMM (AVX-512 float32, AVX512-BF16 bfloat16), which streams each weight byte once per call
        for all the step's rows; it runs products of up to `native_gemm_max_rows(dtype)` rows (decode, spec-decode
        verification, short prefill chunks), oneDNN the larger ones; the unpacked weight is dropped (two copies, as
        "onednn"). Where the kernel does not run this dtype (AVX2-only CPUs, bfloat16 without AVX512-BF16, an odd
        K in bfloat16) it is "onednn";
      * "int8": weight-only int8, per-output-channel scales, activations quantized per call - a quarter of the
        weight bytes, for memory-bound decode. Where the build runs int8 natively (AVX512-VNNI or AMX-INT8,
        activations quantized per row) the native kernel takes every product (`native_gemm_max_rows`) and holds
        the only int8 copy; elsewhere fbgemm's dynamic quantization (activations per tensor).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.out_features = out_features
        self.backend = "torch"
        self._packed = None
        self._small_packed = None  # the native small GEMM's packed weight, where the kernel runs this dtype
        self._int8_scale = self._int8_shift = None  # int8 on the native kernel: per-column scales and shifts
        self._native_max_rows = NATIVE_GEMM_MAX_ROWS  # native_gemm_max_rows(dtype) when the weight is packed

    def set_backend(self, backend: str, allow_native: bool = True) -> None:
        """allow_native=False keeps the library kernels (oneDNN, fbgemm) only: for comparisons and tests."""
        w = self.weight.detach()
        self._packed = self._small_packed = self._int8_scale = self._int8_shift = None
        if backend in ("onednn", "native"):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            ops = native_ops(w) if backend == "native" and allow_native else None
            if ops is not None and ops.native_small_gemm(w.dtype, w.shape[1]):
                self._small_packed = ops.pack_small_gemm_weight(w)
                self._native_max_rows = native_gemm_max_rows(w.dtype)
        elif backend == "int8":
            scales = w.abs().amax(dim=1).clamp(min=1e-8).double() / 127.0
            with warnings.catch_warnings():  # torch flags quantized dtypes as deprecated; fbgemm still runs them
                warnings.simplefilter("ignore")
                qweight = torch.quantize_per_channel(w.float(), scales, torch.zeros_like(scales, dtype=torch.long),
                                                     0, torch.qint8)
            ops = native_ops(w) if allow_native else None
            if ops is not None and ops.native_small_gemm(torch.int8, w.shape[1]):
                q = qweight.int_repr()
                self._small_packed = ops.pack_small_gemm_weight(q)
                self._int8_scale = scales.float()
                self._int8_shift = 128 * q.sum(dim=1, dtype=torch.int32)  # takes back the kernel's +128 on x
                self._native_max_rows = native_gemm_max_rows(torch.int8)
            if self._small_packed is None or self._native_max_rows < sys.maxsize:  # fbgemm takes the rest
                bias = None if self.bias is None else self.bias.detach().float()
                self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        elif backend != "torch":
            raise ValueError(f"unknown linear backend {backend!r}")
        self.backend = backend
        if backend == "int8" or self._small_packed is not None:
            # Every product now reads a packed copy (int8; or the small GEMM's up to its row limit and
            # oneDNN's above): the float weight would only double the model's memory. (A tied LM head lets go of
            # its reference only; the embedding keeps the tensor.)
            self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._small_packed is not None and x.dim() != 2:  # the native kernels take [rows, K]
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        if self.backend == "int8":
            if self._small_packed is not None and rows <= self._native_max_rows:
                return cpu_kernels().small_gemm_int8(x, self._small_packed, self._int8_scale, self._int8_shift,
                                                     self.out_features, self.bias)
            return torch.ops.quantized.linear_dynamic(x.float(), self._packed, True).to(x.dtype)
        if self._small_packed is not None and rows <= self._native_max_rows and x.dtype == self._small_packed.dtype:
            return cpu_kernels().small_gemm(x, self._small_packed, self.out_features, self.bias)
        if self.backend in ("onednn", "native"):
            if rows >= ONEDNN_MIN_ROWS or x.dtype != torch.float32:  # bf16: oneDNN at every M (see above)
                return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class VocabParallelEmbedding(nn.Module):
    """Token embedding holding `num_rows` consecutive vocabulary rows (all of them in one process). Under tensor
    parallelism each rank looks up the ids in its range, zeros the others, and an all-reduce sums the one
    non-zero contribution per token (exact: the other terms are zeros)."""

    def __init__(self, num_rows: int, dim: int, parallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_rows, dim))
        self.parallel = parallel
        self.start = parallel.tp_rank * num_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0.0)
        return self.parallel.all_reduce(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [gate | up] projection."""
    ops = fused_ops(gate_up)
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (rotate halves), as in HF Llama/Qwen/Mistral; cos/sin precomputed per position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # float32 throughout, as transformers computes it, so positions round the same way
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D/2] each; looked up once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [T, heads, D]. Returns x rotated (in place when the native op applies)."""
    cos, sin = cos_sin
    ops = fused_ops(x)
    if ops is not None:
        ops.rotary_inplace(x, cos, sin)
        return x
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
