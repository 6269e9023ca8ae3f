"""Paged attention over a flattened batch: prefill chunks and decodes in one forward.

KV cache of one layer: [num_blocks, block_size, num_kv_heads, head_dim] for K and for V (on CPU, views of head-major
blocks: model_runner.allocate_kv_cache), in the cache dtype (the model's, or bfloat16/float16 to halve the bytes;
read back into the query dtype). New K/V are written at `slot_mapping` (slot = block_id * block_size + offset)
before any attention of the layer reads, so a request may attend to blocks that another request of the same step
is filling.

Token order in the batch: all decode rows first, then prefill chunks. A decode row is one query token with its
own block table and context length: a request's decode token, or each token of a short span (a verification of
draft tokens, a short prefill tail; input_batch.runs_as_decode), whose rows see the context up to their own
position - causal, since every K/V of the step is written first.
  * decodes: on CPU, a native kernel reads each row's blocks in place through its block table
    (kernels/paged_attention.cpp); elsewhere, one batched SDPA over blocks gathered through the
    padded block table;
  * prefill chunks: on CPU with AVX-512 (head_dim % 16 == 0), one native call per chunk reads the
    chunk's whole context, its own new K/V included, from the cache through its block table (causal
    with an offset; kernels/paged_attention.cpp; bfloat16 on AMX tiles where the CPU has them); elsewhere
    one SDPA per chunk: a chunk with no earlier context attends to its own new K/V (causal), a later chunk
    gathers its context through its block table (causal with an offset).
On CUDA, when Triton imports, all of this is Triton kernels reading the cache in place instead
(triton_attention.py); PAGEDSERVE_ATTENTION_BACKEND=torch keeps the path above, =triton forces Triton (on a CPU
only useful under TRITON_INTERPRET=1, for tests).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache, cached_property

import torch
import torch.nn.functional as F

from pagedserve.model_executor.kernels import cpu_kernels

NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the native kernels read and write (any KV cache dtype)


@dataclass
class PrefillSpan:
    start: int  # index of the chunk's first token in the flattened batch
    num_tokens: int  # new tokens in this chunk
    context_len: int  # tokens attended to by the chunk's last token (earlier context + the chunk)
    block_ids: torch.Tensor  # [num_blocks_of_request] long
    causal_mask: torch.Tensor | None  # [num_tokens, context_len] bool when context_len > num_tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long, padded with block 0
    decode_context_lens: torch.Tensor | None  # [num_decodes] long
    block_size: int
    prefills: list[PrefillSpan]

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool, True = attend (for the gathered SDPA path)."""
        width = self.decode_block_tables.shape[1] * self.block_size
        positions = torch.arange(width, device=self.decode_context_lens.device)
        return (positions[None, :] < self.decode_context_lens[:, None])[:, None, None, :]


def chunk_causal_mask(first: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """[context_len - first, context_len] bool for a prefill chunk starting at position `first`: causal over the
    whole context, offset by what came before. None for a first chunk (plain causal over its own tokens)."""
    if first == 0:
        return None
    return torch.arange(context_len, device=device)[None, :] <= torch.arange(first, context_len, device=device)[:, None]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kernels = cpu_kernels() if k.device.type == "cpu" and k.dtype in NATIVE_DTYPES else None
    if kernels is not None:  # one call for K and V, straight from the QKV output, no intermediate copies
        kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    # (block, offset) pairs, not flat slots: on CPU the caches are strided views of one tensor (not viewable flat)
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


@cache
def uses_triton(device_type: str) -> bool:
    """Whether attention on this device type runs the Triton kernels (see the module docstring)."""
    choice = os.environ.get("PAGEDSERVE_ATTENTION_BACKEND", "auto")
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"PAGEDSERVE_ATTENTION_BACKEND must be auto, triton or torch, got {choice!r}.")
    if choice == "torch" or (choice == "auto" and device_type != "cuda"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        if choice == "triton":
            raise
        return False
    return True


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] (this step's new tokens). Returns [T, H, D]."""
    if uses_triton(q.device.type):
        from pagedserve.model_executor import triton_attention

        return triton_attention.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    d = meta.num_decodes
    kernels = cpu_kernels() if q.device.type == "cpu" and q.dtype in NATIVE_DTYPES else None
    if d and kernels is not None:  # q is read in place from the QKV output and out written in place
        kernels.paged_decode_attention(q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                       scale, out[:d])
    elif d:
        bt = meta.decode_block_tables
        keys = k_cache[bt].reshape(d, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        values = v_cache[bt].reshape(d, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(q[:d].unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                           scale=scale, enable_gqa=True)
        out[:d] = o.squeeze(2)
    native_prefill = kernels is not None and kernels.native_prefill(head_dim)
    for span in meta.prefills:
        sl = slice(span.start, span.start + span.num_tokens)
        if native_prefill:  # reads the chunk's context (its own K/V included) from the cache in place
            kernels.paged_prefill_attention(q[sl], k_cache, v_cache, span.block_ids,
                                            span.context_len - span.num_tokens, scale, out[sl])
            continue
        qs = q[sl].transpose(0, 1).unsqueeze(0)
        if span.causal_mask is None:  # the chunk is the whole context so far
            keys, values = k[sl], v[sl]
        else:
            keys = k_cache[span.block_ids].reshape(-1, num_kv_heads, head_dim)[:span.context_len].to(q.dtype)
            values = v_cache[span.block_ids].reshape(-1, num_kv_heads, head_dim)[:span.context_len].to(q.dtype)
        o = F.scaled_dot_product_attention(qs, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
                                           attn_mask=span.causal_mask, is_causal=span.causal_mask is None,
                                           scale=scale, enable_gqa=True)
        out[sl] = o.squeeze(0).transpose(0, 1)
    return out
