"""Pipeline parallelism with batches in flight (docs/PARALLEL.md): with pipeline_parallel_size=P the engine keeps up
to P scheduled batches in flight, and the scheduler leaves their requests out of the next batches.

Scheduler (no model): requests of a batch in flight are neither scheduled again nor preempted until that batch's
output is applied, a batch takes at most 1/P of the requests, an abort in flight frees at once, and random
workloads with 2 and 3 batches in flight keep every invariant of tests/core/test_core_properties.py (token budget,
block accounting, K/V content, every block back). Engine (pp=2, gloo, the tiny models): greedy tokens equal Hugging
Face's with two batches really in flight, an abort of a request in flight leaves the others' tokens and the pool
intact, and a stage killed with two batches in flight fails them clearly. (Chunked prefill, prefix caching,
preemption and n=2 seeded sampling with batches in flight: tests/model_executor/test_parallel.py's
test_engine_features_same_tokens_as_one_process.)
"""
from __future__ import annotations

import random
from collections import deque

import pytest
from hf_reference import assert_greedy_match, hf_greedy, mixed_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core_properties import EOS, VOCAB, Scenario, SimulatedKV, check_schedule, check_state, scenarios
from test_parallel import GREEDY, MAX_TOKENS, assert_drained, engine, generate
from test_scheduler import make_request, make_scheduler

from pagedserve import SamplingParams
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerOutput


@pytest.fixture(autouse=True)
def short_collective_timeout(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "60")


def ids(out: SchedulerOutput) -> list[str]:
    return [item.request.request_id for item in out.scheduled]


def start(sched: Scheduler, depth: int = 2) -> SchedulerOutput:
    out = sched.schedule(depth)
    sched.hold_in_flight(out)
    return out


def finish(sched: Scheduler, out: SchedulerOutput) -> None:
    sched.update_from_output(out, {rid: [100] for rid in ids(out)})


# ------------------------------------------------------------------------------------------- scheduler
def test_requests_in_flight_sit_out_until_their_output_is_back():
    sched = make_scheduler()
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=4))
    first = start(sched)
    assert ids(first) == ["r0", "r1"]  # half of the requests: the next batch gets the other half
    second = start(sched)
    assert ids(second) == ["r2", "r3"]
    assert sched.schedule(2).is_empty  # everything is in flight
    finish(sched, first)
    assert sched.in_flight == {"r2", "r3"}
    third = start(sched)
    assert ids(third) == ["r0", "r1"] and all(item.num_new_tokens == 1 for item in third.scheduled)
    # one batch at a time: no request is left out (the synchronous engine's schedule is unchanged)
    finish(sched, second), finish(sched, third)
    assert ids(sched.schedule()) == ["r0", "r1", "r2", "r3"]


def test_preemption_never_takes_blocks_from_a_request_in_flight():
    """Two requests fill the pool; the first needs a block while the second's batch runs: it waits (no victim
    in flight, and it does not give up its own KV), then preempts the second once that one's output is back."""
    sched = make_scheduler(num_blocks=4, block_size=4)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=4))
    first, second = start(sched), start(sched)
    assert (ids(first), ids(second)) == (["r0"], ["r1"]) and sched.kv.num_free_blocks == 0
    finish(sched, first)  # r0's 9th token needs a third block
    waited = start(sched)
    assert waited.is_empty and not waited.preempted_request_ids
    assert [r.request_id for r in sched.running] == ["r0", "r1"] and sched.num_preemptions == 0
    finish(sched, second)
    out = start(sched)
    assert out.preempted_request_ids == ["r1"] and ids(out) == ["r0"]


def test_priority_preemption_skips_requests_in_flight():
    sched = make_scheduler(num_blocks=2, block_size=4, policy="priority", max_num_batched_tokens=8)
    sched.add_request(make_request("low", 8, max_tokens=4, priority=5))
    in_flight = start(sched)
    sched.add_request(make_request("high", 8, max_tokens=4, priority=0))
    assert start(sched).is_empty and sched.num_preemptions == 0  # "low" is in flight: not a victim yet
    finish(sched, in_flight)
    out = start(sched)
    assert out.preempted_request_ids == ["low"] and ids(out) == ["high"]


