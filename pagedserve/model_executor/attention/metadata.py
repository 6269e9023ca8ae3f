"""What every attention backend reads about one flattened step (each backend derives its own view from it once per
forward: AttentionBackend.build_metadata): where the new K/V go and, per query row, which
blocks of the paged cache it attends to.

Token order in the batch: all decode rows first, then prefill chunks. A decode row is one query token with its own
block table and context length: a request's decode token, or each token of a short span (a verification of draft
tokens, a short prefill tail; input_batch.runs_as_decode), whose rows see the context up to their own position -
causal, since every K/V of the step is written before any attention of the layer reads. A prefill chunk attends
causally to its whole context, offset by what came before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    start: int  # index of the chunk's first token in the flattened batch
    num_tokens: int  # new tokens in this chunk
    context_len: int  # tokens attended to by the chunk's last token (earlier context + the chunk)
    block_ids: torch.Tensor | None  # [num_blocks_of_request] long (None: an encoder's span, no KV cache)
    causal_mask: torch.Tensor | None  # [num_tokens, context_len] bool when context_len > num_tokens
    # False: bidirectional (an encoder's whole sequence in one chunk, no earlier context; pooling models)
    causal: bool = True


@dataclass
class AttentionMetadata:
    # [num_tokens] long (slot = block_id * block_size + offset; -1: write nothing); None: an encoder's step (no KV)
    slot_mapping: torch.Tensor | None
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long, padded with block 0
    decode_context_lens: torch.Tensor | None  # [num_decodes] long
    block_size: int
    prefills: list[PrefillSpan]
    # a hybrid model's KV cache groups 1.. (core/kv_cache_groups.py): the same rows through each group's block tables
    # (its slots, decode tables and chunks' blocks); a layer of group g reads group_metadata[g - 1]
    group_metadata: list[AttentionMetadata] = field(default_factory=list)


def chunk_causal_mask(first: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """[context_len - first, context_len] bool for a prefill chunk starting at position `first`: causal over the
    whole context, offset by what came before. None for a first chunk (plain causal over its own tokens)."""
    if first == 0:
        return None
    return torch.arange(context_len, device=device)[None, :] <= torch.arange(first, context_len, device=device)[:, None]


def sliding_causal_mask(first: int, context_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[context_len - first, context_len] bool: the chunk's query at position p attends to keys p - window + 1 .. p
    (Hugging Face's sliding-window mask)."""
    keys = torch.arange(context_len, device=device)[None, :]
    queries = torch.arange(first, context_len, device=device)[:, None]
    return (keys <= queries) & (keys > queries - window)
