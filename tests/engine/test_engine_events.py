"""Engine events (pagedserve/engine/events.py) from real engine runs: what each step reports matches what the
scheduler and the block pool really did (preemption, prefix-cache hits, chunked prefill), block deltas replayed
over a snapshot give the real pool, the ring stays bounded, and nothing is recorded while nobody listens."""
from __future__ import annotations

import json

import pytest

from test_engine_boundary import prompt  # seeded random token ids

from pagedserve import SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.core.kv_events import block_state
from pagedserve.engine.events import EVENTS_VERSION, EventRing
from pagedserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def make_engine(tiny_model_dir):
    """LLMEngine on the tiny Llama: 64 blocks of 4 tokens unless told otherwise."""
    def make(**kwargs) -> LLMEngine:
        args = {"num_kv_blocks": 64, "max_model_len": 256, "block_size": 4, **kwargs}
        return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir("llama")), num_threads=1, **args))
    return make


def run(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = 6, max_steps: int = 500) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, tokens in prompts.items():
        engine.add_request(rid, tokens, params)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the engine did not drain")


def recorded(engine: LLMEngine, private: bool = False) -> list[dict]:
    return [json.loads(line) for _, _, line in engine.events.ring.since(0, private)[0]]


def listen(engine: LLMEngine, private: bool = False) -> None:
    engine.events.subscribe(private)


def apply_blocks(snapshot: dict, events: list[dict]) -> list[int]:
    """The pool as a reader rebuilds it: the snapshot's digits, then every later step's absolute states."""
    states = [int(c) for c in snapshot["blocks"]]
    for event in events:
        for block_id, state in event.get("blocks", ()):
            states[block_id] = state
    return states


def check_steps(engine: LLMEngine, events: list[dict]) -> list[dict]:
    steps = [e for e in events if e["type"] == "step"]
    assert steps and all(e["v"] == EVENTS_VERSION for e in events)
    assert [e["seq"] for e in events] == list(range(events[0]["seq"], events[0]["seq"] + len(events)))
    for e in steps:
        assert e["tokens"] <= e["budget"] == engine.scheduler.config.max_num_batched_tokens
        assert e["tokens"] == e["prefill_tokens"] + e["decode_tokens"]
        assert e["prefill_tokens"] == sum(p[1] for p in e["prefill"]) and e["decode_tokens"] == len(e["decode"])
        assert e["spec"] == []  # no speculative decoding here: one token per decode
        assert e["dur"] >= e["fwd"] > 0
        free, cached, in_use, shared = e["kv"]["states"]
        assert free + cached + in_use + shared == e["kv"]["total"] and in_use + shared == e["kv"]["used"]
    # the deltas, applied to the first snapshot, rebuild the real pool
    snapshot = next(e for e in events if e["type"] == "snapshot")
    later = [e for e in events if e["seq"] > snapshot["seq"]]
    assert apply_blocks(snapshot, later) == [int(block_state(b)) for b in engine.kv_cache_manager.block_pool.blocks]
    return steps


def test_nothing_is_recorded_while_nobody_listens(make_engine):
    engine = make_engine()
    run(engine, {"a": prompt(10, 0)})
    assert len(engine.events.ring) == 0 and engine.kv_cache_manager.block_pool.observer is None
    listen(engine)
    run(engine, {"b": prompt(10, 1)})
    assert len(engine.events.ring) > 0 and engine.kv_cache_manager.block_pool.observer is not None
    engine.events.unsubscribe()
    before = len(engine.events.ring)
    run(engine, {"c": prompt(10, 2)})
    assert engine.kv_cache_manager.block_pool.observer is None
    assert len(engine.events.ring) == before


def test_chunked_prefill_and_lifecycle(make_engine):
    """A 40-token prompt under a 16-token budget is computed in chunks while another request decodes."""
    engine = make_engine(max_num_batched_tokens=16)
    listen(engine)
    run(engine, {"short": prompt(5, 0)}, max_tokens=3)  # nothing in flight: a clean start
    run(engine, {"other": prompt(6, 2), "long": prompt(40, 1)}, max_tokens=8)
    events = recorded(engine)
    steps = check_steps(engine, events)
    chunks = [p for e in steps for p in e["prefill"] if p[0] == "long"]
    assert len(chunks) >= 3 and sum(c[1] for c in chunks) == 40 and all(c[3] == 40 for c in chunks)
    assert [c[2] for c in chunks] == [sum(c[1] for c in chunks[:i]) for i in range(len(chunks))]  # computed before
    mixed = [e for e in steps if any(p[0] == "long" for p in e["prefill"]) and "other" in e["decode"]]
    assert mixed, "a prefill chunk and a decode share a step"
    arrived = [a[0] for e in steps for a in e["arrived"]]
    admitted = [a[0] for e in steps for a in e["admitted"]]
    finished = {f[0]: f[1] for e in steps for f in e["finished"]}
    assert admitted == ["short", "other", "long"]
    assert arrived == ["other", "long"]  # "short" came before recording started: the first snapshot has it
    assert events[0]["type"] == "snapshot" and [r[:2] for r in events[0]["requests"]] == [["short", "waiting"]]
    assert finished == {"short": "length", "long": "length", "other": "length"}
    assert sum(e["kv"]["allocated"] for e in steps) == sum(e["kv"]["freed"] for e in steps)
    assert steps[-1]["kv"]["used"] == 0 and steps[-1]["running"] == steps[-1]["waiting"] == 0


