"""Token type ids (BERT's segment ids: 0 for a pair's first text, 1 for its second) carried in the high bits of the
step's input ids, as vLLM does: the flat batch, its broadcast to other ranks and the model's forward keep one
tensor of ids, and a model with token type embeddings splits them again.

A request says where its second segment starts (vLLM's `PoolingParams.extra_kwargs["compressed_token_type_ids"]`:
the first position of type 1; every token from there on has type 1), which is all a tokenizer's pair template
produces.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.pooling_params import PoolingParams

COMPRESSED_TOKEN_TYPE_IDS = "compressed_token_type_ids"  # PoolingParams.extra_kwargs key (vLLM's)
TOKEN_TYPE_SHIFT = 30  # vocabularies stay below 2**30 ids


def compress_token_type_ids(token_type_ids: list[int]) -> int | None:
    """[0, 0, 1, 1] -> 2 (the first type-1 position); None when every token has type 0. ValueError for types a
    start position cannot say (anything but zeros then ones)."""
    first = next((i for i, t in enumerate(token_type_ids) if t), None)
    if first is None:
        return None
    if any(t != 1 for t in token_type_ids[first:]):
        raise ValueError(f"token_type_ids must be zeros then ones, got {token_type_ids}.")
    return first


def shift_token_types(params: PoolingParams, num_dropped: int) -> PoolingParams:
    """The params of a prompt whose first num_dropped tokens were truncated away: the second segment starts that
    much earlier."""
    start = (params.extra_kwargs or {}).get(COMPRESSED_TOKEN_TYPE_IDS)
    if start is None or not num_dropped:
        return params
    return dataclasses.replace(params, extra_kwargs={**params.extra_kwargs,
                                                     COMPRESSED_TOKEN_TYPE_IDS: max(0, start - num_dropped)})


def add_token_types(input_ids: torch.Tensor, positions: torch.Tensor, type_starts: list[int | None],
                    span_lens: list[int]) -> None:
    """In place: the bit of type 1 on each token at or past its request's start (spans one after another in the
    flat batch, span_lens tokens each; None: all type 0)."""
    never = torch.iinfo(torch.long).max
    starts = torch.tensor([never if s is None else s for s in type_starts], dtype=torch.long)
    per_token = starts.repeat_interleave(torch.tensor(span_lens)).to(positions.device)
    input_ids.bitwise_or_((positions >= per_token).long() << TOKEN_TYPE_SHIFT)


def split_token_types(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (token ids, token type ids)."""
    return input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1), input_ids >> TOKEN_TYPE_SHIFT
