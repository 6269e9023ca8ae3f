"""Prompt lookup (n-gram) proposer: if the request's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) occurred before in its own prompt + output, propose the tokens that followed their latest
earlier occurrence. No model, no state: code edits, quotes and extraction copy long spans of the prompt."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """Up to num_drafts tokens that followed the latest earlier occurrence of the longest matching suffix."""
    length = len(token_ids)
    if num_drafts <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows that start early enough to have at least one token after them (so never the suffix itself)
        windows = sliding_window_view(token_ids[:length - 1], n)
        hits = np.flatnonzero((windows == token_ids[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start:start + num_drafts].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[list[int]], num_drafts: list[int]) -> list[list[int]]:
        """One list of drafts per request (token_ids: its prompt + output, including this step's new tokens)."""
        return [propose_ngram(np.asarray(ids, dtype=np.int64), self.min_n, self.max_n, k) if k else []
                for ids, k in zip(token_ids, num_drafts)]
