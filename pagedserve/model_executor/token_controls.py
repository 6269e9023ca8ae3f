"""Per-request token controls in the sampler (vLLM's names): logit_bias, allowed_token_ids and bad_words.

Each step builds flat index tensors once for the whole batch (rows x tokens of the rows that use a control) and
applies them with one indexing op each: no per-token Python loop. bad_words reduce to banned (row, token) pairs:
the last token of a word is banned when the row's output ends with the word's other tokens (vLLM's rule); that
check runs per request and word, and its result joins the min_tokens bans.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.sampling_params import SamplingParams


def logit_bias_tensors(params: Sequence[SamplingParams], device: torch.device | str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, token ids, biases) over every row's logit_bias; None when no row has one."""
    rows, cols, values = [], [], []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows.extend([row] * len(p.logit_bias))
            cols.extend(p.logit_bias.keys())
            values.extend(p.logit_bias.values())
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(cols, dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def allowed_token_tensors(params: Sequence[SamplingParams], device: torch.device | str
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) of every row's allowed_token_ids; None when no row restricts its tokens."""
    rows, cols = [], []
    for row, p in enumerate(params):
        if p.allowed_token_ids:
            rows.extend([row] * len(p.allowed_token_ids))
            cols.extend(p.allowed_token_ids)
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(cols, dtype=torch.int64, device=device)


def apply_token_controls(logits: torch.Tensor, logit_bias: tuple[torch.Tensor, ...] | None,
                         allowed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """In place on float32 logits: adds each row's logit_bias, then sets every token outside a restricted row's
    allowed_token_ids to -inf."""
    if logit_bias is not None:
        rows, cols, values = logit_bias
        logits.index_put_((rows, cols), values, accumulate=True)
    if allowed is not None:
        rows, cols = allowed
        restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        restricted[rows] = True
        keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        keep[rows, cols] = True
        logits.masked_fill_(restricted.unsqueeze(1) & ~keep, float("-inf"))
    return logits


def bad_word_bans(bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete one of the words after this output (a one-token word is always banned)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or list(output_token_ids[len(output_token_ids) - prefix:]) == list(word[:-1]):
            banned.append(word[-1])
    return banned