def test_abort_in_flight_frees_at_once_and_its_output_is_ignored():
    sched = make_scheduler(num_blocks=8, block_size=4)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=2))
    first = start(sched)
    assert ids(first) == ["r0", "r1"]
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert sched.kv.block_ids("r0") == [] and "r0" not in sched.in_flight
    second = start(sched)  # may reuse r0's blocks: every stage runs the batches in order
    assert ids(second) == ["r2"]
    progressed = sched.update_from_output(first, {"r0": [100], "r1": [100]})
    assert [r.request_id for r, _ in progressed] == ["r1"]
    finish(sched, second)
    while sched.has_unfinished_requests():
        finish(sched, start(sched))
    assert sched.kv.block_pool.num_free_blocks == 8 and not sched.in_flight


def run_pipelined(scn: Scenario, depth: int) -> int:
    """test_core_properties' random workloads, with up to `depth` batches in flight: a batch's forward (simulated
    K/V writes and reads) runs when it starts, which is the order every pipeline stage sees; its tokens are
    sampled and applied when it is the oldest and the queue is full or nothing else can start."""
    kv = KVCacheManager(scn.num_blocks, scn.block_size, scn.enable_caching, scn.hash_algo)
    sched = Scheduler(scn.config, kv)
    store, rng = SimulatedKV(scn.block_size), random.Random(scn.seed)
    arrivals = sorted(range(len(scn.requests)), key=lambda i: (scn.requests[i].arrival_step, i))
    requests = {i: Request(f"req{i}", s.prompt, SamplingParams(max_tokens=s.max_tokens, min_tokens=s.min_tokens,
                                                                ignore_eos=s.ignore_eos),
                           s.max_tokens, frozenset({EOS}), arrival_time=float(rank), priority=s.priority,
                           cache_salt=s.cache_salt)
                for rank, i in enumerate(arrivals) for s in [scn.requests[i]]}
    queue: deque[SchedulerOutput] = deque()
    most_in_flight, step = 0, 0
    max_steps = 100 * sum(len(s.prompt) + s.max_tokens for s in scn.requests) + 100
    while arrivals or sched.has_unfinished_requests() or queue:
        assert step < max_steps, "starvation"
        while arrivals and scn.requests[arrivals[0]].arrival_step <= step:
            sched.add_request(requests[arrivals.pop(0)])
        for abort_step, i in scn.aborts:
            if abort_step == step and requests[i].request_id in sched.requests:
                sched.finish_requests(requests[i].request_id, RequestStatus.FINISHED_ABORTED)
                assert kv.block_ids(requests[i].request_id) == []
        started = False
        if len(queue) < depth:
            out = sched.schedule(depth)
            check_schedule(sched, out)
            in_flight = {rid for batch in queue for rid in ids(batch) if rid in sched.requests}
            assert not in_flight & (set(ids(out)) | set(out.preempted_request_ids)), "in flight twice/preempted"
            assert len(out.scheduled) <= cdiv(len(sched.running) + len(sched.waiting), depth)
            if not out.is_empty:
                sched.hold_in_flight(out)
                store.forward(out)
                queue.append(out)
                started = True
                most_in_flight = max(most_in_flight, len(queue))
        if queue and (len(queue) == depth or not started):
            out = queue.popleft()
            sampled = {i.request.request_id: [EOS if rng.random() < scn.requests[int(i.request.request_id[3:])]
                                              .eos_prob else rng.choice(VOCAB)]
                       for i in out.scheduled if i.samples}
            sched.update_from_output(out, sampled)
        check_state(sched)
        step += 1
    assert not sched.in_flight and kv.req_to_blocks == {}
    assert kv.block_pool.num_free_blocks == scn.num_blocks
    assert all(r.is_finished for r in requests.values())
    return most_in_flight


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([2, 3]), st.booleans())
def test_random_workloads_with_batches_in_flight_keep_invariants(scn: Scenario, depth: int, tight: bool) -> None:
    """Drafts are never scheduled with batches in flight (speculative decoding runs synchronously)."""
    scn.num_speculative_tokens = 0
    scn.config = type(scn.config)(**{**scn.config.__dict__, "num_lookahead_tokens": 0})
    if tight:  # the smallest legal pool: maximal preemption pressure
        scn.num_blocks = max(cdiv(len(s.prompt) + s.max_tokens, scn.block_size) for s in scn.requests)
    run_pipelined(scn, depth)


