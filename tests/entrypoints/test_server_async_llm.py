"""AsyncLLM and the app around it, with a fake engine (no model, fast): the loop's mechanics (own thread, no
busy spin when idle, abort on early exit, shutdown, a failed request's error reaching its stream, a crashing
loop iteration), error mapping, SSE error chunks, metrics loggers. Failure isolation inside the real engine is
tested with the real engine: a failed forward in test_engine_boundary.py, anything else a step does (scheduling,
the KV connector) and the step watchdog in test_step_failures.py."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pagedserve.config import CacheConfig, EngineConfig, KVCacheConfig, ParallelConfig, RequestLimits
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.demo_model_path import default_model_path
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.engine.async_llm import (AsyncLLM, EngineRequestError, EngineShuttingDown, RequestStream,
                                         merge_delta)
from pagedserve.engine.events import EngineEventRecorder
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.entrypoints.openai.errors import loc_to_param, validation_error_to_openai
from pagedserve.metrics.loggers import FinishedRequestStats, LoggingStatLogger, StepStats
from pagedserve.metrics.prometheus import PrometheusStatLogger, build_1_2_5_buckets, render
from pagedserve.metrics.stats import IterationStats, SchedulerStats
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams


class FakeTokenizer:
    chat_template = "fake"

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [3 + (ord(ch) % 90) for ch in text]

    def decode(self, ids, **_):
        return "".join(chr(ord("a") + (i % 26)) for i in ids)

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True, **_):
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + ("<assistant>" if add_generation_prompt else "")

    def __len__(self):
        return 100


class FakeEngine:
    """Generates token 5, 6, 7, ... one per step per sample; knobs to fail things."""

    def __init__(self, step_sleep: float = 0.002, is_default_model: bool = False) -> None:
        self.tokenizer = FakeTokenizer()
        # the demo model's config as served by a fake: its name, length and vocabulary are the fake's
        model = dataclasses.replace(
            ModelConfig.from_dir(Path(default_model_path()), max_model_len=64, served_model_name="fake-model",
                                 is_default_model=is_default_model),
            model_dir=Path("/fake/demo_model"), architecture="Fake", vocab_size=100, eos_token_ids=frozenset())
        self.config = EngineConfig(
            model=model, cache=CacheConfig(16, "float32", False, "sha256"),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
            parallel=ParallelConfig("cpu", 1), limits=RequestLimits())
        self.kv_cache_config = KVCacheConfig(num_blocks=64, block_size=16, bytes_per_block=0)
        self.input_processor = InputProcessor(self.config, self.kv_cache_config, self.tokenizer)
        kv = KVCacheManager(64, 16)  # the event recorder's view: an empty pool (this engine never steps it)
        self.events = EngineEventRecorder(self.config, self.kv_cache_config, Scheduler(self.config.scheduler, kv), kv)
        self.num_step_failures = 0
        self.last_iteration = IterationStats()
        self.finished: list[FinishedRequestStats] = []
        self.requests: dict[str, dict] = {}
        self.step_sleep = step_sleep
        self.fail_next_step = False
        self.error_ids: set[str] = set()
        self.num_steps = 0
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.dead_reason: str | None = None

    def shutdown(self) -> None:
        pass

    def add_processed_request(self, processed):
        self.thread_ids.add(threading.get_ident())
        self.requests[processed.request_id] = {"ids": processed.prompt_token_ids, "params": processed.params,
                                               "max_tokens": processed.max_tokens, "n": 0,
                                               "t": processed.arrival_time}

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        time.sleep(self.step_sleep)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("CUDA error: device-side assert (simulated)")
        outs = []
        for rid, r in list(self.requests.items()):
            params = r["params"]
            tok = 5 + r["n"]
            r["n"] += 1
            done = r["n"] >= r["max_tokens"]
            comps = [CompletionOutput(index=i, text=self.tokenizer.decode([tok]), token_ids=[tok],
                                      finish_reason="length" if done else None) for i in range(params.n)]
            error = None
            if rid in self.error_ids:
                error, done = "detokenizer exploded (simulated)", True
                comps = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort") for i in range(params.n)]
            m = RequestMetrics(arrival_time=r["t"], first_scheduled_time=r["t"], first_token_time=r["t"],
                               last_token_time=time.time(), num_prompt_tokens=len(r["ids"]))
            outs.append(RequestOutput(rid, None, r["ids"], comps, done, m, 0, error=error))
            if done:
                del self.requests[rid]
                self.finished.append(FinishedRequestStats([c.finish_reason for c in comps], 0.0, len(r["ids"]),
                                                          r["n"] * params.n))
        return outs

    def abort_request(self, request_id):
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def take_step_stats(self):
        self.last_iteration = IterationStats(num_scheduled_tokens=len(self.requests),
                                             num_generation_tokens=len(self.requests))
        return StepStats(scheduler=SchedulerStats(num_running_reqs=len(self.requests),
                                                  kv_cache_usage=0.1 * len(self.requests)),
                         iteration=self.last_iteration, finished=self._take_finished())

    def _take_finished(self):
        finished, self.finished = self.finished, []
        return finished


def params(max_tokens=4, n=1):
    return SamplingParams(max_tokens=max_tokens, n=n, output_kind=RequestOutputKind.DELTA)


async def collect(llm, rid, max_tokens=4, n=1, prompt=(1, 2, 3)):
    tokens: dict[int, list[int]] = {}
    async for out in llm.generate(list(prompt), params(max_tokens, n), rid):
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
    return tokens


async def until(condition, timeout_s: float = 60.0) -> None:
    """Waits for the engine thread to reach a state (a bound for a hang, not a window: a loaded machine only makes
    it come later)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the state never came"
        await asyncio.sleep(0.001)


