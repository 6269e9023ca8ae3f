"""A request as the scheduler sees it: token ids, progress and status. No tensors."""
from __future__ import annotations

import enum
import time

from pagedserve.lora.request import LoRARequest
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # KV freed; waits at the front of the queue to be recomputed
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the engine failed it (a step raised while it was scheduled)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence. A user request with n > 1 becomes n of these (sample_index 0..n-1)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        sample_index: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: params.max_tokens or what max_model_len leaves
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.sample_index = sample_index
        self.lora_request = lora_request
        self.lora_blocked_steps = 0  # steps it waited for a LoRA slot (core/lora_slots.py)
        # a pooling request (its sampling_params are the neutral defaults): prefill only, then pooled, no token
        self.pooling_params = pooling_params

        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens whose K/V are in this request's blocks (prefix hits included).
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.block_hashes: list[bytes | int] = []  # one per full block of all_token_ids
        # Draft tokens proposed after the last sample, verified (and mostly dropped) in the next step: never part
        # of all_token_ids, num_computed_tokens or a block hash until accepted.
        self.spec_token_ids: list[int] = []
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Stop conditions that need no text: EOS, stop token ids, lengths. Stop strings are the detokenizer's."""
        last = self.all_token_ids[-1]
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
