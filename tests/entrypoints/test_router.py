"""`pagedserve router`: cache-aware routing over data-parallel replicas (real server processes on loopback)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import MAIN_ARGS, ServerProcess, auth_headers, get_server, start_cli_process

from pagedserve.entrypoints.data_parallel import replica_argv
from pagedserve.entrypoints.router import Router, prefix_keys

pytestmark = pytest.mark.server


def test_cache_aware_choice_follows_prefixes_and_load():
    router = Router(["http://a", "http://b"], balance_abs_threshold=2)
    system_a, system_b = "You are a pirate. " * 20, "You are a poet. " * 20
    first = router.choose(prefix_keys({"prompt": system_a + "hi"}), set())
    first.remember(prefix_keys({"prompt": system_a + "hi"}))
    second = router.choose(prefix_keys({"prompt": system_b + "hi"}), set())
    second.remember(prefix_keys({"prompt": system_b + "hi"}))
    assert first is not second  # a new prefix goes to the replica holding fewer
    chat = {"messages": [{"role": "system", "content": system_a}, {"role": "user", "content": "later"}]}
    assert router.choose(prefix_keys({"prompt": system_a + "another question"}), set()) is first
    assert prefix_keys(chat)[:3] != prefix_keys({"prompt": system_a})[:3]  # chat and completions differ in text
    first.in_flight = 5  # too busy: load wins over the cache
    assert router.choose(prefix_keys({"prompt": system_a + "x"}), set()) is second
    assert router.choose(prefix_keys({"prompt": system_a + "x"}), {second.url}) is first  # second excluded
    second.healthy = False
    assert router.choose(prefix_keys({"prompt": system_b}), set()) is first
    assert Router(["http://a", "http://b"], policy="round_robin").choose([], set()).url == "http://a"


def test_router_routes_by_prefix_streams_and_survives_a_dead_replica(tiny_model_dir):
    openai = pytest.importorskip("openai")
    model_dir = tiny_model_dir("llama")
    with ThreadPoolExecutor(2) as pool:  # start both at once (the first is shared with other server tests)
        a, b = pool.map(lambda make: make(), (lambda: get_server(model_dir), lambda: ServerProcess(model_dir, MAIN_ARGS)))
    router, url = start_cli_process("router", "--worker", a.url, b.url, "--health-check-interval", "0.5")
    try:
        systems = ["the pirate ship sailed " * 8, "a quiet poem about rain " * 8]

        def complete(prompt: str) -> httpx.Response:
            r = httpx.post(url + "/v1/completions", headers=auth_headers(), timeout=60,
                           json={"model": str(model_dir), "prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            return r

        placed = [{complete(s + f"question {i}").headers["x-pagedserve-worker"] for i in range(3)} for s in systems]
        assert all(len(p) == 1 for p in placed) and placed[0] != placed[1]  # each prefix stays on one replica
        client = openai.OpenAI(base_url=url + "/v1", api_key="test-key-123")
        model = client.models.list().data[0].id
        want = client.completions.create(model=model, prompt=systems[0], max_tokens=6, temperature=0).choices[0].text
        stream = client.completions.create(model=model, prompt=systems[0], max_tokens=6, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        b.stop()  # a replica dies: its prefixes are served by the other, nothing fails
        for s in systems:
            assert complete(s + "after").headers["x-pagedserve-worker"] == a.url
        workers = {w["url"]: w for w in httpx.get(url + "/workers", timeout=60).json()}
        assert not workers[b.url]["healthy"] and workers[a.url]["in_flight"] == 0
    finally:
        router.terminate()
        router.wait(10)
        b.stop()


def test_serve_data_parallel_launches_replicas_behind_the_router(tiny_model_dir):
    """`pagedserve serve --data-parallel-size 2`: two replica processes, healthy before the router binds; the
    official openai client sees one server; a prefix stays on one replica; SIGTERM stops the replicas too."""
    openai = pytest.importorskip("openai")
    model_dir = tiny_model_dir("llama")
    server = ServerProcess(model_dir, MAIN_ARGS + ("--data-parallel-size", "2"))
    try:
        workers = httpx.get(server.url + "/workers", headers=auth_headers(), timeout=60).json()  # the replicas' key
        assert len(workers) == 2 and all(w["healthy"] for w in workers)
        assert server.url not in {w["url"] for w in workers}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key-123")
        model = client.models.list().data[0].id
        prompt = "the pirate ship sailed " * 8
        placed = set()
        for i in range(3):
            raw = client.completions.with_raw_response.create(model=model, prompt=prompt + str(i), max_tokens=4,
                                                              temperature=0)
            assert raw.parse().choices[0].text
            placed.add(raw.headers["x-pagedserve-worker"])
        assert len(placed) == 1
        want = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0).choices[0].text
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        with pytest.raises(openai.AuthenticationError):  # the replicas keep the API key
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").models.list()
    finally:
        assert server.stop() == 0
    for w in workers:  # the replicas went with the router
        with pytest.raises(httpx.HTTPError):
            httpx.get(w["url"] + "/health", timeout=2.0)


def test_replica_argv_strips_the_data_parallel_flag_and_splits_resources():
    import argparse

    args = argparse.Namespace(data_parallel_size=2, num_threads=None, num_kv_blocks=None, kv_cache_memory_bytes=None,
                              kv_cache_memory_fraction=0.3)
    argv = ["serve", "M", "--data-parallel-size", "2", "--port", "8000", "-dp=2", "--api-key", "k"]
    out = replica_argv(argv, args, 9001)
    assert out[:6] == ["serve", "M", "--port", "8000", "--api-key", "k"]
    assert out[6:10] == ["--num-threads", str(max(1, (os.cpu_count() or 1) // 2)), "--kv-cache-memory-fraction", "0.15"]
    assert out[-4:] == ["--host", "127.0.0.1", "--port", "9001"]
    args.num_threads, args.num_kv_blocks = 1, 64
    assert replica_argv(["serve", "-dp", "2"], args, 1) == ["serve", "--host", "127.0.0.1", "--port", "1"]
