"""Scoring text pairs (vLLM's score_utils), shared by LLM.score and the /score and /rerank routes: which pairs a
request means, a cross-encoder's pair prompt, and the cosine similarity of an embedding model's vectors."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.errors import InvalidRequestError
from pagedserve.model_executor.token_types import COMPRESSED_TOKEN_TYPE_IDS, compress_token_type_ids
from pagedserve.pooling_params import PoolingParams


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


def score_prompts(tokenizer: Any, pairs: list[tuple[str, str]], model_task: str,
                  params: PoolingParams) -> tuple[list, list[PoolingParams], str]:
    """What to pool for these pairs, with which params (`params` with the task set) and task: an embedding model
    embeds each distinct text once; a cross-encoder reads each pair as one prompt, through the tokenizer's own pair
    template (as it was trained), its second text's token types where the tokenizer gives them (BERT's)."""
    if model_task == "embed":
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        return texts, [dataclasses.replace(params, task="embed")] * len(texts), "embed"
    prompts, per_prompt = [], []
    for a, b in pairs:
        encoded = tokenizer(text=a, text_pair=b)
        prompts.append(list(encoded["input_ids"]))
        start = compress_token_type_ids(list(encoded.get("token_type_ids") or []))
        extra = {**(params.extra_kwargs or {}), COMPRESSED_TOKEN_TYPE_IDS: start} if start is not None \
            else params.extra_kwargs
        per_prompt.append(dataclasses.replace(params, task="score", extra_kwargs=extra))
    return prompts, per_prompt, "score"


def pair_scores(pairs: list[tuple[str, str]], prompts: list, outputs: list, task: str) -> list[float]:
    """Each pair's score from the pooled outputs of score_prompts' prompts (PoolingRequestOutputs, in order): the
    cross-encoder's relevance, or the cosine similarity of the two embeddings."""
    if task == "score":
        return [float(o.outputs.data.reshape(-1)[0]) for o in outputs]
    vectors = {text: o.outputs.data for text, o in zip(prompts, outputs)}
    first = torch.stack([vectors[a] for a, _ in pairs]).float()
    second = torch.stack([vectors[b] for _, b in pairs]).float()
    return F.cosine_similarity(first, second, dim=-1).tolist()
