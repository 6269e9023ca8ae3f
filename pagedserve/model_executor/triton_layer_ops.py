"""A decoder layer's small ops in Triton, for CUDA: the same three functions, with the same semantics, as the CPU's
compiled ops (kernels/layer_ops.cpp), so that the layers call either through their attention backend's
`fused_ops(x)` (the Triton backend returns this module).

Why: a replayed decode step of a small model on a GPU costs per kernel launched rather than per weight byte
streamed (level from 1 to 8 rows, far above its weight-streaming floor). In PyTorch ops a layer is 25-40
kernels (counted as ATen calls on a CPU: four RMSNorms of one or more kernels each, rotary ~8 - halves, products,
a concatenation, conversions - and silu, mul and residual adds); with these it is 13, the products and attention
included. Each op here is one kernel: one program per row (RMSNorm), per (token, head) (rotary), per (row,
column tile) (silu * mul). Arithmetic is float32, stored in the tensor's dtype; divisions and the square root
round as IEEE (div_rn, sqrt_rn), as the PyTorch and CPU paths do.

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1): tests/model_executor/test_triton_layer_ops.py checks them
against PyTorch there, and tests/model_executor/triton_compile_check.py compiles them for sm_90.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024  # columns per silu * mul program


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, heads, n, eps, stride_x0, stride_x1, stride_r0, stride_o0,
                     stride_o1, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)  # (token, head) of a [T, heads, n] view, or a row of a [rows, n] tensor (heads 1)
    t = row // heads
    h = row % heads
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + t * stride_x0 + h * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual += x, rounded to the stream's dtype as PyTorch's add_ rounds it, then normed
        s = (tl.load(res_ptr + t * stride_r0 + cols, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32))
        s = s.to(x.dtype)
        tl.store(res_ptr + t * stride_r0 + cols, s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    mean_square = tl.math.div_rn(tl.sum(xf * xf, axis=0), n.to(tl.float32))
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_square + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o0 + h * stride_o1 + cols, (w * (xf * inv)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, n, stride_g, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * n + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, half, stride_t, stride_h, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < half
    x1_ptr = x_ptr + t * stride_t + h * stride_h + i
    a = tl.load(x1_ptr, mask=mask, other=0.0)
    b = tl.load(x1_ptr + half, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    af = a.to(tl.float32)
    tl.store(x1_ptr, (af * c - b * s).to(a.dtype), mask=mask)
    tl.store(x1_ptr + half, (b * c + af * s).to(a.dtype), mask=mask)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x ([rows, n], or [T, heads, n] with residual None: Qwen3's per-head q/k norm; the
    last dimension contiguous). With `residual` ([rows, n], contiguous rows): residual += x in place first, and the
    norm is of residual. The result goes to `out` (x's shape and dtype; may be x itself) or a new tensor."""
    if residual is not None and x.dim() != 2:
        raise ValueError("residual needs a 2-D x")
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs contiguous rows")
    n = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.shape[0] * heads
    if rows:
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, heads, n, eps,
            x.stride(0), x.stride(1) if x.dim() == 3 else 0, residual.stride(0) if residual is not None else 0,
            out.stride(0), out.stride(1) if out.dim() == 3 else 0,
            HAS_RESIDUAL=residual is not None, BLOCK_N=triton.next_power_of_2(n))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2n] (gate then up, contiguous rows) -> silu(gate) * up: [rows, n], same dtype."""
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul needs contiguous rows")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, SILU_BLOCK))](gate_up, out, n, gate_up.stride(0), BLOCK=SILU_BLOCK)
    return out


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox-style rotation of x ([T, heads, D], any token and head strides, D contiguous) in place; cos and sin
    hold [T, D/2] values (float32 or x's dtype)."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1:
        raise ValueError("rotary_inplace needs contiguous head dimensions")
    half = head_dim // 2
    cos, sin = cos.reshape(tokens, half).contiguous(), sin.reshape(tokens, half).contiguous()
    if tokens:
        _rotary_kernel[(tokens, heads)](x, cos, sin, half, x.stride(0), x.stride(1),
                                        BLOCK=triton.next_power_of_2(half))