def test_prefix_cache_hit_and_vllm_kv_events(make_engine):
    engine = make_engine()
    listen(engine, private=True)  # the full view (the admin key's): kv_events carry token ids
    shared = prompt(16, 3)
    run(engine, {"first": shared + [5, 6]})
    run(engine, {"second": shared + [7, 8, 9]})
    events = recorded(engine, private=True)
    redacted = recorded(engine)  # every other reader's: the same steps without prompt-derived data
    assert [e["seq"] for e in redacted] == [e["seq"] for e in events]
    assert all("kv_events" not in e for e in redacted) and not any(str(shared)[1:-1] in json.dumps(e) for e in redacted)
    steps = check_steps(engine, events)
    admitted = {a[0]: a[1] for e in steps for a in e["admitted"]}
    assert admitted == {"first": 0, "second": 16}  # four cached blocks of 4 tokens
    assert sum(e["kv"]["hit_blocks"] for e in steps) == 4
    stored = [k for e in steps for k in e["kv_events"] if k["type"] == "BlockStored"]
    assert set(stored[0]) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                              "medium"}
    pool = engine.kv_cache_manager.block_pool
    hashes = [h for k in stored for h in k["block_hashes"]]
    assert sorted(hashes) == sorted(h.hex() for h in pool.cached_blocks)  # every registered block, once
    first = stored[0]
    assert first["parent_block_hash"] is None and first["token_ids"][:16] == shared and first["block_size"] == 4
    for k in stored:  # token ids and parents chain as the hashes do
        assert len(k["token_ids"]) == 4 * len(k["block_hashes"])


def test_preemption_is_reported(make_engine):
    """8 requests of 30+20 tokens in 24 blocks of 4 tokens: running requests must give their KV away."""
    engine = make_engine(num_kv_blocks=24, max_num_batched_tokens=64, enable_prefix_caching=False)
    listen(engine)
    run(engine, {f"r{i}": prompt(30, 10 + i) for i in range(8)}, max_tokens=20, max_steps=2000)
    events = recorded(engine)
    steps = check_steps(engine, events)
    preempted = [rid for e in steps for rid in e["preempted"]]
    assert preempted and len(preempted) == engine.scheduler.num_preemptions
    again = [a[0] for e in steps for a in e["admitted"]]
    assert all(again.count(rid) >= 2 for rid in set(preempted))  # each victim was admitted again
    assert max(e["kv"]["used"] for e in steps) == 24
    assert sorted(f[0] for e in steps for f in e["finished"]) == sorted(f"r{i}" for i in range(8))


def test_abort_is_reported_at_once(make_engine):
    engine = make_engine()
    listen(engine)
    engine.add_request("gone", prompt(12, 4), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("gone")
    events = recorded(engine)
    assert events[-1]["type"] == "abort" and events[-1]["finished"] == [["gone", "abort"]]
    assert events[-1]["running"] == 0
    snapshot = next(e for e in events if e["type"] == "snapshot")
    assert apply_blocks(snapshot, events[1:]) == [int(block_state(b)) for b in engine.kv_cache_manager.block_pool.blocks]


def test_new_readers_share_one_snapshot_and_force_none(make_engine):
    """Readers arriving before the ring has a snapshot share one whole-pool snapshot (each used to build its own,
    O(blocks), on the event loop) and subscribing asks the engine thread for none (each used to force one)."""
    engine = make_engine()
    run(engine, {"warm": prompt(9, 2)})
    built = engine.events.num_snapshots_built
    for _ in range(5):
        listen(engine)
    shared = {engine.events.shared_snapshot() for _ in range(5)}
    assert len(shared) == 1 and engine.events.num_snapshots_built == built + 1
    engine.step()  # recording starts: one exact snapshot for the ring, not one per reader
    for _ in range(5):
        listen(engine)
    run(engine, {"more": prompt(9, 3)})
    snapshots = [e for e in recorded(engine) if e["type"] == "snapshot"]
    assert len(snapshots) == 1 and engine.events.num_snapshots_built == built + 2


def test_ring_is_bounded_and_reports_a_gap():
    ring = EventRing(capacity=3)
    for i in range(5):
        ring.append({"type": "snapshot" if i == 2 else "step", "i": i})
    assert len(ring) == 3 and ring.last_seq == 5
    items, missed = ring.since(0)
    assert [s for s, _, _ in items] == [3, 4, 5] and missed
    items, missed = ring.since(3)
    assert [s for s, _, _ in items] == [4, 5] and not missed
    assert ring.since(5) == ([], False)
    assert [s for s, _, _ in ring.from_oldest_snapshot()] == [3, 4, 5]
    with pytest.raises(ValueError):
        EventRing(0)


def test_trace_file_holds_the_steps(make_engine, tmp_path):
    path = tmp_path / "trace.jsonl"
    engine = make_engine(trace_file=str(path))
    run(engine, {"a": prompt(9, 5), "b": prompt(7, 6)})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["type"] == "snapshot" and lines[0]["config"]["cache"]["num_blocks"] == 64
    assert lines == recorded(engine)
    assert {f[0] for e in lines if e["type"] == "step" for f in e["finished"]} == {"a", "b"}
