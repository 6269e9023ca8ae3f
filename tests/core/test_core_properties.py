"""Property-based tests of the core (block pool + KV cache manager + scheduler) with a simulated model.

Hypothesis draws whole workloads: arrivals between steps, prompt lengths with shared prefixes, max_tokens,
block sizes, budgets, max_num_seqs, pool sizes (always enough for the largest single request), caching
on/off, both hash algorithms, fcfs/priority, chunked prefill on/off, prefill thresholds, aborts and speculative
decoding (random drafts with random accept/reject patterns, with and without a draft model's lookahead slots).
Every step is checked for the scheduler's limits and the block accounting; a simulated KV store checks
that every token a request attends to holds exactly what that request wrote (or would have written), so
prefix-cache hits and block reuse are checked for content, not only for counts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.kv_events import KVEventCollector, block_state
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.sampling_params import SamplingParams

EOS = 2
VOCAB = range(3, 9)  # tiny vocabulary: generated continuations often repeat, which exercises the cache


@dataclass
class ReqSpec:
    prompt: list[int]
    max_tokens: int
    arrival_step: int
    priority: int
    cache_salt: str | None
    eos_prob: float
    ignore_eos: bool
    min_tokens: int


@dataclass
class Scenario:
    block_size: int
    num_blocks: int
    enable_caching: bool
    hash_algo: str
    config: SchedulerConfig
    requests: list[ReqSpec]
    aborts: list[tuple[int, int]] = field(default_factory=list)  # (step, request index)
    seed: int = 0
    num_speculative_tokens: int = 0  # 0: no drafts


@st.composite
def scenarios(draw) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 10))
    bases = [[1000 * (g + 1) + i for i in range(48)] for g in range(3)]
    specs = []
    for _ in range(n):
        group = draw(st.integers(0, len(bases) - 1))
        shared = draw(st.integers(0, 32))
        tail = draw(st.lists(st.sampled_from(list(VOCAB)), min_size=0 if shared else 1, max_size=12))
        max_tokens = draw(st.integers(1, 16))
        specs.append(ReqSpec(
            prompt=bases[group][:shared] + tail,
            max_tokens=max_tokens,
            arrival_step=draw(st.integers(0, 12)),
            priority=draw(st.integers(0, 3)),
            cache_salt=draw(st.sampled_from([None, None, "s"])),
            eos_prob=draw(st.sampled_from([0.0, 0.1, 0.3])),
            ignore_eos=draw(st.booleans()),
            min_tokens=draw(st.integers(0, max_tokens)),
        ))
    longest = max(len(s.prompt) + s.max_tokens for s in specs)
    max_model_len = longest + draw(st.integers(0, 8))
    min_blocks = max(cdiv(len(s.prompt) + s.max_tokens, block_size) for s in specs)
    num_blocks = min_blocks + draw(st.integers(0, 3 * min_blocks))
    chunked = draw(st.booleans())
    num_spec = draw(st.sampled_from([0, 0, 1, 3]))
    budget = draw(st.integers(1, 64))
    threshold = draw(st.sampled_from([0, 0, 1, 3, 8]))
    if not chunked:
        budget = max(budget, max_model_len)  # as LLMEngine does: a whole prompt must fit one step
        threshold = 0  # see test_scheduler.py::test_no_chunked_prefill_ignores_long_prefill_threshold
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        num_lookahead_tokens=num_spec if num_spec and draw(st.booleans()) else 0,
    )
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, n - 1)), max_size=3))
    return Scenario(block_size, num_blocks, draw(st.booleans()), draw(st.sampled_from(["sha256", "builtin"])),
                    config, specs, aborts, draw(st.integers(0, 2**16)), num_spec)


# ---------------------------------------------------------------------------- invariants
def check_schedule(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg, kv = sched.config, sched.kv
    assert out.num_scheduled_tokens == sum(i.num_new_tokens for i in out.scheduled)
    assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert len({i.request.request_id for i in out.scheduled}) == len(out.scheduled)
    for item in out.scheduled:
        r = item.request
        assert r.status == RequestStatus.RUNNING
        assert 1 <= item.num_new_tokens
        # drafts only after every known token, only the request's own, never past max_model_len
        assert r.num_computed_tokens + item.num_new_tokens == r.num_tokens + len(item.spec_token_ids) \
            if item.spec_token_ids else r.num_computed_tokens + item.num_new_tokens <= r.num_tokens
        assert item.spec_token_ids == r.spec_token_ids[:len(item.spec_token_ids)]
        assert r.num_computed_tokens + item.num_new_tokens <= cfg.max_model_len
        if cfg.long_prefill_token_threshold:
            assert item.num_new_tokens <= cfg.long_prefill_token_threshold
        if not cfg.enable_chunked_prefill:
            assert item.samples  # a whole (re)prefill or a decode, never a partial prompt
        assert item.block_ids == kv.block_ids(r.request_id)
        assert len(item.block_ids) * kv.block_size >= r.num_computed_tokens + item.num_new_tokens
    if cfg.policy == "fcfs" and out.preempted_request_ids:  # victims go back to the front, in their order
        k = len(out.preempted_request_ids)
        assert [r.request_id for r in list(sched.waiting)[:k]] == out.preempted_request_ids[::-1]
    assert not set(out.preempted_request_ids) & {i.request.request_id for i in out.scheduled}


def check_state(sched: Scheduler) -> None:
    kv, pool, cfg = sched.kv, sched.kv.block_pool, sched.config
    tables = kv.req_to_blocks
    # ref counts == table entries; no block twice in one table
    assert sum(b.ref_cnt for b in pool.blocks) == sum(len(t) for t in tables.values())
    for blocks in tables.values():
        assert len({b.block_id for b in blocks}) == len(blocks)
        assert all(b.ref_cnt >= 1 for b in blocks)
    # the free queue is exactly the ref-0 blocks
    queue = [b.block_id for b in pool.free_queue]
    assert len(queue) == len(set(queue)) == pool.num_free_blocks
    assert set(queue) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    # the hash map agrees with the blocks
    for h, b in pool.cached_blocks.items():
        assert b.block_hash == h
    if not kv.enable_caching:
        assert not pool.cached_blocks
    # queues, statuses, tables
    running_ids = [r.request_id for r in sched.running]
    waiting = list(sched.waiting)
    assert len(sched.running) <= cfg.max_num_seqs
    assert set(tables) == set(running_ids)
    assert set(sched.requests) == set(running_ids) | {r.request_id for r in waiting}
    assert len(sched.requests) == len(sched.running) + len(waiting)
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert len(tables[r.request_id]) * kv.block_size >= r.num_computed_tokens
        assert 0 <= r.num_computed_tokens < r.num_tokens  # at least the last token is still to compute
    for r in waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0
    if cfg.policy == "priority":
        keys = [(r.priority, r.arrival_time) for r in sched.running]
        assert keys == sorted(keys)


class SimulatedKV:
    """What the attention kernel would write and read: slot (block, offset) -> a key of the token prefix it encodes.

    The K/V at position p depends on tokens 0..p, so the key is a running hash over the request's tokens.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self._keys: dict[str, list[int]] = {}

    def keys(self, r: Request, upto: int, drafts: list[int]) -> list[int]:
        """Keys of positions 0..upto-1 of the request's tokens followed by this step's drafts (drafts' keys are
        not remembered: most are rejected)."""
        keys = self._keys.setdefault(r.request_id, [])
        while len(keys) < min(upto, r.num_tokens):
            keys.append(hash((keys[-1] if keys else None, r.all_token_ids[len(keys)])))
        keys = keys[:upto]
        for token in drafts[:upto - len(keys)]:
            keys.append(hash((keys[-1] if keys else None, token)))
        return keys

    def forward(self, out: SchedulerOutput) -> None:
        bs = self.block_size
        for item in out.scheduled:  # every layer writes all new K/V before any attention reads
            r = item.request
            end = r.num_computed_tokens + item.num_new_tokens
            keys = self.keys(r, end, item.spec_token_ids)
            for p in range(r.num_computed_tokens, end):
                self.slots[(item.block_ids[p // bs], p % bs)] = keys[p]
        for item in out.scheduled:
            r = item.request
            end = r.num_computed_tokens + item.num_new_tokens
            keys = self.keys(r, end, item.spec_token_ids)
            for p in range(end):
                assert self.slots.get((item.block_ids[p // bs], p % bs)) == keys[p], (
                    f"{r.request_id} reads wrong K/V at position {p} (block {item.block_ids[p // bs]})")


def check_events(events: KVEventCollector, registered: set, kv: KVCacheManager) -> None:
    """What the observer saw this step rebuilds the pool: block states, their counts, the cached hashes (a
    step evicts while scheduling, before it registers what its forward wrote)."""
    delta = events.take()
    pool = kv.block_pool
    assert events.states == [int(block_state(b)) for b in pool.blocks]
    assert sum(events.counts) == pool.num_blocks and events.counts[2] + events.counts[3] == pool.num_used_blocks
    registered.difference_update(delta.removed_hashes)
    registered.update(delta.stored_hashes)
    assert registered == set(pool.cached_blocks)


# ---------------------------------------------------------------------------- the driver
def run_scenario(scn: Scenario) -> Scheduler:
    kv = KVCacheManager(scn.num_blocks, scn.block_size, scn.enable_caching, scn.hash_algo)
    sched = Scheduler(scn.config, kv)
    store = SimulatedKV(scn.block_size)
    events = KVEventCollector(kv.block_pool.blocks)  # the engine-event observer, attached all along
    kv.block_pool.observer = events
    registered: set = set()  # the prefix cache as a router rebuilds it from BlockStored / BlockRemoved
    rng = random.Random(scn.seed)

    order = sorted(range(len(scn.requests)), key=lambda i: (scn.requests[i].arrival_step, i))
    requests: dict[int, Request] = {}
    for arrival_rank, i in enumerate(order):
        s = scn.requests[i]
        params = SamplingParams(max_tokens=s.max_tokens, min_tokens=s.min_tokens, ignore_eos=s.ignore_eos)
        requests[i] = Request(f"req{i}", s.prompt, params, s.max_tokens, frozenset({EOS}),
                              arrival_time=float(arrival_rank), priority=s.priority, cache_salt=s.cache_salt)
    pending = list(order)
    aborted: set[str] = set()
    total_tokens = sum(len(s.prompt) + s.max_tokens for s in scn.requests)
    max_steps = 50 * total_tokens + 50

    def sample(r: Request) -> int:
        return EOS if rng.random() < scn.requests[int(r.request_id[3:])].eos_prob else rng.choice(VOCAB)

    step = 0
    while pending or sched.has_unfinished_requests():
        assert step < max_steps, f"starvation: {sched.running=} {list(sched.waiting)=}"
        while pending and scn.requests[pending[0]].arrival_step <= step:
            sched.add_request(requests[pending.pop(0)])
        for abort_step, i in scn.aborts:
            if abort_step == step and i in requests and requests[i].request_id in sched.requests:
                r = requests[i]
                held_before = len(kv.block_ids(r.request_id))
                free_before = kv.num_free_blocks
                assert sched.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED) == [r]
                assert kv.block_ids(r.request_id) == []
                assert kv.num_free_blocks <= free_before + held_before
                aborted.add(r.request_id)
                check_state(sched)

        out = sched.schedule()
        check_schedule(sched, out)
        assert not aborted & {i.request.request_id for i in out.scheduled}
        known_before = {i.request.request_id: (i.request.num_computed_tokens, i.request.num_tokens)
                        for i in out.scheduled}
        store.forward(out)
        # a random accept/reject pattern: a prefix of the drafts is accepted, then the "model" samples one token
        sampled = {i.request.request_id: i.spec_token_ids[:rng.randint(0, len(i.spec_token_ids))] + [sample(i.request)]
                   for i in out.scheduled if i.samples}
        drafts = {r.request_id: [rng.choice(VOCAB) for _ in range(rng.randint(1, scn.num_speculative_tokens))]
                  for r in sched.running if scn.num_speculative_tokens and rng.random() < 0.7}
        progressed = sched.update_from_output(out, sampled, drafts)
        assert {r.request_id for r, _ in progressed} == set(sampled)
        for item in out.scheduled:
            r = item.request
            computed, num_tokens = known_before[r.request_id]
            tokens = sampled.get(r.request_id, [])
            num_rejected = len(item.spec_token_ids) - (len(tokens) - 1) if item.spec_token_ids else 0
            if not r.is_finished:  # (a request that stopped inside its accepted drafts is freed as it is)
                assert r.num_computed_tokens == computed + item.num_new_tokens - num_rejected
                assert r.num_tokens == num_tokens + len(tokens)
                assert r.num_computed_tokens <= r.num_tokens
                assert r.spec_token_ids == drafts.get(r.request_id, [])
            else:
                assert r.num_tokens <= num_tokens + len(tokens)
        check_state(sched)
        check_events(events, registered, kv)
        step += 1

    # everything finished; every block is back, unreferenced, in the free queue
    assert not sched.running and len(sched.waiting) == 0 and not sched.requests
    assert kv.req_to_blocks == {}
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.block_pool.num_free_blocks == scn.num_blocks
    assert {b.block_id for b in kv.block_pool.free_queue} == set(range(scn.num_blocks))
    for i, r in requests.items():
        s = scn.requests[i]
        assert r.is_finished
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            continue
        out_ids = r.output_token_ids
        assert 1 <= len(out_ids) <= s.max_tokens
        if r.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert len(out_ids) == s.max_tokens
        else:
            assert r.status == RequestStatus.FINISHED_STOPPED
            assert out_ids[-1] == EOS and not s.ignore_eos and len(out_ids) >= s.min_tokens
        # no EOS before the stop (except ignored ones or ones under min_tokens)
        if not s.ignore_eos:
            assert all(t != EOS for t in out_ids[s.min_tokens:-1])
    if not scn.enable_caching:
        assert kv.prefix_cache_hits == 0
    assert kv.prefix_cache_hits <= kv.prefix_cache_queries
    spec = sched.spec_stats
    assert spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
    return sched


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_keep_invariants(scn: Scenario) -> None:
    run_scenario(scn)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_tight_pool_random_workloads(scn: Scenario) -> None:
    """The smallest legal pool (the largest single request exactly fits): maximal preemption pressure."""
    scn.num_blocks = max(cdiv(len(s.prompt) + s.max_tokens, scn.block_size) for s in scn.requests)
    run_scenario(scn)


def test_fcfs_preemption_storm_is_deterministic_and_finishes():
    """A fixed heavy case: many equal requests, a pool for ~2 of them, tiny budget."""
    specs = [ReqSpec([1000 + i for i in range(10)], 12, 0, 0, None, 0.0, True, 0) for _ in range(8)]
    scn = Scenario(block_size=2, num_blocks=11, enable_caching=True, hash_algo="builtin",
                   config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=5, max_model_len=64),
                   requests=specs)
    run_scenario(scn)


def test_speculative_drafts_under_preemption_and_prefix_sharing():
    """A fixed case: shared prompts, a pool for ~2 requests, drafts every step with lookahead slots."""
    specs = [ReqSpec([1000 + i for i in range(9)] + [3 + i % 3], 14, i // 2, 0, None, 0.1, False, 0)
             for i in range(8)]
    scn = Scenario(block_size=2, num_blocks=14, enable_caching=True, hash_algo="builtin",
                   config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=7, max_model_len=64,
                                          num_lookahead_tokens=3),
                   requests=specs, seed=7, num_speculative_tokens=3)
    sched = run_scenario(scn)
    assert sched.spec_stats.num_drafts > 10 and 0 < sched.spec_stats.num_accepted_tokens
    assert sched.num_preemptions > 0 and sched.kv.prefix_cache_hits > 0