@pytest.fixture
def fake():
    engine = FakeEngine()
    llm = AsyncLLM(engine, log_stats=False)
    yield engine, llm
    llm.shutdown()


def test_generate_and_engine_runs_on_its_own_thread(fake):
    engine, llm = fake
    tokens = asyncio.run(collect(llm, "a", max_tokens=5, n=2))
    assert tokens == {0: [5, 6, 7, 8, 9], 1: [5, 6, 7, 8, 9]}
    assert engine.thread_ids == {llm._thread.ident} and threading.get_ident() not in engine.thread_ids


def test_from_engine_args_steps_the_engine_on_the_thread_that_built_it(monkeypatch):
    """One thread runs every parallel region (OpenMP keeps a thread pool per such thread: two pools on two cores
    made libgomp stop spinning and wake its workers by futex in nearly every region, see EngineThread)."""
    from pagedserve.engine.llm_engine import LLMEngine

    built_on: list[int] = []
    engines: list[FakeEngine] = []

    def build(args):
        if args == "bad":
            raise ValueError("bad engine args")
        built_on.append(threading.get_ident())
        engines.append(FakeEngine())
        return engines[-1]

    monkeypatch.setattr(LLMEngine, "from_engine_args", staticmethod(build))
    with pytest.raises(ValueError, match="bad engine args"):
        AsyncLLM.from_engine_args("bad", log_stats=False)
    llm = AsyncLLM.from_engine_args("good", log_stats=False)
    try:
        assert asyncio.run(collect(llm, "a", max_tokens=3)) == {0: [5, 6, 7]}
        assert engines[0].thread_ids == set(built_on) == {llm._thread.ident}
        assert threading.get_ident() not in built_on
    finally:
        llm.shutdown()
    assert not llm._thread.is_alive()  # the thread ends with the loop


def test_add_request_value_error_surfaces(fake):
    _, llm = fake

    async def run():
        with pytest.raises(ValueError, match="maximum context length is 64"):
            await llm.add_request("x", [1] * 60, params(max_tokens=10))
        return await collect(llm, "y")  # and the loop still serves

    assert asyncio.run(run()) == {0: [5, 6, 7, 8]}


def test_output_error_fails_that_request_only(fake):
    engine, llm = fake
    engine.error_ids.add("bad")

    async def run():
        good = asyncio.ensure_future(collect(llm, "good", max_tokens=6))
        with pytest.raises(EngineRequestError, match="detokenizer exploded"):
            await collect(llm, "bad", max_tokens=6)
        return await good

    assert asyncio.run(run()) == {0: [5, 6, 7, 8, 9, 10]}


def test_idle_loop_sleeps_instead_of_spinning(fake):
    engine, llm = fake
    asyncio.run(collect(llm, "a"))
    steps = engine.num_steps
    calls = []
    orig = engine.has_unfinished_requests
    engine.has_unfinished_requests = lambda: calls.append(1) or orig()
    time.sleep(0.3)
    assert engine.num_steps == steps and len(calls) <= 2  # asleep on the condition variable
    assert asyncio.run(collect(llm, "b")) == {0: [5, 6, 7, 8]}  # and wakes up for new work


