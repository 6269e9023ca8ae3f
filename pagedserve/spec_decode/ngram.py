"""Prompt lookup (n-gram) proposer: if the request's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) occurred before in its own prompt + output, propose the tokens that followed their latest
earlier occurrence. No model, no state: code edits, quotes and extraction copy long spans of the prompt."""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """Up to num_drafts tokens that followed the latest earlier occurrence of the longest matching suffix
    (at least min_n, at most max_n tokens long)."""
    length = len(token_ids)
    if num_drafts <= 0 or length < min_n + 1:
        return []
    # candidates: earlier positions holding the last token (each with at least one token after it); then the
    # match is extended backwards, one comparison per candidate per extra token, never a scan per n
    ends = np.flatnonzero(token_ids[:length - 1] == token_ids[length - 1])
    if ends.size == 0:
        return []
    match_len = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        earlier = ends - back
        alive &= earlier >= 0
        alive[alive] &= token_ids[earlier[alive]] == token_ids[length - 1 - back]
        if not alive.any():
            break
        match_len += alive
    best = match_len.max()
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(match_len == best)[-1]]) + 1  # the latest of the longest
    return token_ids[start:start + num_drafts].tolist()


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[list[int]], num_drafts: list[int]) -> list[list[int]]:
        """One list of drafts per request (token_ids: its prompt + output, including this step's new tokens)."""
        return [propose_ngram(np.asarray(ids, dtype=np.int64), self.min_n, self.max_n, k) if k else []
                for ids, k in zip(token_ids, num_drafts)]
