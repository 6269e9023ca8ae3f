"""An engine step is one failure boundary, with the real engine behind the real app (issue 47, findings 3 and 4):
an exception anywhere in a step (scheduling, the KV connector, the forward, output processing) fails that step's
requests only, counts in engine_step_failures_total and in /health's failed-steps rule; a store error is a miss,
never a failed request; a step that hangs past --step-timeout-s makes /health 503 until it returns."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import metric_value
from test_kv_transfer import BLOCK, make_llm, tokens

from pagedserve.engine.async_llm import AsyncLLM, EngineRequestError
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.kv_transfer.stores import DirectoryStore
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def expected_tokens(model_dir, prompt: list[int]) -> list[int]:
    out = make_llm(model_dir).generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0]
    return out.outputs[0].token_ids


def serve(llm, **kwargs):
    """The real engine behind AsyncLLM and the app; an in-process HTTP client for /health and /metrics."""
    async_llm = AsyncLLM(llm.llm_engine, log_stats=False, **kwargs)
    app = build_app(async_llm, None, shutdown_engine_on_exit=False)
    return async_llm, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def completion(async_llm: AsyncLLM, request_id: str, prompt: list[int]) -> list[int]:
    async for out in async_llm.generate(prompt, PARAMS, request_id):
        if out.finished:
            return out.outputs[0].token_ids
    raise AssertionError("no final output")


class DeniedPath(type(Path())):
    """A path on a file system that answers EACCES (a shared mount this instance may not read; the tests run as
    root, for whom chmod denies nothing)."""

    def _denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    exists = read_bytes = _denied


class DeniedDirectory(DirectoryStore):
    def _file(self, key: str) -> Path:
        return DeniedPath(super()._file(key))


def test_store_errors_outside_the_forward_are_misses_not_failures(model_dir, tmp_path):
    """Finding 3, the audit's trigger: a store directory raising EACCES on exists() (the write-through save after a
    step) and on reads (scheduler.schedule() -> connector fetch). Before, the exception left the step: every
    in-flight request failed, forever, with /health 200 and engine_step_failures_total 0. Now each is a miss: the
    requests succeed with the right tokens, the store failures are counted, no step fails."""
    prompts = [tokens(40 + 10 * i, 40 + i) for i in range(3)]
    expected = [expected_tokens(model_dir, p) for p in prompts]
    llm = make_llm(model_dir, kv_transfer_config={"kv_connector": "directory", "path": str(tmp_path / "kv")})
    connector = llm.llm_engine.kv_connector
    connector.store = DeniedDirectory(str(tmp_path / "kv"), retry_after_s=0.0)
    async_llm, client = serve(llm)

    async def run():
        outputs = await asyncio.gather(*(completion(async_llm, f"r{i}", p) for i, p in enumerate(prompts)))
        return outputs, await client.get("/health"), (await client.get("/metrics")).text

    try:
        outputs, health, metrics = asyncio.run(run())
    finally:
        async_llm.shutdown()
    assert outputs == expected and health.status_code == 200
    assert connector.store.num_failures > 0 and llm.llm_engine.num_step_failures == 0
    assert metric_value(metrics, "pagedserve:kv_connector_failures_total") > 0


def test_exception_in_scheduling_fails_that_step_counts_and_recovers(model_dir, monkeypatch):
    """Finding 3, the boundary: scheduler.schedule() raising (any bug outside the forward) fails the requests of
    that step with an error, counts in engine_step_failures_total, makes /health 503 after
    max_consecutive_step_failures failed steps in a row, and the next request is served with the right tokens
    (/health 200 again). (Replaces a fake-engine test that asserted /health 200 after such a failure.)"""
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    prompts = [tokens(30, 50), tokens(30, 51), tokens(30, 52)]
    expected = expected_tokens(model_dir, prompts[2])
    failing = {"steps": 2}
    schedule = engine.scheduler.schedule

    def flaky_schedule(*args, **kwargs):
        if failing["steps"]:
            failing["steps"] -= 1
            raise RuntimeError("scheduler bug (injected)")
        return schedule(*args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "schedule", flaky_schedule)
    async_llm, client = serve(llm, max_consecutive_step_failures=2)

    async def run():
        errors = []
        for i in range(2):
            with pytest.raises(EngineRequestError, match="engine step failed: RuntimeError: scheduler bug") as info:
                await completion(async_llm, f"bad{i}", prompts[i])
            errors.append(info.value)
        unhealthy = await client.get("/health")
        metrics = (await client.get("/metrics")).text
        served = await completion(async_llm, "good", prompts[2])
        return unhealthy, metrics, served, await client.get("/health")

    try:
        unhealthy, metrics, served, healthy = asyncio.run(run())
    finally:
        async_llm.shutdown()
    assert unhealthy.status_code == 503 and "failing" in unhealthy.json()["error"]["message"]
    assert metric_value(metrics, "pagedserve:engine_step_failures_total") == 2
    assert served == expected and healthy.status_code == 200
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks and not engine.has_unfinished_requests()


def test_a_hung_step_makes_health_503_until_it_returns(model_dir, tmp_path):
    """Finding 4: a step that hangs (here a read from a shared directory that never answers: a named pipe in place
    of a block file, as a hard-mounted store that went away) makes /health 503 once it has run longer than
    step_timeout_s, and 200 again once it returns; the request then completes with the right tokens (the block
    that came back is rejected and recomputed)."""
    prompt = tokens(40, 60)
    expected = expected_tokens(model_dir, prompt)
    path = tmp_path / "kv"
    llm = make_llm(model_dir, kv_transfer_config={"kv_connector": "directory", "path": str(path)})
    engine = llm.llm_engine
    first_block = engine.kv_connector.key(engine.kv_cache_manager.hash_fn(None, prompt[:BLOCK], ()))
    fifo = path / first_block
    os.mkfifo(fifo)
    async_llm, client = serve(llm, step_timeout_s=0.5)

    async def run():
        request = asyncio.ensure_future(completion(async_llm, "stuck", prompt))
        assert (await client.get("/health")).status_code == 200
        deadline = time.monotonic() + 30
        while (stalled := await client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health never reported the hung step"
            await asyncio.sleep(0.1)
        assert not request.done()
        # the store answers at last: a writer opens the pipe and closes it (the reader sees an empty file)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        served = await asyncio.wait_for(request, 30)
        return stalled, served, await client.get("/health")

    try:
        stalled, served, healthy = asyncio.run(run())
    finally:
        if stat.S_ISFIFO(os.stat(fifo).st_mode):  # never leave the engine thread blocked on the pipe
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        async_llm.shutdown()
    assert stalled.status_code == 503 and "stalled" in stalled.json()["error"]["message"]
    assert served == expected and healthy.status_code == 200
    assert engine.kv_connector.stats.num_rejected_payloads == 1 and engine.num_step_failures == 0
