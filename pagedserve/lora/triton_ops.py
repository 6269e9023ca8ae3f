"""Multi-LoRA's batched delta in Triton, for CUDA: the same operation as the CPU kernel (kernels/lora.cpp,
`lora_add`), y[r] += B[slot[r]] (A[slot[r]] x[r]) per output slice, rows of slot -1 left alone, on the same stacks in
their plain layout (lora/layers.py): a [slots, in, S x R], b [slots, R, out'] (each slice's columns padded to 16).

Two kernels by row index (Punica's BGMV): the shrink, one program per (row, slice), h[r, s R:(s + 1) R] =
x[r] a[slot][:, s R:(s + 1) R] in float32 over K tiles; the expand, one program per (row, slice, column tile), y[r,
slice columns] += h[r, s R:(s + 1) R] b[slot][:, slice columns], added in float32 and stored in y's dtype. A row
without adapter returns at once. Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1):
tests/model_executor/test_triton_lora.py checks them against a float64 reference there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # shrink: input columns per step
BLOCK_N = 64  # expand: output columns per program


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, slots_ptr, k, shrunk, stride_x, RANK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    s = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        ranks = tl.arange(0, RANK)
        acc = tl.zeros((RANK,), dtype=tl.float32)
        a_slot = a_ptr + slot * k * shrunk + s * RANK
        for k0 in range(0, k, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + ks, mask=ks < k, other=0.0).to(tl.float32)
            a = tl.load(a_slot + ks[:, None] * shrunk + ranks[None, :], mask=ks[:, None] < k, other=0.0)
            acc += tl.sum(x[:, None] * a.to(tl.float32), axis=0)
        tl.store(h_ptr + row * shrunk + s * RANK + ranks, acc)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, slots_ptr, y_offsets_ptr, b_offsets_ptr, sizes_ptr, shrunk, b_width,
                   stride_y, RANK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    s = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + row)
    size = tl.load(sizes_ptr + s)
    if (slot >= 0) & (tl.program_id(2) * BLOCK < size):
        ranks = tl.arange(0, RANK)
        mask = cols < size
        h = tl.load(h_ptr + row * shrunk + s * RANK + ranks)
        b = tl.load(b_ptr + slot * RANK * b_width + ranks[:, None] * b_width + tl.load(b_offsets_ptr + s)
                    + cols[None, :], mask=mask[None, :], other=0.0)
        delta = tl.sum(h[:, None] * b.to(tl.float32), axis=0)
        y_row = y_ptr + row * stride_y + tl.load(y_offsets_ptr + s) + cols
        y = tl.load(y_row, mask=mask, other=0.0)
        tl.store(y_row, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
             slices: list[int]) -> None:
    """y [T, out] += each row's adapter delta, in place; x [T, in]; a [slots, in, S x R]; b [slots, R, out']; row_slots
    [T] (a slot or -1); slices: the S output slice widths."""
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("lora_add needs contiguous rows")
    rows, rank = x.shape[0], b.shape[1]
    if rows == 0:
        return
    shrunk = a.shape[2]
    h = torch.empty((rows, shrunk), dtype=torch.float32, device=x.device)
    slots = row_slots.contiguous()
    _shrink_kernel[(rows, len(slices))](x, a, h, slots, x.shape[1], shrunk, x.stride(0), RANK=rank, BLOCK=BLOCK_K)
    padded = [-(-size // 16) * 16 for size in slices]
    y_offsets = [sum(slices[:j]) for j in range(len(slices))]
    b_offsets = [sum(padded[:j]) for j in range(len(slices))]
    meta = torch.tensor([y_offsets, b_offsets, slices], dtype=torch.int64, device=x.device)
    _expand_kernel[(rows, len(slices), triton.cdiv(max(slices), BLOCK_N))](
        h, b, y, slots, meta[0], meta[1], meta[2], shrunk, b.shape[2], y.stride(0), RANK=rank, BLOCK=BLOCK_N)
