"""How many draft tokens each request may propose next step (the policy is documented on SpeculativeConfig)."""
from __future__ import annotations

from pagedserve.config import SpeculativeConfig
from pagedserve.core.request import Request


class DraftBudget:
    """Per-request draft lengths: start at num_speculative_tokens, then accepted + 1 after each verification, so
    speculation follows each request's own acceptance; zero for requests it cannot serve exactly or cheaply."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._next_len: dict[str, int] = {}

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self._next_len[request_id] = min(self.config.num_speculative_tokens, num_accepted + 1)

    def forget(self, request_id: str) -> None:
        self._next_len.pop(request_id, None)

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
        return max(0, min(self._next_len.get(request.request_id, self.config.num_speculative_tokens), remaining - 1))
