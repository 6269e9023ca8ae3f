"""The driver's per-step message to its workers: the flat forward inputs, packed into one int64 tensor.

Workers do not need the scheduler's request state: the driver (rank 0, in the engine process) prepares the
batch exactly as a single process would (token ids, positions, slot mapping, block tables, prefill spans, which
rows produce logits) and broadcasts those integers. Sampling, penalties, structured-output masks and per-request
generators stay on the driver, which alone receives the full logits. A message is two broadcasts over the gloo
world group: a fixed header [command, payload length] and the payload.

Payload of a STEP: [num_tokens, num_decodes, table_width, num_prefills, num_logits, block_size], then
input_ids, positions, slot_mapping (num_tokens each), the decode block table (num_decodes x table_width) and
context lengths, per prefill [start, num_tokens, context_len, num_blocks] + its block ids, the logits indices; then
for a hybrid model's KV cache groups 1.. (core/kv_cache_groups.py), [number of groups] and per group its table
width, slot mapping, decode block table and per prefill [num_blocks] + its block ids.
"""
from __future__ import annotations

import enum
from dataclasses import replace

import torch
import torch.distributed as dist

from pagedserve.model_executor.attention import AttentionMetadata, PrefillSpan, chunk_causal_mask

HEADER_LEN = 6


class Command(enum.IntEnum):
    STEP = 1
    ALLOCATE_KV_CACHE = 2  # payload: [num_blocks]
    SHUTDOWN = 3


StepInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]  # ids, positions, meta, logits rows


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              logits_indices: torch.Tensor) -> torch.Tensor:
    d = meta.num_decodes
    width = meta.decode_block_tables.shape[1] if d else 0
    header = [input_ids.numel(), d, width, len(meta.prefills), logits_indices.numel(), meta.block_size]
    parts = [torch.tensor(header, dtype=torch.long), input_ids, positions, meta.slot_mapping]
    if d:
        parts += [meta.decode_block_tables.flatten(), meta.decode_context_lens]
    for span in meta.prefills:
        parts += [torch.tensor([span.start, span.num_tokens, span.context_len, span.block_ids.numel()]),
                  span.block_ids]
    parts.append(logits_indices)
    if meta.group_metadata:
        parts.append(torch.tensor([len(meta.group_metadata)]))
    for group in meta.group_metadata:
        parts += [torch.tensor([group.decode_block_tables.shape[1] if d else 0]), group.slot_mapping]
        if d:
            parts.append(group.decode_block_tables.flatten())
        for span in group.prefills:
            parts += [torch.tensor([span.block_ids.numel()]), span.block_ids]
    return torch.cat([p.to("cpu", torch.long) for p in parts])


def unpack_step(buf: torch.Tensor, device: torch.device) -> StepInputs:
    num_tokens, d, width, num_prefills, num_logits, block_size = buf[:HEADER_LEN].tolist()
    at = HEADER_LEN

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return buf[at - n:at].to(device)

    input_ids, positions, slot_mapping = take(num_tokens), take(num_tokens), take(num_tokens)
    tables = lens = None
    if d:
        tables, lens = take(d * width).view(d, width), take(d)
    prefills = []
    for _ in range(num_prefills):
        start, n, context_len, num_blocks = buf[at:at + 4].tolist()
        at += 4
        prefills.append(PrefillSpan(start, n, context_len, take(num_blocks),
                                    chunk_causal_mask(context_len - n, context_len, device)))
    logits_indices = take(num_logits)
    meta = AttentionMetadata(slot_mapping, d, tables, lens, block_size, prefills)
    num_groups = int(take(1)) if at < buf.numel() else 0
    for _ in range(num_groups):
        width = int(take(1))
        slots = take(num_tokens)
        group_tables = take(d * width).view(d, width) if d else None
        spans = [replace(span, block_ids=take(int(take(1)))) for span in prefills]
        meta.group_metadata.append(replace(meta, slot_mapping=slots, decode_block_tables=group_tables,
                                           prefills=spans, group_metadata=[]))
    return input_ids, positions, meta, logits_indices


class ControlChannel:
    """Rank 0 broadcasts commands; every other rank receives them in the same order."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, command: Command, payload: torch.Tensor | None = None, wait: bool = True) -> list[dist.Work]:
        """wait=False returns the broadcasts' works at once (they complete when every rank has received): the
        driver of a pipeline does not wait for stages still busy with an earlier batch."""
        payload = torch.empty(0, dtype=torch.long) if payload is None else payload
        works = [self.group.broadcast(torch.tensor([int(command), payload.numel()]), 0)]
        if payload.numel():
            works.append(self.group.broadcast(payload, 0))
        if wait:
            for work in works:
                work.wait()
        return works

    def recv(self) -> tuple[Command, torch.Tensor]:
        header = torch.empty(2, dtype=torch.long)
        self.group.broadcast(header, 0).wait()
        command, length = header.tolist()
        payload = torch.empty(length, dtype=torch.long)
        if length:
            self.group.broadcast(payload, 0).wait()
        return Command(command), payload
