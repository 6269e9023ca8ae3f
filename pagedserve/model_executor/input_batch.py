"""One flattened forward's inputs from spans of new tokens: token ids, positions, slot mapping, attention metadata
and which rows produce logits. Shared by the model runner and the draft model (which writes its own KV cache
through the same block tables)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pagedserve.model_executor.attention.metadata import (
    AttentionMetadata,
    PrefillSpan,
    chunk_causal_mask,
)


@dataclass
class TokenSpan:
    token_ids: list[int]  # the new tokens, at positions start_pos, start_pos + 1, ...
    start_pos: int  # tokens before it are in the KV cache already
    block_ids: list[int]  # the request's block table
    num_logits: int  # logits rows for the span's last num_logits positions (0: none)
    group_block_ids: list[list[int]] = field(default_factory=list)  # a hybrid model's other groups' tables


@dataclass
class InputBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor


# A span this short runs as decode rows, one per token, each attending to the context up to its own position
# through the block table (its K/V is written before attention reads): the drafts a verification scores, and
# short prefill tails, read the paged cache in place in the batched decode kernel instead of a gather and an
# SDPA call per span and layer. Longer spans go to SDPA, which reads each context row once for all queries.
MAX_DECODE_ROWS_SPAN = 8


def runs_as_decode(num_tokens: int) -> bool:
    return num_tokens <= MAX_DECODE_ROWS_SPAN


def prepare_batch(spans: list[TokenSpan], block_size: int, device: torch.device, causal: bool = True) -> InputBatch:
    """Spans that run as decode rows (runs_as_decode) must come first: attention batches them together.
    causal False (an encoder's): every span is a whole prompt, one bidirectional prefill span however short, with
    no KV cache (no slots, no block tables: attention reads the step's own K/V)."""
    bs = block_size
    tokens: list[int] = []
    positions = []
    decode_lens = []
    prefills: list[PrefillSpan] = []
    logits_indices: list[int] = []
    start = 0
    for span in spans:
        n = len(span.token_ids)
        first = span.start_pos
        context_len = first + n
        tokens.extend(span.token_ids)
        positions.append(np.arange(first, context_len))
        if causal and runs_as_decode(n):
            decode_lens.extend(range(first + 1, context_len + 1))
        else:
            if not causal and first:
                raise ValueError("a bidirectional span must hold its whole prompt (no earlier context).")
            prefills.append(PrefillSpan(start, n, context_len, None,
                                        chunk_causal_mask(first, context_len, device) if causal else None, causal))
        start += n
        logits_indices.extend(range(start - span.num_logits, start))
    meta = AttentionMetadata(
        slot_mapping=None,
        num_decodes=len(decode_lens),
        decode_block_tables=None,
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=device) if decode_lens else None,
        block_size=bs,
        prefills=prefills,
    )
    input_ids = torch.tensor(tokens, dtype=torch.long, device=device)
    positions_t = torch.from_numpy(np.concatenate(positions)).to(device)
    indices = torch.tensor(logits_indices, dtype=torch.long, device=device)
    if not causal:
        return InputBatch(input_ids, positions_t, meta, indices)
    meta = _with_block_tables(meta, spans, [span.block_ids for span in spans], positions, device)
    num_groups = len(spans[0].group_block_ids) if spans else 0
    meta.group_metadata = [_with_block_tables(meta, spans, [span.group_block_ids[g] for span in spans], positions,
                                              device) for g in range(num_groups)]
    return InputBatch(input_ids, positions_t, meta, indices)


def _with_block_tables(meta: AttentionMetadata, spans: list[TokenSpan], tables: list[list[int]],
                       positions: list[np.ndarray], device: torch.device) -> AttentionMetadata:
    """`meta` with the slots, decode block tables and chunks' blocks of one KV cache group's tables (one per span)."""
    bs = meta.block_size
    slots, decode_tables, chunk_blocks = [], [], []
    for span, block_ids, pos in zip(spans, tables, positions):
        n = len(span.token_ids)
        table = np.asarray(block_ids, dtype=np.int64)
        slots.append(table[pos // bs] * bs + pos % bs)
        used_blocks = block_ids[:-(-(span.start_pos + n) // bs)]
        if runs_as_decode(n):
            decode_tables.extend([used_blocks] * n)
        else:
            chunk_blocks.append(torch.tensor(used_blocks, dtype=torch.long, device=device))
    decode_bt = None
    if decode_tables:
        width = max(len(t) for t in decode_tables)
        table = np.zeros((len(decode_tables), width), dtype=np.int64)
        for i, t in enumerate(decode_tables):
            table[i, :len(t)] = t
        decode_bt = torch.from_numpy(table).to(device)
    return replace(meta, slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
                   decode_block_tables=decode_bt,
                   prefills=[replace(p, block_ids=b) for p, b in zip(meta.prefills, chunk_blocks)])
