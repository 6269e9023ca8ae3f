"""The server's per-step account (pagedserve/metrics/server_profile.py): what a streamed request adds to it, and how
GET /metrics exposes it (benchmarks/server_overhead.py reads it back). No timings are asserted: only that every
part moves."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.metrics.server_profile import COUNTS, SECONDS, ServerProfile, profile_from_metrics
from tests.entrypoints.test_server_async_llm import FakeEngine


def test_record_step_counts_the_time_between_busy_steps_only():
    p = ServerProfile()
    p.record_step(0.010, 0.008, 0.006, 0.001, end=1.000)
    p.record_step(0.010, 0.008, 0.006, 0.001, end=1.012)  # started at 1.002: 2 ms after the previous one ended
    p.idle()
    p.record_step(0.010, 0.008, 0.006, 0.001, end=5.000)  # after an idle wait: not time between steps
    assert p.steps == 3 and abs(p.between_steps - 0.002) < 1e-9
    assert abs(p.step - 0.030) < 1e-9 and abs(p.forward - 0.018) < 1e-9 and abs(p.output - 0.003) < 1e-9
    snap = p.snapshot()
    assert snap["engine_thread_cpu"] > 0 and snap["process_cpu"] > 0 and snap["loop_thread_cpu"] == 0.0
    assert p.engine_thread == threading.get_ident()


def test_streamed_request_moves_every_part_of_the_profile_on_metrics():
    llm = AsyncLLM(FakeEngine(), log_stats=False)
    app = build_app(llm, SimpleNamespace(api_key=None), shutdown_engine_on_exit=False)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            before = profile_from_metrics((await c.get("/metrics")).text)
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 5, "stream": True})
            assert r.status_code == 200
            return before, profile_from_metrics((await c.get("/metrics")).text)

    try:
        before, after = asyncio.run(run())
    finally:
        llm.shutdown()
    assert set(after) == {*SECONDS, *COUNTS}
    assert after["steps"] - before["steps"] >= 10  # 5 tokens each, one step per token
    assert after["deliveries"] > before["deliveries"]
    # up to one chunk per token (plus the chat's role chunk): a consumer that lags behind the 2 ms steps of a loaded
    # machine gets several tokens merged into one chunk
    assert after["chunks"] - before["chunks"] >= 2
    for part in ("step", "encode", "send", "deliver", "engine_thread_cpu", "loop_thread_cpu", "process_cpu"):
        assert after[part] > before[part], part
