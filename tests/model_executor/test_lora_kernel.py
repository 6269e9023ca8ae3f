"""The native multi-LoRA kernel (kernels/lora.cpp, `lora_add`) against a float64 reference: each row adds its own
slot's B (A x) per output slice, rows of slot -1 stay bitwise as they were; rows in any slot order (interleaved as
in decode, contiguous runs as in prefill, more than a tile per slot), slices whose widths are not multiples of 16,
float32 and bfloat16 (and bfloat16 weights in pairs of k, where the build takes them), ranks of one and two vectors;
bad arguments raise."""
from __future__ import annotations

import pytest
import torch
from kernel_capabilities import default_build

from pagedserve.model_executor.kernels import cpu_kernels

pytestmark = pytest.mark.usefixtures("one_thread")
BF16_PAIRS = default_build().lora_bf16_pairs  # bfloat16 weights in pairs of k: AVX512-BF16 builds


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels()
    if k is None:
        pytest.skip("native CPU kernels unavailable")
    return k


def padded(n):
    return -(-n // 16) * 16


def reference(y, x, a, b, row_slots, slices):
    """y + per row: slice s gets x a[slot][:, s R:(s+1) R] b[slot][:, slice s's padded columns], in float64."""
    out = y.double().clone()
    rank = b.shape[1]
    for i, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        h = x[i].double() @ a[slot].double()
        offset = padded_offset = 0
        for s, size in enumerate(slices):
            out[i, offset:offset + size] += h[s * rank:(s + 1) * rank] @ \
                b[slot, :, padded_offset:padded_offset + size].double()
            offset += size
            padded_offset += padded(size)
    return out


def in_pairs(w):
    """[slots, k, n] -> [slots, k/2, n, 2] (rows 2i and 2i + 1 side by side)."""
    return w.view(w.shape[0], w.shape[1] // 2, 2, w.shape[2]).transpose(2, 3).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] + (["bfloat16-pairs"] if BF16_PAIRS else []))
@pytest.mark.parametrize("order", ["interleaved", "runs"])
@pytest.mark.parametrize("slices,rank", [([48, 24, 24], 16), ([40], 32), ([72, 72], 16)])  # 24, 40, 72: padded
def test_lora_add_matches_reference(kernels, dtype, order, slices, rank):
    pairs = dtype == "bfloat16-pairs"
    if pairs:
        assert kernels.lora_bf16_pairs()
        dtype = torch.bfloat16
    torch.manual_seed(0)
    slots, in_features, rows = 3, 80, 23
    out = sum(slices)
    x = torch.randn(rows, in_features).to(dtype)
    y = torch.randn(rows, out).to(dtype)
    a = (torch.randn(slots, in_features, len(slices) * rank) * 0.2).to(dtype)
    b = (torch.randn(slots, rank, sum(padded(size) for size in slices)) * 0.2).to(dtype)
    if order == "interleaved":  # a decode step: adapters and the base model mixed row by row
        row_slots = torch.tensor([(-1, 2, 0, 1)[i % 4] for i in range(rows)])
    else:  # a prefill step: each sequence's rows contiguous, slot 0 longer than a tile
        row_slots = torch.tensor([0] * 9 + [-1] * 5 + [2] * 6 + [1] * 3)
    expect = reference(y, x, a, b, row_slots, slices)
    before = y.clone()
    kernels.lora_add(y, x, *((in_pairs(a), in_pairs(b)) if pairs else (a, b)), row_slots, slices)
    base_rows = row_slots < 0
    assert torch.equal(y[base_rows], before[base_rows])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), expect.to(dtype).double(), atol=tol, rtol=tol)


def test_lora_add_strided_x_and_no_adapter_rows(kernels):
    """x a column slice of a wider tensor (rows not contiguous with each other); every row -1: y untouched."""
    torch.manual_seed(1)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]
    a, b = torch.randn(2, 64, 16), torch.randn(2, 16, 32)
    y = torch.randn(5, 32)
    row_slots = torch.tensor([1, 0, 1, -1, 0])
    expect = reference(y, x, a, b, row_slots, [32])
    kernels.lora_add(y, x, a, b, row_slots, [32])
    torch.testing.assert_close(y.double(), expect.float().double(), atol=1e-5, rtol=1e-5)
    before = y.clone()
    kernels.lora_add(y, x, a, b, torch.full((5,), -1), [32])
    assert torch.equal(y, before)


def test_lora_add_rejects_bad_arguments(kernels):
    x, y = torch.randn(2, 64), torch.randn(2, 32)
    a, b = torch.randn(2, 64, 16), torch.randn(2, 16, 32)
    with pytest.raises(RuntimeError, match="row slot"):
        kernels.lora_add(y, x, a, b, torch.tensor([0, 2]), [32])
    with pytest.raises(RuntimeError, match="slices"):
        kernels.lora_add(y, x, a, b, torch.tensor([0, 1]), [16, 8])
    with pytest.raises(RuntimeError, match="padded"):  # slices 20 + 12: b needs 32 + 16 columns
        kernels.lora_add(y, x, torch.randn(2, 64, 32), b, torch.tensor([0, 1]), [20, 12])
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.lora_add(y, x, a.bfloat16(), b, torch.tensor([0, 1]), [32])