def test_leaving_early_aborts_the_request(fake):
    engine, llm = fake

    async def run():
        agen = llm.generate([1], params(max_tokens=40), "early")
        async for _ in agen:
            break
        await agen.aclose()
        await until(lambda: "early" in engine.aborted)

    asyncio.run(run())
    assert engine.aborted == ["early"] and not engine.requests


def test_cancelled_consumer_aborts(fake):
    engine, llm = fake

    async def run():
        task = asyncio.ensure_future(collect(llm, "c", max_tokens=50))
        await until(lambda: engine.requests.get("c", {}).get("n", 0) > 0)  # generating
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: engine.aborted)

    asyncio.run(run())
    assert engine.aborted == ["c"]


def test_shutdown_ends_inflight_requests_and_rejects_new(fake):
    engine, llm = fake

    async def run():
        s = await llm.add_request("s", [1], params(max_tokens=60))
        await s.get()
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineShuttingDown):
            while True:
                await s.get()
        with pytest.raises(EngineShuttingDown):
            await llm.add_request("t", [1], params())

    asyncio.run(run())
    assert not llm._thread.is_alive()


def test_merge_delta_concatenates():
    a = RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [1, 2], logprobs=[{}, {}])], False)
    b = RequestOutput("r", None, [1], [CompletionOutput(0, "c", [3], logprobs=[{}], finish_reason="stop"),
                                       CompletionOutput(1, "x", [9])], True)
    m = merge_delta(a, b)
    assert m.outputs[0].text == "abc" and m.outputs[0].token_ids == [1, 2, 3] and len(m.outputs[0].logprobs) == 3
    assert m.outputs[0].finish_reason == "stop" and m.outputs[1].text == "x" and m.finished


def test_stream_merges_when_consumer_lags():
    async def run():
        loop = asyncio.get_running_loop()
        s = RequestStream("r", loop, RequestOutputKind.DELTA)
        first = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [1])], False)
        s._put(first)
        s._put(RequestOutput("r", None, [1], [CompletionOutput(0, "b", [2])], False))
        s._put(RequestOutput("r", None, [1], [CompletionOutput(0, "c", [3], finish_reason="length")], True))
        out = await s.get()
        assert out.outputs[0].text == "abc" and out.outputs[0].token_ids == [1, 2, 3] and out.finished
        assert first.outputs[0].text == "a"  # the engine's object was not mutated
        assert s.finished and s.closed

    asyncio.run(run())


# ------------------------------------------------------------------------------------ the app, in-process
def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_app_engine_failure_is_500_or_error_chunk_then_recovers():
    engine = FakeEngine(step_sleep=0.01)
    llm = AsyncLLM(engine, log_stats=False)
    app = build_app(llm, SimpleNamespace(api_key=None), shutdown_engine_on_exit=False)

    async def run():
        async with _client(app) as c:
            async def fail_soon():
                while not engine.requests:
                    await asyncio.sleep(0.001)
                engine.fail_next_step = True

            asyncio.ensure_future(fail_soon())
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 30})
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "server_error" and "engine loop error" in err["message"]

            asyncio.ensure_future(fail_soon())
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 30, "stream": True})
            assert r.status_code == 200
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and '"error"' in events[-2] and "engine loop error" in events[-2]

            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 62})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


def test_two_apps_in_one_process_have_separate_registries():
    llms = [AsyncLLM(FakeEngine(), log_stats=False) for _ in range(2)]
    try:
        apps = [build_app(llm, None, shutdown_engine_on_exit=False) for llm in llms]
        assert apps[0].state.registry is not apps[1].state.registry
        asyncio.run(collect(llms[0], "only-first", max_tokens=3))

        async def scrape(app):
            async with _client(app) as c:
                return (await c.get("/metrics")).text

        t0, t1 = asyncio.run(scrape(apps[0])), asyncio.run(scrape(apps[1]))
        assert 'pagedserve:request_success_total{engine="0",finished_reason="length",model_name="fake-model"} 1.0' in t0
        assert 'pagedserve:request_success_total{engine="0",finished_reason="length",model_name="fake-model"} 0.0' in t1
    finally:
        for llm in llms:
            llm.shutdown()


