"""The stats the server takes after every step (LLMEngine.take_step_stats) leave out what only get_stats() readers
use: the walk over every KV block the running requests hold cost the server's engine thread 1-4 ms per step at 32
requests (issue 50), between two forwards."""
from __future__ import annotations

from pagedserve import LLM, SamplingParams


def test_per_step_stats_skip_the_kv_block_walk(model_dir, monkeypatch):
    llm = LLM(str(model_dir), num_threads=1, num_kv_blocks=64, max_model_len=256, dtype="float32")
    engine = llm.llm_engine
    engine.add_request("a", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    detail = engine.get_stats().scheduler
    assert detail.num_stored_tokens >= 37 and detail.num_allocated_slots >= detail.num_stored_tokens

    def walk(*_):
        raise AssertionError("the per-step stats walked the KV blocks")

    monkeypatch.setattr(engine.kv_cache_manager, "stored_and_allocated", walk)
    engine.step()
    stats = engine.take_step_stats()
    assert stats.scheduler.num_running_reqs == 1 and stats.scheduler.num_used_blocks > 0
    assert stats.iteration.num_generation_tokens == 1 and stats.itls
    engine.abort_request(["a"])
