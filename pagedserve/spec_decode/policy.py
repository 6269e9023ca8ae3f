"""How many draft tokens each request may propose next step (the policy is documented on SpeculativeConfig)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.config import SpeculativeConfig
from pagedserve.core.request import Request

# What one more verified row costs, as a fraction of a batch-1 decode step: verifying 4 drafts took ~1.3 steps
# on the demo model, the weights being read once for all rows. Draft j (1-based) is worth proposing
# while its chance of being accepted, alpha^j, exceeds the row's cost. That cost grows with the batch: from this at
# batch 1 to a whole token's worth at disable_by_batch_size, where the step is compute-bound and drafts stop.
DRAFT_ROW_COST = 0.1
# Older verifications weigh less (by this factor per step), so a request that starts copying after free text,
# or stops, is judged on what it does now; a request proposing nothing drifts back to the prior and tries again.
ACCEPTANCE_DECAY = 0.9


@dataclass
class _Acceptance:
    """Decayed counts of one request's verifications: accepted drafts, and trials (an accepted draft or the
    first rejected one: each is a draw of the per-token acceptance probability)."""
    accepted: float = 0.0
    trials: float = 0.0

    def rate(self) -> float:
        return (self.accepted + 1.0) / (self.trials + 2.0)  # Laplace's rule: a few trials do not decide alone


class DraftBudget:
    """Per-request draft lengths from each request's own acceptance rate alpha: the largest k (at most
    num_speculative_tokens) with alpha^k > the cost of a verified row at this batch size, so drafts stop where they
    stop paying; zero for requests it cannot serve exactly or cheaply."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._acceptance: dict[str, _Acceptance] = {}

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        stats = self._acceptance.get(request_id)
        if stats is None:
            if not num_drafts:
                return
            stats = self._acceptance[request_id] = _Acceptance()
        stats.accepted = ACCEPTANCE_DECAY * stats.accepted + num_accepted
        stats.trials = ACCEPTANCE_DECAY * stats.trials + num_accepted + (num_accepted < num_drafts)

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)

    def row_cost(self, batch_size: int) -> float:
        """A verified row's cost relative to what the step yields per row, at this batch size."""
        saturation = max(self.config.disable_by_batch_size - 1, 1)
        return DRAFT_ROW_COST + (1.0 - DRAFT_ROW_COST) * (batch_size - 1) / saturation

    def draft_length(self, request_id: str, batch_size: int = 1) -> int:
        k = self.config.num_speculative_tokens
        threshold = self.row_cost(batch_size)
        if threshold >= 1.0:
            return 0
        stats = self._acceptance.get(request_id)
        alpha = stats.rate() if stats is not None else 1.0  # not verified yet: full length
        if alpha >= 1.0:
            return k
        return min(k, math.floor(math.log(threshold) / math.log(alpha)))

    def num_drafts(self, request: Request, num_new_tokens: int, batch_size: int, constrained: bool) -> int:
        """Drafts for `request` after it received `num_new_tokens` this step (not yet appended to it)."""
        if batch_size >= self.config.disable_by_batch_size or constrained:
            return 0
        params = request.sampling_params
        num_output = request.num_output_tokens + num_new_tokens
        # penalties and min_tokens bans depend on the tokens before each position: verify those one by one
        if params.needs_penalties or num_output < params.min_tokens:
            return 0
        remaining = min(request.max_tokens - num_output, self.max_model_len - request.num_tokens - num_new_tokens)
        # the last remaining token is the bonus token of the verification
        return max(0, min(self.draft_length(request.request_id, batch_size), remaining - 1))
