"""The batched LoRA layer against a per-row reference: every row gets base(x) + its own adapter's B (A x) (scaled),
rows without an adapter the base output alone, for a fused projection (three slices with their own A and B) and a
plain one, at decode-sized and prefill-sized row counts, float32 and bfloat16, with adapters of smaller rank than
the slots' and an adapter that leaves a slice alone; on every path: the native kernel by row index (bfloat16 weights
in pairs of k where the build takes them), the Triton kernels (CUDA's; here in Triton's interpreter) and the torch
all-slot masked products used where neither runs."""
from __future__ import annotations

import pytest
import torch

from pagedserve.lora.layers import LoRALinear, LoRAMapping, delta_op
from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.quantization.registry import get_quantization_config

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


def make_layer(in_features: int, slices: list[int], dtype: torch.dtype, mapping: LoRAMapping,
               path: str) -> LoRALinear:
    config = get_quantization_config(None, "auto", CPU)
    base = Linear(in_features, sum(slices), False, config)
    base.weight = torch.nn.Parameter(torch.randn(sum(slices), in_features).to(dtype) * 0.1, requires_grad=False)
    base.process_weights_after_loading()
    op, pairs = None, False
    if path == "native":
        if cpu_kernels() is None:
            pytest.skip("native CPU kernels unavailable")
        op, pairs = delta_op(CPU, dtype, cpu_kernels())
    elif path == "triton":
        pytest.importorskip("triton")
        from pagedserve.lora import triton_ops  # the interpreter on a CPU (conftest sets TRITON_INTERPRET=1)
        op = triton_ops.lora_add
    return LoRALinear(base, slices, mapping, dtype, CPU, op, pairs)


# Row counts per path: the native kernel and the torch products work on tiles of rows, so a prefill-sized count
# (200) reaches their many-tile loops; the Triton kernels run one program per row (their grid), and 200 rows in
# the interpreter cost ~6 s a case for nothing 24 rows do not reach.
@pytest.mark.parametrize("path, rows", [("native", 7), ("native", 200), ("triton", 7), ("triton", 24),
                                        ("torch", 7), ("torch", 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slices", [[64, 32, 32], [96]])
def test_batched_delta_matches_per_row(dtype, rows, slices, path):
    torch.manual_seed(0)
    mapping = LoRAMapping(max_loras=3, max_rank=8)
    layer = make_layer(64, slices, dtype, mapping, path)
    adapters = {}  # slot -> per slice (A, B) or None
    for slot, rank in ((0, 8), (2, 3)):
        weights = [(torch.randn(rank, 64) * 0.2, torch.randn(size, rank) * 0.2) for size in slices]
        if slot == 2 and len(slices) > 1:
            weights[1] = None  # this adapter does not target the middle slice
        layer.set_slot(slot, weights)
        adapters[slot] = weights
    row_slots = torch.tensor([(-1, 0, 2)[i % 3] for i in range(rows)])
    x = torch.randn(rows, 64).to(dtype)
    with torch.inference_mode():
        mapping.set_rows(row_slots, dtype, with_mask=path == "torch")
        y = layer(x).float()
        mapping.set_rows(None, dtype)
        base = layer(x).float()
    for i in range(rows):
        expect = base[i].clone()
        slot = int(row_slots[i])
        if slot >= 0:
            offset = 0
            for size, ab in zip(slices, adapters[slot]):
                if ab is not None:
                    a, b = (t.to(dtype).float() for t in ab)
                    expect[offset:offset + size] += b @ (a @ x[i].float())
                offset += size
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(y[i], expect, atol=tol, rtol=tol)
    assert not torch.equal(y, base)
