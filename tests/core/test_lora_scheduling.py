"""Multi-LoRA in the scheduler (no torch): at most max_loras adapters among the running requests, slots reused LRU
among inactive adapters, fair admission (no adapter starves), and the adapter in the prefix-cache key."""
from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import make_request, make_scheduler, step

from pagedserve.core.lora_slots import LoRASlots
from pagedserve.lora.request import LoRARequest


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i, f"/adapters/{i}")


def with_lora(request, adapter: int | None):
    request.lora_request = lora(adapter) if adapter is not None else None
    return request


def running_adapters(sched) -> set[int]:
    return LoRASlots.active_adapters(sched.running)


def test_slots_lru_among_inactive():
    slots = LoRASlots(max_loras=2)
    assert slots.assign({1, 2}) == {1: 0, 2: 1}
    assert slots.assign({2}) == {2: 1}  # 1 stays in slot 0, inactive; 2 is now the most recently used
    assert slots.assign({2, 3}) == {2: 1, 3: 0}  # 3 evicts the inactive 1, not the running 2
    assert slots.assign({3, 1}) == {3: 0, 1: 1}  # 2 is inactive now: 1 takes its slot
    slots.remove(1)
    assert slots.assign({4}) == {4: 1}  # a removed adapter's slot is free: taken before evicting 3


def test_at_most_max_loras_adapters_running():
    sched = make_scheduler(max_loras=2, max_num_seqs=16)
    for i in range(12):
        sched.add_request(with_lora(make_request(f"r{i}", 8, max_tokens=3), i % 3 + 1))
    seen = set()
    while sched.has_unfinished_requests():
        out = step(sched)
        active = running_adapters(sched) | {item.request.lora_request.lora_int_id for item in out.scheduled}
        assert len(active) <= 2
        assert set(out.lora_slots) >= {item.request.lora_request.lora_int_id for item in out.scheduled
                                        if not item.request.is_finished}
        assert len(set(out.lora_slots.values())) == len(out.lora_slots)  # one adapter per slot
        assert all(0 <= s < 2 for s in out.lora_slots.values())
        seen |= {item.request.request_id for item in out.scheduled}
    assert seen == {f"r{i}" for i in range(12)}
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_base_requests_are_not_limited_by_adapters():
    sched = make_scheduler(max_loras=1)
    sched.add_request(with_lora(make_request("a", 8), 1))
    sched.add_request(with_lora(make_request("b", 8), 2))  # waits: one slot
    sched.add_request(make_request("base", 8))  # passes it: no adapter, no slot
    out = step(sched)
    assert [item.request.request_id for item in out.scheduled] == ["a", "base"]
    assert out.lora_slots == {1: 0}


def test_blocked_adapter_does_not_starve():
    """A steady stream of adapter-1 requests keeps adapter 1 running; an adapter-2 request (one slot) may be passed
    only for max_bypass_steps steps, then admission stops behind it until adapter 1 drains."""
    sched = make_scheduler(max_loras=1, max_num_seqs=8)
    sched.lora_slots.max_bypass_steps = 3
    sched.add_request(with_lora(make_request("first", 8, max_tokens=4), 1))
    step(sched)
    blocked = with_lora(make_request("blocked", 8, max_tokens=2), 2)
    sched.add_request(blocked)
    admitted_at = None
    for n in range(40):
        sched.add_request(with_lora(make_request(f"stream{n}", 8, max_tokens=4), 1))
        out = step(sched)
        if any(item.request is blocked for item in out.scheduled):
            admitted_at = n
            break
    assert admitted_at is not None and admitted_at <= 3 + 4 + 1  # bypass steps + the running ones' max_tokens
    assert out.lora_slots == {2: 0}


def test_adapter_is_part_of_the_block_hash():
    sched = make_scheduler(block_size=4)
    prompt = list(range(100, 117))
    hashes = []
    for rid, adapter in (("base", None), ("a1", 1), ("a1-again", 1), ("a2", 2)):
        request = with_lora(make_request(rid, prompt), adapter)
        sched.kv._update_block_hashes(request)
        hashes.append(request.block_hashes)
    base, a1, a1_again, a2 = hashes
    assert a1 == a1_again
    assert len({base[0], a1[0], a2[0]}) == 3 and len({base[-1], a1[-1], a2[-1]}) == 3
    moved = with_lora(make_request("moved", prompt), 1)
    moved.lora_request = dataclasses.replace(moved.lora_request, lora_path="/elsewhere")
    sched.kv._update_block_hashes(moved)
    assert moved.block_hashes[0] != a1[0]  # the same name from another directory is another adapter


def test_prefix_cache_never_shared_between_adapters():
    sched = make_scheduler(block_size=4, max_loras=2)
    prompt = list(range(100, 117))
    sched.add_request(with_lora(make_request("a1", prompt, max_tokens=1), 1))
    while sched.has_unfinished_requests():
        step(sched)
    for rid, adapter, expect_hit in (("a2", 2, 0), ("base", None, 0), ("a1-again", 1, 16)):
        request = with_lora(make_request(rid, prompt, max_tokens=1), adapter)
        sched.add_request(request)
        while sched.has_unfinished_requests():
            step(sched)
        assert request.num_cached_tokens == expect_hit, rid


@settings(max_examples=60, deadline=None)
@given(max_loras=st.integers(1, 3), budget=st.integers(4, 40), num_blocks=st.integers(12, 40),
       requests=st.lists(st.tuples(st.one_of(st.none(), st.integers(1, 5)), st.integers(1, 20), st.integers(1, 6),
                                   st.integers(0, 3)), min_size=1, max_size=14))
def test_lora_scheduling_invariants(max_loras, budget, num_blocks, requests):
    """Whatever arrives (adapters or none, arrival steps, lengths) and however tight the budget and the pool: at
    most max_loras adapters run, each in its own slot, every scheduled adapter has a slot, everyone finishes (no
    request left behind), and every block is back in the pool."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_loras=max_loras, max_num_batched_tokens=budget,
                           max_num_seqs=6)
    sched.lora_slots.max_bypass_steps = 2
    arrivals = sorted(((arrive, i, adapter, length, out) for i, (adapter, length, out, arrive)
                       in enumerate(requests)), key=lambda a: (a[0], a[1]))
    finished = set()
    for step_no in range(2000):
        while arrivals and arrivals[0][0] <= step_no:
            _, i, adapter, length, out = arrivals.pop(0)
            sched.add_request(with_lora(make_request(f"r{i}", length, max_tokens=out, ignore_eos=True), adapter))
        if not arrivals and not sched.has_unfinished_requests():
            break
        out = step(sched)
        active = running_adapters(sched)
        assert len(active) <= max_loras
        assert len(set(out.lora_slots.values())) == len(out.lora_slots)
        for item in out.scheduled:
            if item.request.lora_request is not None:
                assert item.request.lora_request.lora_int_id in out.lora_slots
        finished |= {item.request.request_id for item in out.scheduled if item.request.is_finished}
    assert not arrivals and not sched.has_unfinished_requests(), "requests left unfinished (starved?)"
    assert finished == {f"r{i}" for i in range(len(requests))}
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
