"""Load on the server: 64 concurrent streams, a KV pool too small for the load (queueing/preemption),
a client that disconnects mid-stream (its KV blocks are freed at once), and graceful shutdown."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from server_helpers import API_KEY, ServerProcess, auth_headers, metric_value

pytestmark = pytest.mark.server

C = "/v1/completions"



@pytest.fixture(scope="module")
def small_kv_server(tiny_model_dir):
    # 5 blocks of 16 tokens: a request of 8 prompt + 24 generated tokens needs 2 blocks, so at most two
    # run at once and the other 30 wait (or get preempted).  --shutdown-timeout 0: on SIGTERM the
    # in-flight requests end at once with an error chunk (test_graceful_shutdown).
    srv = ServerProcess(tiny_model_dir("llama"), ("--num-kv-blocks", "5", "--max-model-len", "128",
                                                  "--max-num-seqs", "8", "--shutdown-timeout", "0"))
    yield srv
    srv.stop()


async def stream_completion(client: httpx.AsyncClient, body: dict) -> dict:
    """Run one streaming completion; returns text, chunk count, finish reasons, usage, errors, timings."""
    text, chunks, finishes, usage, errors, times = "", 0, [], None, [], []
    t0 = time.perf_counter()
    async with client.stream("POST", C, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        done = False
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            obj = json.loads(data)
            if "error" in obj:
                errors.append(obj["error"])
                continue
            if obj.get("usage") and not obj["choices"]:
                usage = obj["usage"]
            for ch in obj["choices"]:
                chunks += 1
                times.append(time.perf_counter())
                text += ch["text"]
                if ch["finish_reason"]:
                    finishes.append(ch["finish_reason"])
    return {"text": text, "chunks": chunks, "finish": finishes, "usage": usage, "errors": errors, "done": done,
            "t0": t0, "times": times}


def test_64_concurrent_streams(server):
    body = {"max_tokens": 16, "ignore_eos": True, "temperature": 0.8, "seed": 1,
            "stream_options": {"include_usage": True}}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=auth_headers(), timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(stream_completion(client, {**body, "prompt": f"request {i}: the cat"})
                                          for i in range(64)))

    t0 = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - t0
    for res in results:
        assert res["done"] and not res["errors"]
        assert res["finish"] == ["length"]
        assert res["usage"]["completion_tokens"] == 16
        assert res["chunks"] >= 1
    gaps = [b - a for res in results for a, b in zip(res["times"], res["times"][1:])]
    print(f"\n64 streams x 16 tokens in {wall:.2f} s; mean gap between chunks {1000 * sum(gaps) / max(len(gaps), 1):.1f} ms")
    text = httpx.get(server.url + "/metrics", timeout=60).text
    assert metric_value(text, "pagedserve:num_requests_running") == 0


def test_tiny_kv_pool_completes_everything(small_kv_server):
    srv = small_kv_server
    body = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 24, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(stream_completion(c, body) for _ in range(32)))

    results = asyncio.run(run())
    texts = {res["text"] for res in results}
    for res in results:
        assert res["done"] and not res["errors"], res["errors"]
        assert res["usage"]["completion_tokens"] == 24 and res["finish"] == ["length"]
    assert len(texts) == 1  # greedy: preemption/recompute does not change the result
    text = httpx.get(srv.url + "/metrics", timeout=60).text
    assert metric_value(text, "pagedserve:request_success_total", finished_reason="length") == 32
    assert metric_value(text, "pagedserve:num_requests_running") == 0
    assert metric_value(text, "pagedserve:kv_cache_usage_perc") == pytest.approx(0.0, abs=1e-6)
    # the queue was really used: at most 2 requests fit, so most of them waited
    queue_sum = metric_value(text, "pagedserve:request_queue_time_seconds_sum")
    assert queue_sum > 0
    # a request that could never fit in the pool is rejected up front, not queued forever
    r = httpx.post(srv.url + C, json={"prompt": "x", "max_tokens": 100}, timeout=60)
    assert r.status_code == 400 and "block" in r.json()["error"]["message"].lower()
    # no max_tokens: "as much as fits", i.e. the 80-token pool, not max_model_len (128)
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 80 and r.json()["choices"][0]["finish_reason"] == "length"


def test_disconnect_mid_stream_frees_blocks(server):
    url = server.url

    def scrape():
        return httpx.get(url + "/metrics", timeout=60).text

    aborts_before = metric_value(scrape(), "pagedserve:request_success_total", finished_reason="abort")
    body = {"prompt": "the cat reads", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, headers=auth_headers(), timeout=30) as client:
        with client.stream("POST", C, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break
            text = scrape()
            assert metric_value(text, "pagedserve:num_requests_running") == 1
            assert metric_value(text, "pagedserve:kv_cache_usage_perc") > 0
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 60  # a bound for a hang, not a window: load only delays the abort
    while True:
        text = scrape()
        running = metric_value(text, "pagedserve:num_requests_running")
        usage = metric_value(text, "pagedserve:kv_cache_usage_perc")
        aborts = metric_value(text, "pagedserve:request_success_total", finished_reason="abort")
        if running == 0 and usage < 1e-6 and aborts == aborts_before + 1:
            break
        assert time.monotonic() < deadline, (running, usage, aborts, aborts_before)
        time.sleep(0.05)
    # the non-streaming path aborts too when its client goes away: it stops reading 50 ms after sending, long before
    # 480 tokens (a 0.3 s timeout once let the tiny model finish them first: no abort to count)
    try:
        httpx.post(url + C, json={**body, "stream": False}, headers=auth_headers(),
                   timeout=httpx.Timeout(10.0, read=0.05))
    except httpx.TimeoutException:
        pass
    deadline = time.monotonic() + 60
    while True:
        text = scrape()
        if (metric_value(text, "pagedserve:request_success_total", finished_reason="abort") == aborts_before + 2
                and metric_value(text, "pagedserve:num_requests_running") == 0):
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert httpx.get(url + "/health", timeout=60).status_code == 200


def test_graceful_shutdown(small_kv_server):
    """SIGTERM with streams in flight: each ends (finish or an error chunk) with [DONE]; exit 0, no traceback."""
    srv = small_kv_server
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 70, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            tasks = [asyncio.ensure_future(stream_completion(c, body)) for _ in range(6)]
            # wait until generation has started, then signal
            deadline = time.monotonic() + 30
            while True:
                text = (await c.get("/metrics")).text
                if metric_value(text, "pagedserve:num_requests_running") >= 1:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    code = srv.stop(timeout=30)
    assert code == 0, srv.log()[-3000:]
    ended_with_error = 0
    for res in results:
        assert res["done"], res
        if res["errors"]:
            ended_with_error += 1
            assert res["errors"][0]["code"] == "service_unavailable"
        else:
            assert res["finish"] == ["length"]
    assert ended_with_error >= 1  # the pool holds one such request at a time: the others were cut off
    log = srv.log()
    assert "Traceback" not in log, log[-3000:]
    assert "Application shutdown complete" in log
