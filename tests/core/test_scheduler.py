"""Unit tests of the scheduler with a simulated model (no torch): schedule -> fake sample -> update_from_output."""
from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.sampling_params import SamplingParams

EOS = 2
_arrivals = itertools.count(1)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, enable_caching: bool = True,
                   hash_algo: str = "sha256", **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size, enable_caching, hash_algo))


def make_request(request_id: str, prompt: int | list[int] = 8, max_tokens: int = 4, *, priority: int = 0,
                 arrival_time: float | None = None, min_tokens: int = 0, ignore_eos: bool = False,
                 stop_token_ids: list[int] | None = None, eos_token_ids=frozenset({EOS}),
                 cache_salt: str | None = None) -> Request:
    """`prompt` is a token list or a length (then distinct tokens derived from the id, so no prefix hits)."""
    if isinstance(prompt, int):
        base = 10_000 * (zlib.crc32(request_id.encode()) % 10_000 + 1)
        prompt = [base + i for i in range(prompt)]
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=stop_token_ids)
    return Request(request_id, prompt, params, max_tokens, frozenset(eos_token_ids),
                   arrival_time=float(next(_arrivals)) if arrival_time is None else arrival_time,
                   priority=priority, cache_salt=cache_salt)


TokenFn = Callable[[Request], int]


def default_token(request: Request) -> int:
    return 100 + request.num_output_tokens  # never EOS (2)


def step(sched: Scheduler, token_fn: TokenFn = default_token) -> SchedulerOutput:
    out = sched.schedule()
    check_step(sched, out)
    sampled = {item.request.request_id: [token_fn(item.request)] for item in out.scheduled if item.samples}
    sched.update_from_output(out, sampled)
    return out


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert out.num_scheduled_tokens == sum(item.num_new_tokens for item in out.scheduled)
    assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert len({item.request.request_id for item in out.scheduled}) == len(out.scheduled)
    for item in out.scheduled:
        assert item.num_new_tokens >= 1
        r = item.request
        assert r.num_computed_tokens + item.num_new_tokens <= r.num_tokens
        needed = -(-(r.num_computed_tokens + item.num_new_tokens) // sched.kv.block_size)
        assert len(item.block_ids) >= needed


def run_until_done(sched: Scheduler, token_fn: TokenFn = default_token, max_steps: int = 2_000,
                   on_step: Callable[[int, SchedulerOutput], None] | None = None) -> list[str]:
    """Step until nothing is left; returns request ids in finishing order."""
    finished: list[str] = []
    for i in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        before = dict(sched.requests)
        out = step(sched, token_fn)
        finished += [rid for rid, r in before.items() if r.is_finished]
        if on_step:
            on_step(i, out)
    raise AssertionError(f"not done after {max_steps} steps: {sched.running=} {list(sched.waiting)=}")


def scheduled_ids(out: SchedulerOutput) -> list[str]:
    return [item.request.request_id for item in out.scheduled]


def chunk_sizes(out: SchedulerOutput) -> dict[str, int]:
    return {item.request.request_id: item.num_new_tokens for item in out.scheduled}


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks
    assert sched.kv.req_to_blocks == {}


# ---------------------------------------------------------------------------- basics
def test_single_request_lifecycle():
    sched = make_scheduler()
    r = make_request("a", 6, max_tokens=3)
    sched.add_request(r)
    assert sched.num_waiting == 1 and sched.has_unfinished_requests()
    out = step(sched)
    assert chunk_sizes(out) == {"a": 6}
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 6
    assert r.output_token_ids == [100] and r.num_cached_tokens == 0 and r.first_scheduled_time is not None
    out = step(sched)
    assert chunk_sizes(out) == {"a": 1}  # decode
    out = step(sched)
    assert r.output_token_ids == [100, 101, 102]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.status.finish_reason == "length"
    assert not sched.has_unfinished_requests() and "a" not in sched.requests
    assert sched.schedule().finished_request_ids == ["a"]
    assert sched.schedule().finished_request_ids == []  # reported once
    assert_all_blocks_free(sched)


def test_empty_schedule():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.num_scheduled_tokens == 0


def test_budget_and_max_num_seqs_never_exceeded():
    sched = make_scheduler(num_blocks=200, max_num_batched_tokens=16, max_num_seqs=3)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 5 + 3 * i, max_tokens=6))
    seen = []
    run_until_done(sched, on_step=lambda i, out: seen.append((out.num_scheduled_tokens, len(out.scheduled))))
    assert max(t for t, _ in seen) == 16  # budget is used fully at some point
    assert max(n for _, n in seen) == 3
    assert_all_blocks_free(sched)


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=3))
    out = step(sched)
    assert scheduled_ids(out) == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_running_requests_are_scheduled_before_waiting():
    sched = make_scheduler(max_num_batched_tokens=10)
    a = make_request("a", 4, max_tokens=10)
    sched.add_request(a)
    step(sched)
    sched.add_request(make_request("b", 30, max_tokens=2))
    out = step(sched)
    assert scheduled_ids(out) == ["a", "b"]
    assert chunk_sizes(out) == {"a": 1, "b": 9}  # a's decode first, b gets what is left


