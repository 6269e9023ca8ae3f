"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs), computed from the prefill's own forward.

A prefill chunk of a request that asks for them gets logits at every position (TokenSpan.num_logits = the chunk
length) instead of at its last one only; other requests' spans are unchanged, so a step without such a request
costs nothing extra. The chunk's logits at position j score the prompt token at j + 1. Over a chunked prefill each
chunk contributes its own entries. Only the first of n samples computes them (all n share the prompt). The
scheduler gives such requests no prefix-cache or KV-connector hit: a cached prefix has no logits (vLLM does the
same).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.core.scheduler import ScheduledRequest
from pagedserve.model_executor.input_batch import TokenSpan
from pagedserve.outputs import Logprob


@dataclass
class PromptChunk:
    """A prefill chunk's prompt-logprob rows: its first `num_rows` logits rows score `targets`."""
    request_id: str
    start: int  # index of the first entry (the chunk's first position)
    targets: list[int]  # the prompt tokens at positions start + 1 ... start + num_rows
    num_top: int  # the request's prompt_logprobs

    @property
    def num_rows(self) -> int:
        return len(self.targets)


@dataclass
class PromptLogprobRows:
    """Where a step's logits hold prompt-logprob rows and which rows sample."""
    chunks: list[tuple[int, PromptChunk]]  # (first logits row, chunk)
    sample_rows: torch.Tensor  # the rows the sampler reads, in sampling-item order


def prompt_chunk(item: ScheduledRequest) -> PromptChunk | None:
    """The chunk's prompt-logprob rows, or None when it has none to compute."""
    r = item.request
    k = r.sampling_params.prompt_logprobs
    if k is None or r.sample_index != 0 or item.spec_token_ids:
        return None
    first = r.num_computed_tokens
    end = min(first + item.num_new_tokens, r.num_prompt_tokens - 1)  # the last prompt token scores nothing
    if end <= first:
        return None
    return PromptChunk(r.request_id, first, r.prompt_token_ids[first + 1:end + 1], k)


def prompt_logprob_rows(items: list[ScheduledRequest], spans: list[TokenSpan], chunks: list[PromptChunk | None],
                        device: torch.device) -> PromptLogprobRows | None:
    """None when no chunk asks (the logits rows are then exactly the sampling rows)."""
    if all(c is None for c in chunks):
        return None
    placed, sample_rows, row = [], [], 0
    for item, span, chunk in zip(items, spans, chunks):
        if chunk is not None:
            placed.append((row, chunk))
        if item.samples:
            num_sampling = len(item.spec_token_ids) + 1
            sample_rows.extend(range(row + span.num_logits - num_sampling, row + span.num_logits))
        row += span.num_logits
    return PromptLogprobRows(placed, torch.tensor(sample_rows, dtype=torch.long, device=device))


def compute_prompt_logprobs(logits: torch.Tensor, chunks: list[tuple[int, PromptChunk]]
                            ) -> dict[str, tuple[int, list[dict[int, Logprob]]]]:
    """request id -> (first entry index, one dict per scored prompt token: the token's logprob and rank plus the
    top num_top), from float32 log_softmax over the chunk rows, all chunks in one batch."""
    device = logits.device
    rows = torch.cat([torch.arange(row, row + c.num_rows, device=device) for row, c in chunks])
    targets = torch.tensor([t for _, c in chunks for t in c.targets], dtype=torch.long, device=device)
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    token_lps = logprobs.gather(1, targets.unsqueeze(1))
    ranks = ((logprobs > token_lps).sum(dim=-1) + 1).tolist()
    num_top = max(c.num_top for _, c in chunks)
    top_lps, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], targets[:, None][:, :0])
    token_lps, top_lps, top_ids = token_lps.squeeze(1).tolist(), top_lps.tolist(), top_ids.tolist()
    out, i = {}, 0
    for _, c in chunks:
        entries = []
        for target in c.targets:  # output assembly for the rows that asked, as for sampled tokens' logprobs
            entry = {target: Logprob(token_lps[i], ranks[i])}
            for rank, (tid, tlp) in enumerate(zip(top_ids[i][:c.num_top], top_lps[i][:c.num_top]), start=1):
                entry.setdefault(tid, Logprob(tlp, rank))
            entries.append(entry)
            i += 1
        out[c.request_id] = (c.start, entries)
    return out
