"""The Triton fused-MoE kernel (layers/fused_moe/triton_moe.py, the CUDA experts) against the PyTorch experts: the
alignment of pairs into per-expert blocks, and the two grouped GEMMs with and without expert biases (gpt-oss), on
decode-sized and prefill-sized batches where some experts get no token. Without a GPU in Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is first imported: it patches triton.language then
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[triton]')")

from pagedserve.model_executor.layers.fused_moe import select_experts  # noqa: E402
from pagedserve.model_executor.layers.fused_moe.experts import grouped_experts, silu_activation  # noqa: E402
from pagedserve.model_executor.layers.fused_moe.triton_moe import (  # noqa: E402
    BLOCK_M,
    align_by_expert,
    triton_fused_experts,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# bfloat16 only where the kernels run compiled: Triton 3.9's interpreter multiplies bfloat16 tl.dot operands as raw
# bits (a 16x16 product off by 1e10), so there it would check the interpreter, not the kernel (a GPU checks it).
DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.bfloat16]


def test_align_groups_pairs_by_expert_in_padded_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])
    sorted_ids, block_expert = align_by_expert(ids, 5, block_m=4)
    pairs = ids.numel()
    blocks = sorted_ids.view(-1, 4)
    for b, e in enumerate(block_expert.tolist()):
        members = [p for p in blocks[b].tolist() if p < pairs]
        if e < 0:
            assert not members
        else:
            assert members and all(ids.reshape(-1)[p] == e for p in members)
    got = sorted(p for p in sorted_ids.tolist() if p < pairs)
    assert got == list(range(pairs))  # every pair exactly once
    assert (block_expert >= 0).sum() == 4  # experts 0, 1, 2, 3 one block each; expert 4 none


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_experts_match_torch(dtype, tokens, bias):
    gen = torch.Generator().manual_seed(tokens)
    e, h, inter, k = 6, 64, 48, 2
    x = torch.randn(tokens, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
    b13 = torch.randn(e, 2 * inter, generator=gen) * 0.3 if bias else None
    b2 = torch.randn(e, h, generator=gen) * 0.3 if bias else None
    weights, ids = select_experts(torch.randn(tokens, e, generator=gen), k, True)

    def expert(j, rows):
        g = rows @ w13[j].T + (b13[j] if bias else 0)
        return silu_activation(g) @ w2[j].T + (b2[j] if bias else 0)

    want = grouped_experts(x, weights, ids, e, expert)
    dev = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    got = triton_fused_experts(dev(x), dev(w13), dev(w2), weights.to(DEVICE), ids.to(DEVICE), silu_activation,
                               dev(b13), dev(b2)).float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)
    assert BLOCK_M >= 16  # tl.dot's smallest tile