# ------------------------------------------------------------------------------------------- engine, pp=2
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_batches_in_flight_match_transformers(arch, tiny_model_dir, tiny_tokenizer):
    model_dir = tiny_model_dir(arch)
    prompts = mixed_prompts(tiny_tokenizer, n=12, lengths=(5, 80))
    with engine(model_dir, pipeline_parallel_size=2) as llm:
        assert llm.llm_engine.max_batches_in_flight == 2
        ours = generate(llm, prompts)
        assert llm.llm_engine.max_batches_in_flight_seen == 2
        assert_drained(llm)
    assert_greedy_match(ours, hf_greedy(model_dir, prompts, MAX_TOKENS))


def test_abort_of_a_request_in_flight(tiny_model_dir, tiny_tokenizer):
    """Seeded sampling (per-request generators on the driver): the others get one process's tokens, and the aborted
    request's generator, recreated by its batch's sampling after the abort, is dropped too."""
    model_dir = tiny_model_dir("llama")
    prompts = mixed_prompts(tiny_tokenizer, n=6, lengths=(5, 40))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    with engine(model_dir) as llm:
        expected = [list(o.token_ids) for o in generate(llm, prompts, params)]
    with engine(model_dir, pipeline_parallel_size=2) as llm:
        eng = llm.llm_engine
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, params)
        victim = None
        finished = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
            # between steps one batch is in flight (a step starts one, then finishes the oldest)
            running = eng._in_flight[0][0].scheduled if eng._in_flight else []
            decoding = [item.request.request_id for item in running if item.request.num_output_tokens > 2]
            if victim is None and decoding:
                victim = decoding[0]
                assert victim in eng.scheduler.in_flight
                eng.abort_request(victim)
        assert victim is not None
        assert victim not in finished or finished[victim].outputs[0].finish_reason == "abort"
        assert {rid: list(o.outputs[0].token_ids) for rid, o in finished.items() if rid != victim} == \
            {str(i): expected[i] for i in range(len(prompts)) if str(i) != victim}
        assert not eng.scheduler.in_flight and not eng._in_flight and victim not in eng.runner.generators
        assert_drained(llm)


def test_killed_stage_fails_every_batch_in_flight_clearly(tiny_model_dir, tiny_tokenizer):
    """Stage 1 dies while two batches are in flight: both fail with the error naming it (no hang), the engine is
    dead, and every block is back."""
    import os
    import signal

    prompts = mixed_prompts(tiny_tokenizer, n=8, lengths=(5, 40))
    with engine(tiny_model_dir("llama"), pipeline_parallel_size=2) as llm:
        eng = llm.llm_engine
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, GREEDY)
        while eng.max_batches_in_flight_seen < 2 or not eng._in_flight:
            eng.step()
        pid = eng.executor.worker_pids[1]
        os.kill(pid, signal.SIGKILL)
        outputs = []
        while eng.has_unfinished_requests():
            outputs += [o for o in eng.step() if o.finished]
        reason = f"rank 1 (pid {pid}) exited with code -9"
        assert {o.request_id for o in outputs} == {str(i) for i in range(len(prompts))}
        assert all(o.outputs[0].finish_reason == "error" and reason in o.error for o in outputs)
        assert reason in eng.dead_reason and not eng.scheduler.in_flight
        assert_drained(llm)
