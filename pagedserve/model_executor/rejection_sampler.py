"""Verification of draft tokens (speculative decoding), for a batch mixing requests with and without drafts.

A request with k drafts has k + 1 rows of logits: row j scores the token after its j-th draft (row 0: after its
last known token). Greedy rows accept drafts while they equal the argmax, then take the argmax. Random rows use
rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft d_j, drawn from the proposer's q_j, is kept
with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from the residual
max(p_j - q_j, 0) (normalised), and when all k are kept a bonus token is drawn from p_k. The tokens produced are
then distributed exactly as the target model's own samples, temperature/top-k/top-p/min-p included (p is the
distribution the plain sampler draws from). A proposer without a distribution (n-gram lookup, or a greedy draft
model) has q_j = one-hot(d_j).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.model_executor.sampler import (LogprobsTensors, SamplingMetadata, gather_logprobs, greedy_ids_of,
                                               inverse_cdf_sample, processed_logits, sampling_probs, uniforms,
                                               SAMPLING_EPS)


@dataclass
class DraftBatch:
    """Per request, in row order: its drafts and, for a sampling draft model, their distributions ([k, V])."""
    token_ids: list[list[int]]
    probs: list[torch.Tensor | None]


@dataclass
class VerifiedTokens:
    token_ids: list[list[int]]  # per request: the accepted drafts, then one token of the target's
    logprobs: LogprobsTensors | None  # one row per produced token, requests in order (when any row asked)


def rejection_sample(logits: torch.Tensor, metadata: SamplingMetadata, drafts: DraftBatch,
                     default_generator: torch.Generator | None) -> VerifiedTokens:
    """logits: [sum(k_b + 1), V]; metadata: one row per logits row (a request's params repeated k_b + 1 times)."""
    logits, raw_logprobs = processed_logits(logits, metadata)
    greedy_ids = greedy_ids_of(logits)
    if metadata.all_greedy:  # the common case, and cheap: one argmax, then each request's leading matches
        token_ids = _accept_greedy(greedy_ids.tolist(), drafts.token_ids)
    else:
        token_ids = _accept_sampled(logits, greedy_ids, metadata, drafts, default_generator)
    logprobs = None
    if raw_logprobs is not None:
        row_start = 0
        rows = []
        for d, ids in zip(drafts.token_ids, token_ids):
            rows += range(row_start, row_start + len(ids))
            row_start += len(d) + 1
        produced = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=logits.device)
        logprobs = gather_logprobs(raw_logprobs[torch.tensor(rows, device=logits.device)], produced,
                                   metadata.max_num_logprobs)
    return VerifiedTokens(token_ids, logprobs)


def _accept_greedy(argmax: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Per request: its drafts while they equal the argmax of their row, then the argmax after the last one kept."""
    token_ids, row = [], 0
    for draft in drafts:
        targets = argmax[row:row + len(draft) + 1]
        num_accepted = next((j for j, (d, t) in enumerate(zip(draft, targets)) if d != t), len(draft))
        token_ids.append(draft[:num_accepted] + [targets[num_accepted]])
        row += len(draft) + 1
    return token_ids


def _accept_sampled(logits: torch.Tensor, greedy_ids: torch.Tensor, metadata: SamplingMetadata, drafts: DraftBatch,
                    default_generator: torch.Generator | None) -> list[list[int]]:
    """Rejection sampling for a batch with random rows (greedy rows in it are verified as in _accept_greedy)."""
    device = logits.device
    num_drafts = torch.tensor([len(d) for d in drafts.token_ids], dtype=torch.long)
    row_start = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    bonus_rows = (row_start + num_drafts).to(device)
    # the row of each draft, and which request / position it is
    req_of_draft = torch.repeat_interleave(torch.arange(len(num_drafts)), num_drafts)
    pos_of_draft = torch.arange(len(req_of_draft)) - torch.repeat_interleave(torch.cumsum(num_drafts, 0) - num_drafts,
                                                                             num_drafts)
    draft_rows = (row_start[req_of_draft] + pos_of_draft).to(device)
    draft_ids = torch.tensor([t for d in drafts.token_ids for t in d], dtype=torch.long, device=device)

    is_greedy = metadata.temperature < SAMPLING_EPS
    probs = sampling_probs(logits, metadata)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    q = _draft_distributions(drafts, draft_ids, probs.shape[1], device)
    p_draft = probs[draft_rows]
    index = torch.arange(len(draft_ids), device=device)
    u = uniforms(len(draft_ids), _rows_generators(metadata, draft_rows), default_generator, device)
    keep = u * q[index, draft_ids].double() < p_draft[index, draft_ids].double()
    residual = (p_draft - q).clamp_min_(0.0)
    exhausted = residual.sum(dim=-1) <= 0  # p == q on this row: nothing left to correct, p itself is exact
    residual[exhausted] = p_draft[exhausted]
    draft_greedy = is_greedy[draft_rows]
    accepted = torch.where(draft_greedy, greedy_ids[draft_rows] == draft_ids, keep)
    recovered = torch.where(draft_greedy, greedy_ids[draft_rows], inverse_cdf_sample(
        residual, _rows_generators(metadata, draft_rows), default_generator))
    bonus = torch.where(is_greedy[bonus_rows], greedy_ids[bonus_rows], inverse_cdf_sample(
        probs[bonus_rows], _rows_generators(metadata, bonus_rows), default_generator))

    # accepted drafts per request: the length of the leading run of accepted positions
    table = torch.zeros(len(num_drafts), int(num_drafts.max()) + 1, dtype=torch.bool)
    table[req_of_draft, pos_of_draft] = accepted.cpu()
    num_accepted = table.int().cumprod(dim=1).sum(dim=1)
    first_rejected = (torch.cumsum(num_drafts, 0) - num_drafts + num_accepted).clamp_max(max(len(draft_ids) - 1, 0))
    rejected_token = recovered.cpu()[first_rejected] if len(draft_ids) else bonus.cpu()
    final = torch.where(num_accepted < num_drafts, rejected_token, bonus.cpu()).tolist()
    return [d[:a] + [t] for d, a, t in zip(drafts.token_ids, num_accepted.tolist(), final)]


def _draft_distributions(drafts: DraftBatch, draft_ids: torch.Tensor, vocab_size: int,
                         device: torch.device) -> torch.Tensor:
    """[num_drafts, V] q of every draft: the proposer's distribution, or one-hot on the draft."""
    q = torch.zeros(len(draft_ids), vocab_size, dtype=torch.float32, device=device)
    q[torch.arange(len(draft_ids), device=device), draft_ids] = 1.0
    offset = 0
    for ids, probs in zip(drafts.token_ids, drafts.probs):
        if probs is not None:
            q[offset:offset + len(ids)] = probs[:len(ids), :vocab_size].to(device)
        offset += len(ids)
    return q


def _rows_generators(metadata: SamplingMetadata, rows: torch.Tensor) -> dict[int, torch.Generator]:
    """The seeded generators of a subset of rows, re-indexed by position in the subset."""
    if not metadata.generators:
        return {}
    return {i: metadata.generators[row] for i, row in enumerate(rows.tolist()) if row in metadata.generators}
