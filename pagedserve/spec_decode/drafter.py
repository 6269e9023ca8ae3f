"""The runner's speculative-decoding side: after each step's sampling, decide how many drafts each request may
have (DraftBudget) and ask the proposer for them. Subclasses are the proposers; each gets a DrafterContext (what it
may know of the target), never the runner."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.config import SpeculativeConfig
from pagedserve.core.scheduler import ScheduledRequest
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.spec_decode.policy import DraftBudget

if TYPE_CHECKING:
    from pagedserve.model_executor.attention.backend import AttentionBackend
    from pagedserve.model_executor.quantization.base import QuantizationConfig


@dataclass(frozen=True)
class DrafterContext:
    """What a proposer knows of the target it drafts for: a draft model runs on the target's device, in its dtypes,
    on its block tables (same block size), with its linear method and attention backend."""
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int
    max_model_len: int
    vocab_size: int
    seed: int  # the draft model's sampling generator starts from the target's seed
    quant_config: "QuantizationConfig"
    attn_backend: "AttentionBackend"


class Drafter(ABC):
    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        self.config = config
        self.budget = DraftBudget(config, context.max_model_len)

    def propose(self, items: list[ScheduledRequest], sampled: dict[str, list[int]], batch_size: int,
                constrained: dict) -> dict[str, list[int]]:
        """Drafts for the next step of every request that sampled now (its new tokens are not yet appended)."""
        chosen: list[tuple[ScheduledRequest, list[int], int]] = []
        for item in items:
            request_id = item.request.request_id
            tokens = sampled.get(request_id)
            if not tokens:
                continue
            self.budget.observe(request_id, len(item.spec_token_ids), len(tokens) - 1)
            k = self.budget.num_drafts(item.request, len(tokens), batch_size, request_id in constrained)
            chosen.append((item, tokens, k))
        if not any(k for _, _, k in chosen):
            return {}
        drafts = self._propose(chosen)
        return {item.request.request_id: d for (item, _, _), d in zip(chosen, drafts) if d}

    @abstractmethod
    def _propose(self, chosen: list[tuple[ScheduledRequest, list[int], int]]) -> list[list[int]]:
        """(item, its new tokens, how many drafts at most) -> drafts, one list per entry."""

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        """The distributions the request's current drafts were drawn from ([k, V]); None: one-hot (deterministic)."""
        return None

    @property
    def kv_bytes_per_block(self) -> int:
        return 0  # a proposer with a KV cache of its own says how much it adds per block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def forget(self, finished_ids: list[str], preempted_ids: list[str]) -> None:
        for request_id in finished_ids:
            self.budget.forget(request_id)


class NgramDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def _propose(self, chosen: list[tuple[ScheduledRequest, list[int], int]]) -> list[list[int]]:
        return self.proposer.propose([item.request.all_token_ids + tokens for item, tokens, _ in chosen],
                                     [k for _, _, k in chosen])
