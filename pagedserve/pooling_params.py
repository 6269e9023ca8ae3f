"""User-facing parameters of a pooling request (vLLM's PoolingParams): what a pooling model computes from a prompt.

A pooling engine (`runner="pooling"`) runs only these: prefill, then the pooler (model_executor/pooling_runner.py);
no token is sampled. `task` says which output: "embed" (one vector, normalised as the model's sentence-transformers
config says; `dimensions` truncates a Matryoshka model's), "classify" (class probabilities of a sequence
classification head) or "score" (a cross-encoder's relevance of a text pair, or, for an embedding model, the
cosine similarity the entrypoint computes from two embeddings).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import RequestOutputKind

POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    task: str | None = None  # embed | classify | score; None: the engine's own task
    dimensions: int | None = None  # embed: the first `dimensions` components, renormalised (Matryoshka models)
    normalize: bool | None = None  # embed: L2-normalise (None: as the model's config says)
    activation: bool | None = None  # classify / score: softmax (sigmoid for one label) over the logits (None: yes)
    truncate_prompt_tokens: int | None = None  # keep the last this many prompt tokens (-1: max_model_len)
    # vLLM's: set by the entrypoints (compressed_token_type_ids: where a cross-encoder pair's second text starts)
    extra_kwargs: dict[str, Any] | None = None

    # a pooling request is one sequence and answers once, when its prompt has run (the async engine reads these)
    n = 1
    output_kind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.",
                                      param="task")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}.",
                                      param="dimensions")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens < -1
                                                        or self.truncate_prompt_tokens == 0):
            raise InvalidRequestError("truncate_prompt_tokens must be >= 1 or -1.", param="truncate_prompt_tokens")