def test_budget_exhausted_by_running_leaves_waiting_waiting():
    sched = make_scheduler(max_num_batched_tokens=2)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, 1, max_tokens=5))
    step(sched)
    sched.add_request(make_request("c", 4))
    for _ in range(3):
        out = step(sched)
        assert scheduled_ids(out) == ["a", "b"]
    assert sched.requests["c"].status == RequestStatus.WAITING


def test_one_step_mixes_prefill_chunks_and_decodes():
    sched = make_scheduler(max_num_batched_tokens=12)
    sched.add_request(make_request("a", 3, max_tokens=10))
    sched.add_request(make_request("b", 3, max_tokens=10))
    step(sched)
    sched.add_request(make_request("c", 25, max_tokens=2))
    out = step(sched)
    assert chunk_sizes(out) == {"a": 1, "b": 1, "c": 10}
    assert [item.samples for item in out.scheduled] == [True, True, False]
    c = sched.requests["c"]
    assert c.num_computed_tokens == 10 and c.num_output_tokens == 0


def test_chunked_prefill_splits_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=8)
    r = make_request("a", 20, max_tokens=2)
    sched.add_request(r)
    sizes, samples = [], []
    for _ in range(3):
        out = step(sched)
        sizes.append(out.scheduled[0].num_new_tokens)
        samples.append(r.num_output_tokens)
    assert sizes == [8, 8, 4]
    assert samples == [0, 0, 1]  # only the last chunk samples
    assert r.num_computed_tokens == 20
    run_until_done(sched)
    assert r.num_output_tokens == 2


def test_long_prefill_token_threshold_caps_chunk():
    sched = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=3)
    sched.add_request(make_request("a", 10, max_tokens=1))
    sched.add_request(make_request("b", 5, max_tokens=1))
    out = step(sched)
    assert chunk_sizes(out) == {"a": 3, "b": 3}
    out = step(sched)
    assert chunk_sizes(out) == {"a": 3, "b": 2}
    out = step(sched)
    assert chunk_sizes(out) == {"a": 3}
    out = step(sched)
    assert chunk_sizes(out) == {"a": 1}
    assert not sched.has_unfinished_requests()


def test_no_chunked_prefill_never_splits_a_prompt():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 6, max_tokens=3))
    sched.add_request(make_request("b", 6, max_tokens=3))
    sched.add_request(make_request("c", 2, max_tokens=3))
    out = step(sched)
    assert chunk_sizes(out) == {"a": 6}  # b does not fit the 4 left and is not split; c waits behind it
    out = step(sched)
    assert chunk_sizes(out) == {"a": 1, "b": 6, "c": 2}

    def check(_, out):
        for item in out.scheduled:
            assert item.samples  # every chunk is a whole prompt or a decode

    run_until_done(sched, on_step=check)


def test_no_chunked_prefill_ignores_long_prefill_threshold():
    """enable_chunked_prefill=False must never split a prompt, whatever long_prefill_token_threshold says
    (regression test: the threshold used to be applied before the no-chunking check)."""
    sched = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False, long_prefill_token_threshold=4)
    sched.add_request(make_request("a", 10, max_tokens=2))
    out = step(sched)
    assert chunk_sizes(out) == {"a": 10}


