"""The server's edges, against real `pagedserve serve` processes and the official `openai` client: an injected
step failure fails only its request (500 naming the error), is counted, and makes /health honest; request
limits (413, 429 + Retry-After, too many sequences); exact finish reasons streaming and not; a disconnect
storm; and ready-means-ready with an empty native-kernel cache."""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import openai
import pytest
from server_helpers import ServerProcess, auth_headers, metric_value, stops_ending_with_last_token

pytestmark = pytest.mark.server

C = "/v1/completions"
FAULT_TOKEN = 767  # the fault-injection server fails every step that schedules a prompt holding this token id
LIMIT_ARGS = ("--num-kv-blocks", "128", "--max-model-len", "512", "--max-num-seqs", "1",
              "--max-consecutive-step-failures", "2", "--max-queued-requests", "3",
              "--max-request-body-bytes", "4096", "--max-sequences-per-request", "8", "--dtype", "float32")


@pytest.fixture(scope="module")
def limited(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir("llama"), LIMIT_ARGS, env={"PAGEDSERVE_FAULT_INJECT_TOKEN": str(FAULT_TOKEN)})
    yield srv
    assert srv.stop() == 0


def scrape(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=60).text


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def first_event_then_rest(url: str, body: dict):
    """Start a streaming completion; returns (the open response, its line iterator) once its first token came,
    i.e. once the request holds its seat in the running batch."""
    cm = httpx.stream("POST", url + C, json={**body, "stream": True}, timeout=120)
    r = cm.__enter__()
    lines = r.iter_lines()
    next(line for line in lines if line.startswith("data: {"))
    return cm, lines


