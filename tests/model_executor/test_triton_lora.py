"""The Triton multi-LoRA delta (lora/triton_ops.py, the CUDA path) against the float64 reference of the CPU kernel's
test: each row its own slot's delta per output slice, rows of slot -1 untouched, slices whose widths are not
multiples of 16, ranks of one and two vectors, float32 and bfloat16. Without a GPU it runs in Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is first imported: it patches triton.language then
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[triton]')")

from test_lora_kernel import padded, reference  # noqa: E402

from pagedserve.lora import triton_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slices,rank", [([48, 24, 24], 16), ([40], 32), ([72, 72], 16)])
def test_triton_lora_add_matches_reference(dtype, slices, rank):
    torch.manual_seed(0)
    slots, in_features, rows = 3, 80, 9
    x = torch.randn(rows, in_features).to(dtype)
    y = torch.randn(rows, sum(slices)).to(dtype)
    a = (torch.randn(slots, in_features, len(slices) * rank) * 0.2).to(dtype)
    b = (torch.randn(slots, rank, sum(padded(size) for size in slices)) * 0.2).to(dtype)
    row_slots = torch.tensor([(-1, 2, 0, 1)[i % 4] for i in range(rows)])
    expect = reference(y, x, a, b, row_slots, slices)
    got = y.to(DEVICE)
    triton_ops.lora_add(got, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), row_slots.to(DEVICE), slices)
    got = got.cpu()
    base_rows = row_slots < 0
    assert torch.equal(got[base_rows], y[base_rows])
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.double(), expect.to(dtype).double(), atol=tol, rtol=tol)