# ---------------------------------------------------------------------------- preemption (FCFS)
def test_preemption_fcfs_takes_most_recent_and_requeues_at_front():
    # 4 blocks of 4: a and b (4-token prompts) take 1 block each, then grow to 2 each; a's 9th token preempts b
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a = make_request("a", 4, max_tokens=8)
    b = make_request("b", 4, max_tokens=8)
    c = make_request("c", 4, max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)
    preempting = None
    for _ in range(10):
        b_blocks = sched.kv.block_ids("b")
        out = step(sched)
        if out.preempted_request_ids:
            preempting = out
            break
    assert preempting is not None
    assert preempting.preempted_request_ids == ["b"]
    assert scheduled_ids(preempting) == ["a"]  # nothing admitted in a step that had to preempt
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.kv.block_ids("b") == []
    a_blocks = sched.kv.block_ids("a")
    assert len(a_blocks) == 3  # a got its third block from what b released
    assert all(sched.kv.block_pool.blocks[i].ref_cnt == 0 for i in b_blocks if i not in a_blocks)
    assert sched.kv.num_free_blocks == 1
    assert list(sched.waiting) == [b, c]  # front of the queue, ahead of the earlier-waiting c
    assert sched.running == [a]
    b_outputs = list(b.output_token_ids)
    order = run_until_done(sched)
    assert set(order) == {"a", "b", "c"}
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8 and c.num_output_tokens == 2
    assert b.output_token_ids[:len(b_outputs)] == b_outputs  # outputs survive preemption
    assert_all_blocks_free(sched)


def test_several_preemptions_in_one_step_keep_queue_order():
    # 4 blocks of 4; step 1 fills the pool (a: 8-token chunk, b and c: 1 token each); a's next 7-token chunk
    # needs 2 more blocks: c (the latest) and then b are preempted; the waiting queue keeps them in order b, c
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=10, long_prefill_token_threshold=8)
    a = make_request("a", 15, max_tokens=1)
    b = make_request("b", 1, max_tokens=5)
    c = make_request("c", 1, max_tokens=5)
    for r in (a, b, c):
        sched.add_request(r)
    out = step(sched)
    assert chunk_sizes(out) == {"a": 8, "b": 1, "c": 1} and sched.kv.num_free_blocks == 0
    sched.add_request(make_request("d", 1, max_tokens=1))
    out = step(sched)
    assert out.preempted_request_ids == ["c", "b"]
    assert chunk_sizes(out) == {"a": 7}
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d"]
    assert a.is_finished
    assert sorted(run_until_done(sched)) == ["b", "c", "d"]
    assert b.num_output_tokens == 5 and c.num_output_tokens == 5
    assert_all_blocks_free(sched)


def test_preempted_request_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, enable_caching=False)
    a = make_request("a", 4, max_tokens=8)
    b = make_request("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    while not b.num_preemptions:
        step(sched)
    known = b.num_tokens
    # b waits until a frees room, then recomputes all its known tokens (prompt + outputs) in one chunk
    while b.status != RequestStatus.RUNNING:
        out = step(sched)
    assert chunk_sizes(out)["b"] == known
    assert b.num_output_tokens == known - 4 + 1


def test_pool_never_overcommitted_under_pressure():
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=8)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=7))
    run_until_done(sched)
    assert sched.num_preemptions > 0
    assert_all_blocks_free(sched)


# ---------------------------------------------------------------------------- priority
def test_priority_order_lower_value_first_ties_by_arrival():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    for rid, prio, t in [("p2", 2, 1.0), ("p0-late", 0, 4.0), ("p1", 1, 3.0), ("p0-early", 0, 2.0)]:
        sched.add_request(make_request(rid, 4, max_tokens=2, priority=prio, arrival_time=t))
    assert [r.request_id for r in sched.waiting] == ["p0-early", "p0-late", "p1", "p2"]
    assert run_until_done(sched) == ["p0-early", "p0-late", "p1", "p2"]


