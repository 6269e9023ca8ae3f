"""The experts on CUDA in Triton (vLLM's fused-MoE design): two grouped-GEMM launches per layer instead of one
product pair per expert.

  * align: the (token, slot) pairs sorted by expert id, each expert's run padded to a multiple of BLOCK_M (padding
    entries point past the last pair), and for each BLOCK_M block its expert id (-1 for blocks past the end). Sized
    for the worst case (pairs + E * (BLOCK_M - 1)), so it needs no host sync;
  * one kernel launch per projection: a program takes one block of pairs and a tile of output columns, gathers its
    rows (the tokens' hidden states for gate|up, the pairs' activations for down), multiplies them by its expert's
    weight tile (tl.dot, float32 accumulation; float32 in IEEE precision, as the CPU paths compute), adds the
    expert's bias, and for down scales each row by its routing weight; the k slots are then summed per token.

Without a GPU it runs in Triton's interpreter (TRITON_INTERPRET=1): tests/model_executor/test_triton_moe.py checks
it against the PyTorch experts there.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # pairs per program: tl.dot's smallest tile, and little padding for decode's one or two rows
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, topk_weight_ptr, sorted_ids_ptr, block_expert_ptr, n, k,
                         num_pairs,
                         top_k, stride_am, stride_we, stride_wn, stride_be, stride_cm,
                         GATHER_TOKENS: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # past the last expert's blocks
        return
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // top_k if GATHER_TOKENS else pairs  # gate|up reads the pair's token, down the pair's own row
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < k),
                    other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                    mask=col_ok[None, :] & (ks[:, None] < k), other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(topk_weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [worst case], expert id per block of block_m [worst case / block_m], -1 past the end)."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + block_m - 1) // block_m
    padded_start = torch.cumsum(blocks * block_m, 0) - blocks * block_m
    start = torch.cumsum(counts, 0) - counts
    expert_sorted = flat[order]
    dest = padded_start[expert_sorted] + torch.arange(pairs, device=flat.device) - start[expert_sorted]
    capacity = pairs + num_experts * (block_m - 1)
    capacity += -capacity % block_m
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.long, device=flat.device)
    sorted_ids[dest] = order
    block_end = torch.cumsum(blocks, 0)
    block_expert = torch.searchsorted(block_end, torch.arange(capacity // block_m, device=flat.device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  weights: torch.Tensor | None, sorted_ids: torch.Tensor, block_expert: torch.Tensor, top_k: int,
                  gather_tokens: bool) -> None:
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, weights if weights is not None else out, sorted_ids,
        block_expert, n, k, out.shape[0], top_k, a.stride(0), w.stride(0), w.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        GATHER_TOKENS=gather_tokens, HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def triton_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                         b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k weight[t, k] * expert_{id[t, k]}(x[t]); x [T, H], w13 [E, 2I, H], w2 [E, H, I] (contiguous)."""
    t, top_k = topk_ids.shape
    sorted_ids, block_expert = align_by_expert(topk_ids, w13.shape[0])
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    gate_up = torch.empty(t * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, b13, gate_up, None, sorted_ids, block_expert, top_k, True)
    act = activation(gate_up).contiguous()
    out = torch.empty(t * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, b2, out, topk_weights.reshape(-1).float().contiguous(), sorted_ids, block_expert, top_k,
                  False)
    return out.view(t, top_k, -1).sum(dim=1)
