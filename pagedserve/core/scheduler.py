"""The iteration-level scheduler (vLLM V1 style).

Every step spends a token budget: running requests first (one decode token each, or the next chunk of an
unfinished prefill), then waiting requests in policy order while budget, seats and KV blocks allow. When a
running request cannot get a block, the last request of the running list is preempted (KV freed, tokens
recomputed later). The running list is kept in policy order, so "last" is the most recently admitted
(FCFS) or the lowest priority (priority policy), and it has not been scheduled yet this step.

Batches in flight (pipeline parallelism): the engine may schedule the next batch before an earlier one's tokens
are back (`hold_in_flight`). A request of a batch in flight is neither scheduled nor preempted until
update_from_output has applied that batch; one that needs a block only requests in flight could give waits.
With P batches to keep in flight, a batch takes at most 1/P of the unfinished requests, so that the next
batches have requests left to run (else a decode batch would take them all and the other stages would idle).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.core.block_pool import BlockHash
from pagedserve.core.kv_cache_manager import NO_HIT, KVCacheManager, PrefixHit, cdiv
from pagedserve.core.lora_slots import LoRASlots
from pagedserve.core.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a chunk is limited by the budget only
    policy: str = "fcfs"  # fcfs | priority
    # Slots allocated beyond the scheduled tokens: a draft model writes its KV for its proposals there.
    num_lookahead_tokens: int = 0
    max_loras: int = 0  # LoRA: at most this many distinct adapters among the running requests (0: LoRA off)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # includes the draft tokens below
    block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified in this step (after the known tokens)
    group_block_ids: list[list[int]] = field(default_factory=list)  # a hybrid model's other KV cache groups' tables

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so its last position yields a new token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens >= r.num_tokens


@dataclass
class SpecDecodingStats:
    """Counters of verified drafts since start-up (vLLM's spec_decode_* metrics)."""
    num_drafts: int = 0  # verifications of a request's drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def snapshot(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # requests finished or aborted since the previous step, so the runner can drop their state
    finished_request_ids: list[str] = field(default_factory=list)
    # KV connector: blocks evicted this step, (block id, hash), to save before the forward overwrites them; then
    # (block id, payload) of blocks loaded from outside the pool, to write before the forward reads them
    kv_saves: list[tuple[int, BlockHash]] = field(default_factory=list)
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)
    # LoRA: adapter id -> its slot in the runner's stacked weights, for every running request's adapter
    lora_slots: dict[int, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class ExternalKVSource(Protocol):
    """A KV connector's scheduler side (kv_transfer/connector.py)."""

    def fetch(self, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the leading blocks held outside the pool (possibly none)."""
        ...


class WaitingQueue:
    """FCFS: a deque (preempted requests return to the front). Priority: a heap on (priority, arrival)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self):
        return (e[3] for e in sorted(self._heap)) if self.policy == "priority" else iter(self._fifo)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()
        self.external_kv: ExternalKVSource | None = None
        # admitted requests' prompt tokens looked up outside the pool (past the pool's hit), of which loaded
        self.external_queried_tokens = 0
        self.external_hit_tokens = 0
        # ids of requests in a batch whose output is not applied yet (empty unless batches are pipelined)
        self.in_flight: set[str] = set()
        self.lora_slots = LoRASlots(config.max_loras) if config.max_loras else None

    # ----------------------------------------------------------------- queue management
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> list[Request]:
        """Finish (stop string) or abort requests wherever they are; their KV is freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        finished = []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self.in_flight.discard(request.request_id)  # its batch's output will skip it (finished)
            else:
                self.waiting.remove(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----------------------------------------------------------------- the step
    def hold_in_flight(self, out: SchedulerOutput) -> None:
        """The batch runs while the next ones are scheduled: its requests sit out until its output is applied."""
        self.in_flight.update(item.request.request_id for item in out.scheduled)

    def schedule(self, max_batches_in_flight: int = 1) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = cfg.max_num_batched_tokens
        # (with one batch at a time no request is left out: each is scheduled at most once)
        seats = cdiv(len(self.running) + len(self.waiting), max_batches_in_flight)
        if cfg.policy == "priority":
            self._preempt_for_higher_priority(out)

        # 1. Running requests, in order; a request that cannot get a block preempts the tail of the list.
        num_preempted_before = len(out.preempted_request_ids)
        index = 0
        in_flight = self.in_flight
        while index < len(self.running) and budget > 0 and len(out.scheduled) < seats:
            request = self.running[index]
            if in_flight and request.request_id in in_flight:  # its previous tokens are not back yet
                index += 1
                continue
            num_new = self._chunk_size(self._num_unscheduled(request), budget)
            if num_new <= 0 and request.spec_token_ids:  # (unchunked) its drafts do not fit: decode without them
                request.spec_token_ids = []
                num_new = self._chunk_size(self._num_unscheduled(request), budget)
            if num_new <= 0:  # unchunked prefill that does not fit the remaining budget
                index += 1
                continue
            while not self._allocate(request, num_new):
                if request.spec_token_ids:  # speculation never takes blocks from another request
                    request.spec_token_ids = []
                    num_new = self._chunk_size(self._num_unscheduled(request), budget)
                    continue
                victim = self._preemption_victim(index)
                if victim is None:  # only requests in flight hold blocks it could take: wait until they are back
                    index += 1
                    break
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                # drafts are scheduled after the known tokens; the budget may cut them short
                num_spec = request.num_computed_tokens + num_new - request.num_tokens
                out.scheduled.append(ScheduledRequest(request, num_new, self.kv.block_ids(request.request_id),
                                                      request.spec_token_ids[:max(num_spec, 0)],
                                                      self.kv.group_block_ids(request.request_id)))
                budget -= num_new
                index += 1

        # 2. Waiting requests, in policy order, while budget, seats and blocks allow. Not after the running
        #    requests had to preempt: the pool is short, and admitting would only cause more preemption.
        running_preempted = len(out.preempted_request_ids) > num_preempted_before
        preempted_now = set(out.preempted_request_ids)
        lora_slots = self.lora_slots
        active_loras = lora_slots.active_adapters(self.running) if lora_slots is not None else set()
        bypassed: list[Request] = []  # blocked by the LoRA adapter limit: back to the queue, in order, below
        while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs and not running_preempted \
                and len(out.scheduled) < seats:
            request = self.waiting.peek()
            if request.request_id in preempted_now:  # it just gave its KV away; all behind it rank lower
                break
            if lora_slots is not None and not lora_slots.admits(request, active_loras):
                if not lora_slots.may_bypass(request):
                    break
                bypassed.append(self.waiting.pop())
                continue
            hit = self.kv.get_computed_blocks(request)
            if self.kv.prefix_in_flight(request, hit):
                break  # its next block is being written by a running request: hit it next step instead
            loaded = self._fetch_external(request, hit)
            num_loaded = len(loaded) * self.kv.block_size  # loaded, not computed: outside the token budget
            num_new = self._chunk_size(request.num_tokens - hit.num_tokens - num_loaded, budget)
            if num_new <= 0:
                break
            if not self._allocate(request, num_loaded + num_new, hit):
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit.num_tokens + num_loaded
            if self.external_kv is not None:
                self._count_external(request, hit, num_loaded)
            if loaded:  # the blocks right after the hit were freshly allocated for them
                first = len(hit.blocks)
                out.kv_loads += zip(self.kv.block_ids(request.request_id)[first:first + len(loaded)], loaded)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            self._insert_running(request)
            out.scheduled.append(ScheduledRequest(request, num_new, self.kv.block_ids(request.request_id),
                                                  group_block_ids=self.kv.group_block_ids(request.request_id)))
            budget -= num_new
            if request.lora_request is not None:
                active_loras.add(request.lora_request.lora_int_id)
        for request in reversed(bypassed):
            self.waiting.add(request, front=True)
        if lora_slots is not None and active_loras:
            out.lora_slots = lora_slots.assign(active_loras)

        out.num_scheduled_tokens = cfg.max_num_batched_tokens - budget
        out.kv_saves = self.kv.take_blocks_to_save()
        return out

    def _num_loadable_blocks(self, request: Request) -> int:
        """Full blocks before the last token: that one is always computed (its logits give the next token)."""
        return (request.num_tokens - 1) // self.kv.block_size

    def _fetch_external(self, request: Request, hit: PrefixHit) -> list[bytes]:
        """Payloads of the blocks after the pool's hit that the KV connector holds."""
        num_full = self._num_loadable_blocks(request)
        if self.external_kv is None or len(hit.blocks) >= num_full \
                or request.sampling_params.prompt_logprobs is not None:  # it computes its whole prompt
            return []
        return self.external_kv.fetch(request.block_hashes[len(hit.blocks):num_full])

    def _count_external(self, request: Request, hit: PrefixHit, num_loaded: int) -> None:
        """At admission only: a request that waits for blocks asks again next step, and is counted once."""
        num_queried = max(self._num_loadable_blocks(request) - len(hit.blocks), 0) * self.kv.block_size
        self.external_queried_tokens += num_queried
        self.external_hit_tokens += num_loaded

    def _allocate(self, request: Request, num_new: int, hit: PrefixHit = NO_HIT) -> bool:
        """Slots for the step, plus a draft model's lookahead slots when the pool has them (the drafter proposes
        only as far as the request's blocks reach), never past max_model_len."""
        room = self.config.max_model_len - (request.num_computed_tokens + hit.num_tokens + num_new)
        lookahead = min(self.config.num_lookahead_tokens, max(room, 0))
        if lookahead and self.kv.allocate_slots(request, num_new, hit, lookahead) is not None:
            return True
        return self.kv.allocate_slots(request, num_new, hit) is not None

    def _num_unscheduled(self, request: Request) -> int:
        """Tokens the request would compute this step: the known ones not computed yet, then its drafts, up to
        max_model_len (a draft at the last position could not be followed by a bonus token anyway)."""
        num_known = request.num_tokens - request.num_computed_tokens
        if not request.spec_token_ids:
            return num_known
        room = self.config.max_model_len - request.num_tokens
        return num_known + min(len(request.spec_token_ids), max(room, 0))

    def _chunk_size(self, num_remaining: int, budget: int) -> int:
        cfg = self.config
        if not cfg.enable_chunked_prefill:  # all or nothing; the threshold only shapes chunks
            return num_remaining if num_remaining <= budget else 0
        if cfg.long_prefill_token_threshold:
            num_remaining = min(num_remaining, cfg.long_prefill_token_threshold)
        return min(num_remaining, budget)

    def _insert_running(self, request: Request) -> None:
        if self.config.policy == "priority":
            keys = [(r.priority, r.arrival_time) for r in self.running]
            self.running.insert(bisect.bisect_right(keys, (request.priority, request.arrival_time)), request)
        else:
            self.running.append(request)

    def _preemption_victim(self, index: int) -> Request | None:
        """The last running request from `index` on (those before it are scheduled already) that is not in flight:
        the request at `index` itself when there is no other; None rather than itself while batches are in
        flight, whose requests become preemptable (or finish) when their output is back."""
        if not self.in_flight:
            return self.running[-1]
        for victim in reversed(self.running[index + 1:]):
            if victim.request_id not in self.in_flight:
                return victim
        return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)
        out.preempted_request_ids.append(request.request_id)

    def _preempt_for_higher_priority(self, out: SchedulerOutput) -> None:
        """Under the priority policy a waiting request that outranks the lowest running one and cannot get
        its blocks takes them from it (before anything is scheduled this step)."""
        while len(self.waiting) and self.running:
            head = self.waiting.peek()
            lowest = next((r for r in reversed(self.running) if r.request_id not in self.in_flight), None)
            if lowest is None:  # requests in flight are not preempted
                return
            if (head.priority, head.arrival_time) >= (lowest.priority, lowest.arrival_time):
                return
            first_chunk = self._chunk_size(head.num_tokens, self.config.max_num_batched_tokens)
            needed = -(-first_chunk // self.kv.block_size) * self.kv.num_groups
            if needed <= self.kv.num_free_blocks and len(self.running) < self.config.max_num_seqs:
                return
            self._preempt(lowest, out)

    # ----------------------------------------------------------------- after the forward
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           spec_token_ids: dict[str, list[int]] | None = None) -> list[tuple[Request, int]]:
        """Advance progress by the scheduled tokens, append sampled tokens, finish stopped requests, and take the
        drafts proposed for the next step.

        sampled: per request, its new tokens: the accepted drafts, then one token sampled by the target model.
        Returns (request, number of tokens appended) for each request that received tokens this step.
        """
        progressed = []
        for item in out.scheduled:
            request = item.request
            if request.is_finished:  # aborted while the step ran
                continue
            if self.in_flight:
                self.in_flight.discard(request.request_id)
            tokens = sampled.get(request.request_id, ())
            # K/V of rejected drafts was written, but past num_computed_tokens nothing reads it: the next step
            # overwrites those slots, and no block holding one is registered in the prefix cache.
            num_rejected = len(item.spec_token_ids) - (len(tokens) - 1) if item.spec_token_ids else 0
            request.num_computed_tokens += item.num_new_tokens - num_rejected
            request.spec_token_ids = []
            if item.spec_token_ids and tokens:
                self.spec_stats.observe(len(item.spec_token_ids), len(tokens) - 1)
            num_appended = 0
            status = None
            for token in tokens:  # one at a time: a stop inside the accepted drafts ends the request right there
                request.append_output_token(token)
                num_appended += 1
                status = request.check_stop(self.config.max_model_len)
                if status is not None:
                    break
            # their K/V is written now (the rejected drafts' slots lie past num_computed_tokens)
            self.kv.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
            if num_appended:
                progressed.append((request, num_appended))
            if status is not None:
                self.running.remove(request)
                self._free(request, status)
            elif spec_token_ids and request.request_id in spec_token_ids:
                request.spec_token_ids = spec_token_ids[request.request_id]
        return progressed

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._finished_since_last_step.append(request.request_id)
        del self.requests[request.request_id]