def test_injected_step_failure_fails_its_request_only_and_health_tells(limited):
    url, c = limited.url, client(limited.url)
    model = c.models.list().data[0].id
    good, lines = first_event_then_rest(url, {"prompt": [5, 6, 7, 8], "max_tokens": 300, "temperature": 0,
                                              "ignore_eos": True})
    try:
        # one seat: the bad request waits behind the good one, then fails alone in its own step
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model=model, prompt=[5, FAULT_TOKEN, 9], max_tokens=4)
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    finally:
        good.__exit__(None, None, None)
    err = info.value.body
    assert "engine step failed" in err["message"] and "InjectedFault" in err["message"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length" and "error" not in rest[-1]
    text = scrape(url)
    assert metric_value(text, "pagedserve:engine_step_failures_total") == 1
    assert httpx.get(url + "/health", timeout=60).status_code == 200  # one failure is not a dead engine
    # streaming: the failure arrives as an error event, then [DONE]
    with httpx.stream("POST", url + C, json={"prompt": [FAULT_TOKEN, 5], "max_tokens": 3, "stream": True}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "InjectedFault" in json.loads(events[-2])["error"]["message"]
    # two failed steps in a row (--max-consecutive-step-failures 2): /health says so, with an OpenAI body
    health = httpx.get(url + "/health", timeout=60)
    assert health.status_code == 503 and health.json()["error"]["code"] == "service_unavailable"
    assert "failing" in health.json()["error"]["message"]
    # ... until a step succeeds again
    ok = c.completions.create(model=model, prompt=[5, 6], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    health = httpx.get(url + "/health", timeout=60)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert health.headers["content-type"] == "application/json"
    assert metric_value(scrape(url), "pagedserve:engine_step_failures_total") == 2
    wait_for(lambda: metric_value(scrape(url), "pagedserve:kv_cache_usage_perc") < 1e-6)


def test_request_limits(limited):
    url = limited.url
    # body over --max-request-body-bytes: 413 before the body is parsed
    r = httpx.post(url + C, json={"prompt": "a" * 5000, "max_tokens": 1}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # prompts x n over --max-sequences-per-request, refused before tokenizing
    r = httpx.post(url + C, json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert r.json()["error"]["code"] == "too_many_sequences"
    r = httpx.post(url + C, json={"prompt": "a", "stop": [str(i) for i in range(65)], "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = httpx.post(url + C, json={"prompt": "a", "max_tokens": 1, "stop_token_ids": [10**7], "min_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


def test_full_queue_is_429_with_retry_after(limited):
    url = limited.url
    # one seat: 1 running + 2 waiting sequences fill --max-queued-requests 3
    filler, lines = first_event_then_rest(url, {"prompt": [5, 6], "n": 3, "max_tokens": 300, "ignore_eos": True,
                                                "temperature": 1.0})
    try:
        r = httpx.post(url + C, json={"prompt": [5], "n": 2, "max_tokens": 1}, timeout=60)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        assert metric_value(scrape(url), "pagedserve:num_requests_rejected_queue_full_total") >= 1
        finals = [json.loads(line[6:])["choices"][0] for line in lines if line.startswith("data: {")]
    finally:
        filler.__exit__(None, None, None)
    assert sorted(ch["index"] for ch in finals if ch["finish_reason"] == "length") == [0, 1, 2]
    r = httpx.post(url + C, json={"prompt": [5], "n": 2, "max_tokens": 1}, timeout=60)  # room again
    assert r.status_code == 200


def test_last_token_stop_string_is_stop_streaming_and_not(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key-123", max_retries=0, timeout=60)
    model = c.models.list().data[0].id
    k = 12
    for seed in range(40):
        prompt = [(seed * 37 + i * 11) % 700 + 3 for i in range(8)]
        texts = [c.completions.create(model=model, prompt=prompt, max_tokens=m, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for m in (k - 1, k)]
        stops = stops_ending_with_last_token(*texts)
        if stops:
            break
    else:
        pytest.skip("no usable stop string in these greedy outputs")
    body = dict(model=model, prompt=prompt, max_tokens=k, temperature=0, stop=[stops[0]],
                extra_body={"ignore_eos": True})
    full = c.completions.create(**body).choices[0]
    assert full.finish_reason == "stop" and full.model_extra["stop_reason"] == stops[0]
    chunks = list(c.completions.create(stream=True, **body))
    finals = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert [f.finish_reason for f in finals] == ["stop"] and finals[0].model_extra["stop_reason"] == stops[0]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.text


def test_disconnect_storm_frees_everything(server):
    url = server.url

    async def one(client: httpx.AsyncClient) -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with client.stream("POST", url + C, json=body, headers=auth_headers()) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # leaving the block drops the connection mid-flight

    async def storm() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=60)) as client:
            await asyncio.gather(*(one(client) for _ in range(50)))

    asyncio.run(storm())
    wait_for(lambda: (metric_value(t := scrape(url), "pagedserve:num_requests_running") == 0
                      and metric_value(t, "pagedserve:num_requests_waiting") == 0
                      and metric_value(t, "pagedserve:kv_cache_usage_perc") < 1e-6), timeout=60)
    assert httpx.get(url + "/health", timeout=60).status_code == 200


@pytest.mark.kernels_build
@pytest.mark.timeout(900)
def test_ready_means_ready_with_an_empty_kernel_cache(tiny_model_dir, tmp_path):
    """A fresh kernel cache: the build happens before the server binds, so the first /health 200 comes after
    it, and the first request compiles nothing. The generic level, the cheapest build (this one runs every time),
    and not the package's prebuilt modules (which need no build)."""
    srv = ServerProcess(tiny_model_dir("llama"), ("--num-kv-blocks", "64", "--max-model-len", "256"),
                        startup_timeout=900, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
                                                  "PAGEDSERVE_CPU_ISA": "generic", "PAGEDSERVE_PREBUILT_KERNELS": "0"})
    try:
        log_at_ready = srv.log()
        r = httpx.post(srv.url + C, json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        log = srv.log()
    finally:
        assert srv.stop() == 0
    if os.environ.get("PAGEDSERVE_CPU_KERNELS") == "0":
        pytest.skip("native kernels disabled")
    build, bind = log_at_ready.find("Building native kernels"), log_at_ready.find("Uvicorn running on")
    assert 0 <= build < log_at_ready.find("Warm-up") < bind, log_at_ready
    assert log.count("Building native kernels") == 1 and "Native CPU kernels" in log_at_ready
