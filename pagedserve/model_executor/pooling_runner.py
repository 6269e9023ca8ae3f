"""The pooling runner's side of a step: which rows of each prefill chunk the model returns hidden states for, the
pooled state a request carries from chunk to chunk, and the output of a request whose last chunk ran.

Chunked prefill splits a prompt over steps; the pooler still sees every chunk: MEAN adds each chunk's row sum to
the request's running sum (divided by the prompt length at the end), CLS keeps the first chunk's first row, LAST
reads the final chunk's last row (earlier chunks return no rows). A preempted request starts again from its first
token, so its partial state is dropped with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.core.scheduler import ScheduledRequest
from pagedserve.model_executor.pooler import (PoolerConfig, classification_activation, reduce_spans,
                                              truncate_dimensions)
from pagedserve.model_executor.token_types import COMPRESSED_TOKEN_TYPE_IDS, add_token_types


class PoolingRunner:
    def __init__(self, config: PoolerConfig, model: torch.nn.Module) -> None:
        self.config = config
        self.model = model
        self.partial: dict[str, torch.Tensor] = {}  # request id -> [hidden] float32 (MEAN: sum, CLS: first row)

    def num_rows(self, item: ScheduledRequest) -> int:
        """Hidden-state rows the pooler reads from this chunk: the chunk's last ones (TokenSpan.num_logits)."""
        kind = self.config.pooling_type
        if kind == "LAST":
            return 1 if item.samples else 0
        if kind == "CLS":  # the whole first chunk (its first row is the one kept): rows are counted from the end
            return item.num_new_tokens if item.request.num_computed_tokens == 0 else 0
        return item.num_new_tokens

    def add_token_types(self, items: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """The step's token types into its input ids (token_types.py), where a request has a second segment
        (vLLM's compressed_token_type_ids; only models with token type embeddings read them)."""
        if not self.model.reads_token_types:
            return
        starts = [(item.request.pooling_params.extra_kwargs or {}).get(COMPRESSED_TOKEN_TYPE_IDS) for item in items]
        if any(s is not None for s in starts):
            add_token_types(input_ids, positions, starts, [item.num_new_tokens for item in items])

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.partial.pop(request_id, None)

    def step(self, items: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """hidden: the rows num_rows asked for, items in order -> request id -> output (float32, on the CPU) of each
        request whose prompt is now complete: its embedding, or its class probabilities / logits."""
        rows = [self.num_rows(item) for item in items]
        span_lens = torch.tensor([n for n in rows if n], dtype=torch.long, device=hidden.device)
        reduced = iter(reduce_spans(hidden, span_lens, self.config.pooling_type) if any(rows) else ())
        done: list[ScheduledRequest] = []
        pooled: list[torch.Tensor] = []
        for item, n in zip(items, rows):  # per request, not per token
            request_id = item.request.request_id
            value, earlier = next(reduced) if n else None, self.partial.pop(request_id, None)
            if value is None:  # CLS after the first chunk, LAST before the last one: nothing new
                value = earlier
            elif earlier is not None:  # MEAN: the sum so far
                value = earlier + value
            if item.samples:
                done.append(item)
                pooled.append(value)
            elif value is not None:
                self.partial[request_id] = value
        if not done:
            return {}
        vectors = torch.stack(pooled)
        if self.config.pooling_type == "MEAN":
            lens = torch.tensor([item.request.num_prompt_tokens for item in done], device=vectors.device)
            vectors = vectors / lens[:, None].to(vectors.dtype)
        outputs = self.model.pooler_head(vectors)
        if self.config.task == "classify":
            return self._classify(done, outputs)
        return self._embed(done, outputs)

    def _embed(self, items: list[ScheduledRequest], vectors: torch.Tensor) -> dict[str, torch.Tensor]:
        default = self.config.normalize
        norms = [p.normalize if p.normalize is not None else default
                 for p in (item.request.pooling_params for item in items)]
        if any(norms):
            vectors = torch.where(torch.tensor(norms, device=vectors.device)[:, None],
                                  F.normalize(vectors, p=2, dim=-1), vectors)
        vectors = vectors.cpu()
        return {item.request.request_id: truncate_dimensions(v, item.request.pooling_params.dimensions, norm)
                for item, v, norm in zip(items, vectors, norms)}

    @staticmethod
    def _classify(items: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, torch.Tensor]:
        probs = classification_activation(logits).cpu()
        logits = logits.cpu()
        return {item.request.request_id: logits[i] if item.request.pooling_params.activation is False else probs[i]
                for i, item in enumerate(items)}