def test_priority_running_list_kept_in_policy_order():
    sched = make_scheduler(policy="priority")
    for rid, prio, t in [("low", 5, 1.0), ("high", 0, 2.0), ("mid", 3, 3.0)]:
        sched.add_request(make_request(rid, 4, max_tokens=5, priority=prio, arrival_time=t))
    out = step(sched)
    assert scheduled_ids(out) == ["high", "mid", "low"]
    assert [r.request_id for r in sched.running] == ["high", "mid", "low"]


def test_priority_preempts_lowest_priority_under_pressure():
    # the earlier arrival has the lower priority: FCFS would preempt "high", priority must preempt "low"
    sched = make_scheduler(num_blocks=4, block_size=4, policy="priority")
    low = make_request("low", 4, max_tokens=8, priority=1, arrival_time=1.0)
    high = make_request("high", 4, max_tokens=8, priority=0, arrival_time=2.0)
    sched.add_request(low)
    sched.add_request(high)
    preempted = []
    run_until_done(sched, on_step=lambda i, out: preempted.extend(out.preempted_request_ids))
    assert preempted and set(preempted) == {"low"}
    assert high.num_preemptions == 0
    assert low.num_output_tokens == 8 and high.num_output_tokens == 8


def test_fcfs_preempts_latest_arrival_under_same_pressure():
    sched = make_scheduler(num_blocks=4, block_size=4, policy="fcfs")
    first = make_request("first", 4, max_tokens=8)
    second = make_request("second", 4, max_tokens=8)
    sched.add_request(first)
    sched.add_request(second)
    preempted = []
    run_until_done(sched, on_step=lambda i, out: preempted.extend(out.preempted_request_ids))
    assert preempted and set(preempted) == {"second"}


def test_high_priority_overtakes_when_pool_fits_one_request():
    sched = make_scheduler(num_blocks=4, block_size=4, policy="priority")  # 16 slots: one 8+8 request
    low = make_request("low", 8, max_tokens=8, priority=5, arrival_time=1.0)
    sched.add_request(low)
    step(sched)
    step(sched)
    assert low.status == RequestStatus.RUNNING and low.num_output_tokens == 2
    high = make_request("high", 8, max_tokens=8, priority=0, arrival_time=2.0)
    sched.add_request(high)
    order = run_until_done(sched)
    assert order == ["high", "low"]
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert low.num_output_tokens == 8 and high.num_output_tokens == 8
    assert_all_blocks_free(sched)


def test_low_priority_arrival_does_not_preempt():
    sched = make_scheduler(num_blocks=4, block_size=4, policy="priority")
    high = make_request("high", 8, max_tokens=8, priority=0, arrival_time=1.0)
    sched.add_request(high)
    step(sched)
    sched.add_request(make_request("low", 8, max_tokens=8, priority=5, arrival_time=2.0))
    assert run_until_done(sched) == ["high", "low"]
    assert high.num_preemptions == 0


# ---------------------------------------------------------------------------- abort / finish
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_waiting_and_running(policy):
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1, policy=policy)
    run = make_request("run", 6, max_tokens=10)
    wait = make_request("wait", 6, max_tokens=10)
    keep = make_request("keep", 6, max_tokens=3)
    for r in (run, wait, keep):
        sched.add_request(r)
    step(sched)
    assert run.status == RequestStatus.RUNNING and wait.status == RequestStatus.WAITING
    free_before = sched.kv.num_free_blocks
    done = sched.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert done == [run, wait]
    assert run.status == RequestStatus.FINISHED_ABORTED and run.status.finish_reason == "abort"
    assert wait.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == free_before + 2  # run's blocks are free at once
    assert sched.kv.block_ids("run") == [] and sched.running == []
    assert list(sched.waiting) == [keep]
    assert sched.finish_requests(["run", "nope"], RequestStatus.FINISHED_ABORTED) == []  # idempotent
    first = sched.schedule()
    assert set(first.finished_request_ids) == {"run", "wait"}
    sched.update_from_output(first, {i.request.request_id: [100] for i in first.scheduled if i.samples})
    seen = set(scheduled_ids(first))
    run_until_done(sched, on_step=lambda i, out: seen.update(scheduled_ids(out)))
    assert seen == {"keep"}
    assert run.num_output_tokens == 1 and wait.num_output_tokens == 0
    assert_all_blocks_free(sched)


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b = make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    while not b.num_preemptions:
        step(sched)
    assert sched.finish_requests("b", RequestStatus.FINISHED_ABORTED) == [b]
    assert sched.num_waiting == 0
    assert run_until_done(sched) == ["a"]
    assert_all_blocks_free(sched)