# ------------------------------------------------------------------------------------ errors / metrics
def test_loc_to_param():
    assert loc_to_param(("body", "messages", 0, "content")) == "messages[0].content"
    assert loc_to_param(("body", "prompt", "list[int]", 3)) == "prompt[3]"
    assert loc_to_param(("body", "stop", "str")) == "stop"
    assert loc_to_param(("body",)) is None


def test_validation_error_mapping():
    e = validation_error_to_openai([{"type": "extra_forbidden", "loc": ("body", "tools"), "msg": "x"}])
    assert (e.status_code, e.param, e.code) == (400, "tools", "unsupported_parameter") and "tools" in e.message
    e = validation_error_to_openai([{"type": "json_invalid", "loc": ("body", 5), "msg": "x", "ctx": {"error": "bad"}}])
    assert (e.status_code, e.param, e.code) == (400, None, "invalid_json")
    e = validation_error_to_openai([{"type": "less_than_equal", "loc": ("body", "temperature"),
                                     "msg": "Input should be less than or equal to 2"}])
    assert e.param == "temperature" and "less than or equal to 2" in e.message


def test_logging_stat_logger_line():
    lg = LoggingStatLogger(interval_s=10.0)
    lg.record(StepStats(scheduler=SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25,
                                                 prefix_cache_queries=100, prefix_cache_hits=40),
                        iteration=IterationStats(num_prompt_tokens=500, num_generation_tokens=30)))
    lg.log(lg._last_log + 10.0)
    line = lg.last_line
    assert "Avg prompt throughput: 50.0 tokens/s" in line and "Avg generation throughput: 3.0 tokens/s" in line
    assert "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%" in line
    lg.record(StepStats(scheduler=SchedulerStats()))
    lg.log(lg._last_log + 10.0)
    idle = lg.last_line
    assert "Running: 0 reqs" in idle
    lg.log(lg._last_log + 10.0)
    assert lg.last_line is idle and not lg.has_pending_activity()  # idle: one line, then quiet


def test_prometheus_logger_counts_deltas_of_cumulative_counters():
    reg = CollectorRegistry()
    pl = PrometheusStatLogger(reg, "m", max_model_len=100, max_num_batched_tokens=64)
    for q, h, p in ((10, 4, 0), (30, 10, 2)):
        pl.record(StepStats(scheduler=SchedulerStats(prefix_cache_queries=q, prefix_cache_hits=h, num_preemptions=p),
                            iteration=IterationStats(num_prompt_tokens=5, num_generation_tokens=1), ttfts=[0.1]))
    pl.record(StepStats(finished=[FinishedRequestStats(["stop", "length"], 1.5, 10, 7, queue_time=0.1)]))
    text = render(reg).decode()
    assert 'pagedserve:prefix_cache_queries_total{engine="0",model_name="m"} 30.0' in text
    assert 'pagedserve:prefix_cache_hits_total{engine="0",model_name="m"} 10.0' in text
    assert 'pagedserve:num_preemptions_total{engine="0",model_name="m"} 2.0' in text
    assert 'pagedserve:prompt_tokens_total{engine="0",model_name="m"} 10.0' in text
    assert 'pagedserve:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0' in text
    assert 'pagedserve:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0' in text
    assert "_created" not in text
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_models_card_flags_the_embedded_demo_model():
    engine = FakeEngine(is_default_model=True)
    llm = AsyncLLM(engine, log_stats=False)
    try:
        app = build_app(llm, None, shutdown_engine_on_exit=False)

        async def get():
            async with _client(app) as c:
                return (await c.get("/v1/models")).json()

        card = asyncio.run(get())["data"][0]
        assert card["id"] == "fake-model" and card["demo_model"] is True and "demo" in card["description"]
        assert card["root"].endswith("demo_model")
    finally:
        llm.shutdown()


def test_health_is_honest_while_starting_serving_and_draining():
    llm = AsyncLLM(FakeEngine(), log_stats=False, start=False)
    app = build_app(llm, None, shutdown_engine_on_exit=False)

    async def health():
        async with _client(app) as c:
            return await c.get("/health")

    r = asyncio.run(health())
    assert r.status_code == 503 and "starting" in r.json()["error"]["message"]
    llm.start()
    r = asyncio.run(health())
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    llm.shutdown()
    r = asyncio.run(health())
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
