"""Scoring text pairs (vLLM's score_utils), shared by LLM.score and the /score and /rerank routes: which pairs a
request means, a cross-encoder's pair prompt, and the cosine similarity of an embedding model's vectors."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.errors import InvalidRequestError


def score_pairs(data_1: str | list[str], data_2: str | list[str], param_1: str = "text_1",
                param_2: str = "text_2") -> list[tuple[str, str]]:
    """1:1, 1:N (one query against each document) or N:N (pairwise) as vLLM; each text a non-empty string."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for param, texts in ((param_1, first), (param_2, second)):
        if not texts:
            raise InvalidRequestError(f"{param} must not be empty.", param=param)
        if any(not isinstance(t, str) or not t for t in texts):
            raise InvalidRequestError(f"{param} must be a non-empty string or a list of them.", param=param)
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise InvalidRequestError(f"{param_1} has {len(first)} texts and {param_2} {len(second)}: give one "
                                  f"{param_1} or as many as {param_2}.", param=param_2)
    return list(zip(first, second))


def cross_encoder_tokens(tokenizer: Any, query: str, document: str) -> list[int]:
    """The pair as the cross-encoder was trained to read it (the tokenizer's own pair template)."""
    return list(tokenizer(text=query, text_pair=document)["input_ids"])


def cosine_scores(first: list[list[float]], second: list[list[float]]) -> list[float]:
    """An embedding model's score of each pair: the cosine similarity of the two embeddings."""
    a, b = torch.tensor(first, dtype=torch.float32), torch.tensor(second, dtype=torch.float32)
    return F.cosine_similarity(a, b, dim=-1).tolist()