def test_abort_while_step_runs_is_ignored_by_update():
    sched = make_scheduler()
    r = make_request("a", 6, max_tokens=4)
    sched.add_request(r)
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    progressed = sched.update_from_output(out, {"a": [100]})
    assert progressed == []
    assert r.num_output_tokens == 0 and r.num_computed_tokens == 0
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_finish_with_stop_status():
    sched = make_scheduler()
    r = make_request("a", 6, max_tokens=4)
    sched.add_request(r)
    step(sched)
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert r.status.finish_reason == "stop"
    assert_all_blocks_free(sched)


# ---------------------------------------------------------------------------- stop conditions
def run_one(request: Request, tokens: list[int], **config) -> Request:
    sched = make_scheduler(**config)
    sched.add_request(request)
    stream = iter(tokens)
    run_until_done(sched, token_fn=lambda r: next(stream))
    assert_all_blocks_free(sched)
    return request


def test_stops_at_max_tokens():
    r = run_one(make_request("a", 5, max_tokens=3), [7, 8, 9, 10, 11])
    assert r.output_token_ids == [7, 8, 9]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.stop_reason is None


def test_stops_at_max_model_len():
    r = run_one(make_request("a", 5, max_tokens=100), list(range(50, 80)), max_model_len=8)
    assert r.num_tokens == 8 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stops_at_eos():
    r = run_one(make_request("a", 5, max_tokens=10), [7, EOS, 9])
    assert r.output_token_ids == [7, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert r.status.finish_reason == "stop"


def test_ignore_eos():
    r = run_one(make_request("a", 5, max_tokens=4, ignore_eos=True), [EOS, EOS, 7, EOS, 9])
    assert r.output_token_ids == [EOS, EOS, 7, EOS]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_ids():
    r = run_one(make_request("a", 5, max_tokens=10, stop_token_ids=[42, 43]), [7, 8, 43, 9])
    assert r.output_token_ids == [7, 8, 43]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 43


def test_min_tokens_delays_eos_and_stop_tokens():
    r = run_one(make_request("a", 5, max_tokens=10, min_tokens=3, stop_token_ids=[42]), [EOS, 42, 7, EOS, 9])
    assert r.output_token_ids == [EOS, 42, 7, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED
    r = run_one(make_request("b", 5, max_tokens=10, min_tokens=2), [EOS, EOS, 9])
    assert r.output_token_ids == [EOS, EOS]


def test_max_tokens_one_finishes_after_prefill():
    sched = make_scheduler()
    r = make_request("a", 5, max_tokens=1)
    sched.add_request(r)
    out = sched.schedule()
    assert out.scheduled[0].samples  # (a live property: read it before update_from_output)
    sched.update_from_output(out, {"a": [100]})
    assert r.is_finished and r.output_token_ids == [100]


def test_update_from_output_returns_progressed_requests():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 4, max_tokens=5)
    b = make_request("b", 20, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sampled = {i.request.request_id: [100] for i in out.scheduled if i.samples}
    assert sampled.keys() == {"a"}  # b's first chunk does not reach the end of its prompt
    assert sched.update_from_output(out, sampled) == [(a, 1)]
    assert b.num_computed_tokens == 4 and b.num_output_tokens == 0


# ---------------------------------------------------------------------------- prefix caching through the scheduler
def test_scheduler_prefix_hit_sets_num_cached_tokens():
    sched = make_scheduler(block_size=4)
    prompt = list(range(1000, 1010))
    a = make_request("a", prompt, max_tokens=2)
    sched.add_request(a)
    run_until_done(sched)
    b = make_request("b", prompt, max_tokens=2)
    sched.add_request(b)
    out = step(sched)
    assert b.num_cached_tokens == 8
    assert chunk_sizes(out) == {"b": 2}
    run_until_done(sched)
    assert sched.kv.prefix_cache_hits == 8 and sched.kv.prefix_cache_queries == 20


def test_identical_prompts_arriving_together_share_blocks_once_written():
    """Blocks are registered only after the forward wrote them: a request whose next block another request is
    writing waits one step and then hits it, instead of computing it again."""
    sched = make_scheduler(block_size=4)
    prompt = list(range(1000, 1010))
    a, b = make_request("a", prompt, max_tokens=3), make_request("b", prompt, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert chunk_sizes(out) == {"a": 10}
    assert sched.kv.get_computed_blocks(b).num_tokens == 8
    out = step(sched)
    assert chunk_sizes(out) == {"a": 1, "b": 2}
    assert b.num_cached_tokens == 8 and not sched.kv.pending_hashes


def test_a_failed_writer_leaves_no_pending_block_behind():
    sched = make_scheduler(block_size=4)
    prompt = list(range(1000, 1010))
    a, b = make_request("a", prompt), make_request("b", prompt)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()  # a's forward "fails": it is finished without update_from_output
    assert chunk_sizes(out) == {"a": 10} and sched.kv.pending_hashes
    sched.finish_requests("a", RequestStatus.FINISHED_ERROR)
    assert not sched.kv.pending_hashes and not sched.kv.block_pool.cached_blocks
    out = step(sched)
    assert chunk_sizes(out) == {"b": 10}  # nothing to wait for, nothing unwritten to hit


def test_sibling_samples_wait_for_the_leader_prompt_then_share_it():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=6)
    prompt = list(range(1000, 1010))
    leader = make_request("r#0", prompt, max_tokens=4)
    sibling = make_request("r#1", prompt, max_tokens=2)
    sched.add_request(leader)
    sched.add_request(sibling)
    out = step(sched)
    assert chunk_sizes(out) == {"r#0": 6}  # the leader's first chunk; the sibling waits for the prompt
    out = step(sched)
    assert chunk_sizes(out) == {"r#0": 4}
    out = step(sched)
    assert chunk_sizes(out) == {"r#0": 1, "r#1": 2}  # prompt written: the sibling hits its 2 full blocks
    assert sibling.num_cached_tokens == 8
    assert sched.kv.block_ids("r#0")[:2] == sched.kv.block_ids("r#1")[:2]


def test_cache_salt_through_scheduler():
    sched = make_scheduler(block_size=4)
    prompt = list(range(1000, 1010))
    sched.add_request(make_request("a", prompt, max_tokens=1, cache_salt="x"))
    run_until_done(sched)
    b = make_request("b", prompt, max_tokens=1, cache_salt="y")
    c = make_request("c", prompt, max_tokens=1, cache_salt="x")
    sched.add_request(b)
    sched.add_request(c)
    run_until_done(sched)
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 8


def test_preempted_request_can_hit_its_own_blocks():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=2)
    a = make_request("a", 12, max_tokens=12)
    b = make_request("b", 12, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    while not b.num_preemptions:
        step(sched)
    queries_before, hits_before = sched.kv.prefix_cache_queries, sched.kv.prefix_cache_hits
    while b.status != RequestStatus.RUNNING:
        step(sched)
    assert sched.kv.prefix_cache_queries > queries_before
    assert sched.kv.prefix_cache_hits >= hits_before + 8  # its first blocks survived the preemption
    run_until_done(sched)
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert_all_blocks_free(sched)


def test_priority_victim_not_readmitted_in_same_step():
    """A request preempted for a higher-priority one must not be re-admitted in the very same step, and a
    higher-priority arrival whose first chunk fits the free blocks preempts nobody (regression test: the
    head's need used to be estimated as its whole prompt, and its victim was re-admitted at once)."""
    sched = make_scheduler(num_blocks=4, block_size=4, enable_caching=False, policy="priority",
                           max_num_batched_tokens=8, long_prefill_token_threshold=4)
    low = make_request("low", 4, max_tokens=8, priority=1, arrival_time=1.0)
    sched.add_request(low)
    step(sched)
    step(sched)
    assert sched.kv.block_ids("low") and sched.kv.num_free_blocks == 2
    sched.add_request(make_request("high", 12, max_tokens=2, priority=0, arrival_time=2.0))
    out = sched.schedule()
    assert "high" in scheduled_ids(out) and not out.preempted_request_ids
    assert not set(out.preempted_request_ids) & set(scheduled_ids(out)), (
        f"preempted {out.preempted_request_ids} and scheduled {scheduled_ids(out)} in the same step")


def test_drafts_that_do_not_fit_an_unchunked_budget_are_dropped_not_starved():
    sched = make_scheduler(max_num_batched_tokens=4, enable_chunked_prefill=False)
    a, b = make_request("a", 3, max_tokens=8), make_request("b", 3, max_tokens=8)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    step(sched)  # a decodes, b's 3-token prompt fills the rest of the budget
    a.spec_token_ids, b.spec_token_ids = [7, 7, 7], [7, 7]  # a: 4 tokens with its drafts, b: 3
    out = sched.schedule()
    scheduled = {i.request.request_id: (i.num_new_tokens, i.spec_token_ids) for i in out.scheduled}
    assert scheduled == {"a": (4, [7, 7, 7])}  # b's drafts would overflow the budget; b waits a step...
    sched.update_from_output(out, {"a": [7, 7, 7, 100]})
    b.spec_token_ids = [7, 7, 7, 7]
    a.spec_token_ids = []
    out = sched.schedule()
    # ...and when even its drafts alone cannot fit next to a's decode, it decodes without them
    assert {i.request.request_id: i.num_new_tokens for i in out.scheduled} == {"a": 1, "b": 1}


# ------------------------------------------------------------------ KV connector hooks (pure Python)
def test_external_kv_blocks_are_loaded_not_computed_and_evicted_blocks_are_saved():
    """The scheduler side of a KV connector, with the real host-memory store: blocks found outside the pool are
    allocated fresh, handed to the runner as kv_loads and counted as computed (outside the token budget), never
    the last token's block; with the evict policy a cached block leaves through kv_saves when the LRU reuses it."""
    from pagedserve.core.block_pool import BlockHash
    from pagedserve.kv_transfer.stores import LRUMemoryStore

    class Source:  # keys = block hashes; payloads = the hash itself, so the test can tell which block went where
        def __init__(self) -> None:
            self.store = LRUMemoryStore(1 << 20)

        def fetch(self, block_hashes: list[BlockHash]) -> list[bytes]:
            return self.store.get_prefix([h.hex() for h in block_hashes])

    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=24)
    source = sched.external_kv = Source()
    sched.kv.set_save_policy("evict")
    first = make_request("a", list(range(100, 113)), max_tokens=1)  # 13 tokens: 3 full blocks
    sched.add_request(first)
    sched.kv.get_computed_blocks(first)
    source.store.put([(h.hex(), h) for h in first.block_hashes[:2]])  # the store holds its first 2 blocks
    out = sched.schedule()
    ids = sched.kv.block_ids("a")
    assert [(b, p) for b, p in out.kv_loads] == [(ids[0], first.block_hashes[0]), (ids[1], first.block_hashes[1])]
    assert first.num_computed_tokens == 8 and out.scheduled[0].num_new_tokens == 5 and out.num_scheduled_tokens == 5
    assert first.num_cached_tokens == 8 and not out.kv_saves
    assert (sched.external_queried_tokens, sched.external_hit_tokens) == (12, 8)  # 3 loadable blocks, 2 found
    sched.update_from_output(out, {"a": [7]})  # finishes (max_tokens=1); its 3 full blocks stay cached
    assert sched.kv.block_pool.cached_blocks.keys() >= set(first.block_hashes[:3])
    # a request that needs the whole pool evicts them: their (block id, hash) leave through kv_saves
    second = make_request("b", 21, max_tokens=1)
    sched.add_request(second)
    evicted = sched.schedule().kv_saves
    assert {h for _, h in evicted} == set(first.block_hashes[:3])
    # never the last token: a prompt of exactly 2 full blocks loads 1 and computes 4 tokens
    third = make_request("c", list(range(100, 108)), max_tokens=1)
    sched2 = make_scheduler(num_blocks=6, block_size=4)
    sched2.external_kv = source
    sched2.add_request(third)
    out = sched2.schedule()
    assert len(out.kv_loads) == 1 and third.num_computed_tokens == 4 and out.num_scheduled_tokens == 4
