"""KV beyond one engine: the second tier in host memory, a Redis server and a directory shared by instances.

Every output is compared token for token with an engine without a connector (float32, tiny random model)."""
from __future__ import annotations

import json

import pytest
import torch

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.server

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 24)
    return LLM(str(model_dir), num_threads=1, dtype="float32", block_size=BLOCK, **kwargs)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy outputs, and the prompt tokens the engine computed (loaded and cached ones are not computed)."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{id(p)}-{i}", p, GREEDY)
    outputs, computed = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        computed += engine.last_iteration.num_prompt_tokens
    return [outputs[f"r{id(p)}-{i}"] for i, p in enumerate(prompts)], computed


def assert_drained(llm: LLM) -> None:
    pool = llm.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def test_second_tier_serves_evicted_prefix(model_dir):
    prompt, other = tokens(160, 1), tokens(376, 2)  # 10 full blocks; the other needs all 24 blocks of the pool
    plain = make_llm(model_dir)
    tiered = make_llm(model_dir, kv_offloading_size=1 / 1024)  # 1 MiB host tier
    expected = [generate(plain, [p])[0][0] for p in (prompt, other, prompt)]
    connector = tiered.llm_engine.kv_connector
    first, computed_first = generate(tiered, [prompt])
    assert first == [expected[0]] and computed_first == 160
    assert generate(tiered, [other])[0] == [expected[1]]  # evicts the prompt's blocks into the tier
    assert tiered.llm_engine.kv_cache_manager.block_pool.num_evictions >= 10
    assert len(connector.store) >= 10
    again, computed_again = generate(tiered, [prompt])
    assert again == [expected[2]]
    # all 9 full blocks before the last token were loaded from the tier: none survived in the pool
    assert computed_again == 160 - 9 * BLOCK
    assert tiered.llm_engine.get_stats().scheduler.external_prefix_cache_hits == 9 * BLOCK
    assert_drained(tiered)


def block_nbytes(model_dir) -> int:
    """Bytes of one stored KV block of `model_dir` in float32: its tag, then layers x K,V x tokens x KV heads x
    head dim x 4."""
    from pagedserve.kv_transfer.connector import TAG_BYTES

    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return TAG_BYTES + c["num_hidden_layers"] * 2 * BLOCK * kv_heads * head_dim * 4


def test_cpu_tier_spills_to_disk_and_loads_back(model_dir, tmp_path):
    """A host tier of 3 blocks over a spill directory: the evicted prompt comes back mostly from disk, with the
    same greedy output; blocks read from disk are not written again when the pool evicts them once more."""
    nbytes = block_nbytes(model_dir)
    prompt, other = tokens(160, 1), tokens(376, 2)  # 10 full blocks; the other needs all 24 blocks of the pool
    expected = [generate(make_llm(model_dir), [p])[0][0] for p in (prompt, other)]
    spill = tmp_path / "spill"
    tiered = make_llm(model_dir, kv_transfer_config={"kv_connector": "cpu", "kv_buffer_size": 3 * nbytes,
                                                     "path": str(spill), "disk_size": 64 * nbytes})
    store = tiered.llm_engine.kv_connector.store
    assert generate(tiered, [prompt])[0] == expected[:1]
    assert generate(tiered, [other])[0] == expected[1:]  # evicts the prompt's blocks: 3 stay in memory
    assert len(store.memory) == 3 and store.memory.num_evictions >= 7
    files = list(spill.iterdir())
    assert len(files) == store.memory.num_evictions and all(f.stat().st_size == nbytes for f in files)
    again, computed = generate(tiered, [prompt])
    assert again == expected[:1] and computed == 160 - 9 * BLOCK  # 9 blocks loaded, most of them from disk
    saved = tiered.llm_engine.kv_connector.stats.num_saved_blocks
    assert generate(tiered, [other])[0] == expected[1:]  # evicts the prompt again: nothing new to write for it
    assert tiered.llm_engine.kv_connector.stats.num_saved_blocks - saved <= 24 - 9
    assert store.num_failures == 0
    assert_drained(tiered)


def test_directory_store_bounded_lru(tmp_path):
    """Past disk_size the least recently used files go (a read counts as a use), down to the low watermark.
    A second instance writing into the same directory trims the other's files too; between scans each writer
    only counts its own bytes, so together they may pass the bound by about a tenth of it per extra writer."""
    import time

    from pagedserve.kv_transfer.stores import DirectoryStore

    a = DirectoryStore(str(tmp_path), capacity_bytes=1000)

    def total() -> int:
        return sum(f.stat().st_size for f in tmp_path.iterdir())

    def put(store: DirectoryStore, i: int, bound: int) -> None:
        store.put([(f"k{i}", bytes([i]) * 100)])
        assert a.get_prefix(["k0"]) == [bytes([0]) * 100]  # k0 kept in use
        assert total() <= bound
        time.sleep(0.01)  # distinct mtimes (the file system's clock is coarse)

    for i in range(15):
        put(a, i, 1000)
    assert a.missing(["k0", "k1", "k2", "k14"]) == ["k1", "k2"] and a.num_evictions >= 5
    b = DirectoryStore(str(tmp_path), capacity_bytes=1000)
    for i in range(15, 35):
        put(b if i % 2 else a, i, 1200)
    assert a.get_prefix(["k0"]) and a.missing([f"k{i}" for i in range(15)]) == [f"k{i}" for i in range(1, 15)]
    assert b.num_evictions > 0
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".tmp-")]
    a.put([("huge", b"x" * 1001)])  # larger than the whole bound: not stored
    assert a.missing(["huge"]) == ["huge"]


# ------------------------------------------------------------------ stores shared by instances
def test_redis_store_shared_by_instances(model_dir, tiny_model_dir, redis_url):
    url, server = redis_url
    store = {"kv_connector": "redis", "url": url}
    prompt, other = tokens(100, 3), tokens(70, 4)  # 6 and 4 full blocks
    expected = generate(make_llm(model_dir), [prompt, other])[0]
    producer = make_llm(model_dir, kv_transfer_config={**store, "kv_role": "kv_producer"})
    assert generate(producer, [prompt])[0] == expected[:1]
    assert producer.llm_engine.kv_connector.stats.num_saved_blocks == 6  # write-through: every full block
    # instance B (its own, empty pool) loads what A computed; it computes only the last partial block
    consumer = make_llm(model_dir, kv_transfer_config={**store, "kv_role": "kv_consumer"})
    outputs, computed = generate(consumer, [prompt])
    assert outputs == expected[:1] and computed == 100 - 6 * BLOCK
    assert consumer.llm_engine.kv_connector.stats.num_saved_blocks == 0
    # another model, or the same one with another KV dtype, never reads these blocks (both are in every key)
    strangers = [make_llm(tiny_model_dir("llama", seed=7), kv_transfer_config=store),
                 make_llm(model_dir, kv_cache_dtype="bfloat16", kv_transfer_config=store)]
    for stranger in strangers:
        assert generate(stranger, [prompt])[1] == 100
        assert stranger.llm_engine.get_stats().scheduler.external_prefix_cache_hits == 0
    # the store dies mid-run: requests still succeed, recomputing, and nothing hangs
    server.kill()
    server.wait()
    outputs, computed = generate(consumer, [other])
    assert outputs == expected[1:] and computed == 70
    assert consumer.llm_engine.kv_connector.store.num_failures > 0
    for llm in (producer, consumer, *strangers):
        assert_drained(llm)


def test_directory_store_shared_by_instances(model_dir, tmp_path):
    store = {"kv_connector": "directory", "path": str(tmp_path / "kv")}
    prompts = [tokens(50, 5), tokens(50, 5)[:32] + tokens(18, 6)]  # the second shares 2 blocks with the first
    expected = generate(make_llm(model_dir), prompts)[0]
    a = make_llm(model_dir, kv_transfer_config=store)
    assert generate(a, prompts[:1])[0] == expected[:1]
    b = make_llm(model_dir, kv_transfer_config=store)
    outputs, computed = generate(b, prompts[1:])
    assert outputs == expected[1:] and computed == 50 - 2 * BLOCK
    assert len(list((tmp_path / "kv").iterdir())) == 3 + 1  # A's 3 blocks, then B's own third block
    # a damaged block (truncated file) is a miss: it and the blocks after it are computed, the output is right
    second_block = b.llm_engine.kv_connector.key(b.llm_engine.kv_cache_manager.hash_fn(
        b.llm_engine.kv_cache_manager.hash_fn(None, prompts[0][:16], ()), prompts[0][16:32], ()))
    path = tmp_path / "kv" / second_block.replace("/", "-")
    path.write_bytes(path.read_bytes()[:100])
    c = make_llm(model_dir, kv_transfer_config=store)
    outputs, computed = generate(c, prompts[:1])
    assert outputs == expected[:1] and computed == 50 - BLOCK
    assert c.llm_engine.kv_connector.stats.num_rejected_payloads == 1


def test_kv_transfer_config_errors(model_dir):
    from pagedserve import EngineArgs

    for bad, match in [({"kv_connector": "nfs"}, "kv_connector"), ({"kv_connector": "redis"}, "url"),
                       ({"kv_connector": "cpu", "kv_role": "prefill"}, "kv_role"),
                       ({"kv_connector": "cpu", "kv_buffer_size": 0}, "kv_buffer_size"),
                       ({"kv_connector": "cpu", "path": "x", "disk_size": -1}, "disk_size"),
                       ({"kv_connector": "cpu", "disk_size": 1 << 20}, "path"),
                       ({"kv_connector": "cpu", "extra": 1}, "unknown"), ("{", "JSON"),
                       ({"kv_connector": "redis", "url": "redis://x", "ttl_s": 0}, "ttl_s"),
                       ({"kv_connector": "cpu", "ttl_s": 60}, "ttl_s"),
                       ({"kv_connector": "cpu", "kv_namespace": ""}, "kv_namespace")]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(kv_transfer_config=bad)
    with pytest.raises(ValueError, match="prefix caching"):
        EngineArgs(kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="sha256"):
        EngineArgs(kv_transfer_config={"kv_connector": "directory", "path": "x"}, prefix_caching_hash_algo="builtin")


def test_second_tier_under_pressure_matches(model_dir):
    """Concurrent requests sharing prefixes in a pool too small for them (preemption, chunked prefill, blocks
    evicted and loaded back in the same steps): outputs equal the no-connector engine's."""
    shared = tokens(64, 7)
    prompts = [shared[:16 * (i % 4 + 1)] + tokens(20 + 9 * i, 10 + i) for i in range(10)] * 2
    plain = make_llm(model_dir, num_kv_blocks=20, max_num_batched_tokens=40)
    expected, computed_plain = generate(plain, prompts)
    tiered = make_llm(model_dir, num_kv_blocks=20, max_num_batched_tokens=40, kv_offloading_size=1 / 1024)
    outputs, computed = generate(tiered, prompts)
    assert outputs == expected
    assert plain.llm_engine.scheduler.num_preemptions > 0 and tiered.llm_engine.scheduler.num_preemptions > 0
    assert computed < computed_plain
    stats = tiered.llm_engine.get_stats().scheduler
    assert 0 < stats.external_prefix_cache_hits <= stats.external_prefix_cache_queries
    assert_drained(tiered)


def test_disaggregated_prefill_decode_through_proxy(tiny_model_dir, redis_url):
    """`pagedserve proxy` in front of a prefill server (kv_producer) and a decode server (kv_consumer) sharing a
    real redis-server, all real processes: the official openai client sees ordinary answers, streamed or not,
    equal to a plain engine's; the decode server loads the prompt's blocks instead of computing them."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from server_helpers import MAIN_ARGS, ServerProcess, metric_value, start_cli_process

    openai = pytest.importorskip("openai")
    model_dir = tiny_model_dir("llama")
    store = {"kv_connector": "redis", "url": redis_url[0]}

    def server(role: str) -> ServerProcess:
        # the KV dtype is part of every key: both run float32
        config = json.dumps({**store, "kv_role": role})
        return ServerProcess(model_dir, MAIN_ARGS + ("--dtype", "float32", "--kv-transfer-config", config))

    with ThreadPoolExecutor(2) as pool:  # start both at once
        prefill, decode = pool.map(server, ("kv_producer", "kv_consumer"))
    proxy, url = start_cli_process("proxy", "--prefill", prefill.url, "--decode", decode.url)
    try:
        prompt = tokens(100, 8)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        want = make_llm(model_dir).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].text
        client = openai.OpenAI(base_url=url + "/v1", api_key="test-key-123")
        model = client.models.list().data[0].id
        args = dict(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert client.completions.create(**args).choices[0].text == want
        metrics = httpx.get(decode.url + "/metrics", timeout=60).text
        assert metric_value(metrics, "pagedserve:external_prefix_cache_hits_total") == 6 * BLOCK
        assert metric_value(metrics, "pagedserve:prompt_tokens_total") == 100 - 6 * BLOCK
        assert metric_value(httpx.get(prefill.url + "/metrics", timeout=60).text, "pagedserve:generation_tokens_total") == 1
        other = tokens(70, 9)  # streamed, through a fresh prompt
        want = make_llm(model_dir).generate({"prompt_token_ids": other}, params, use_tqdm=False)[0].outputs[0].text
        stream = client.completions.create(**{**args, "prompt": other}, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        metrics = httpx.get(decode.url + "/metrics", timeout=60).text
        assert metric_value(metrics, "pagedserve:external_prefix_cache_hits_total") == (6 + 4) * BLOCK
        # the prefill server goes away: the decode server computes the prompt itself, the request succeeds
        prefill.stop()
        third = tokens(40, 10)
        want = make_llm(model_dir).generate({"prompt_token_ids": third}, params, use_tqdm=False)[0].outputs[0].text
        assert client.completions.create(**{**args, "prompt": third}).choices[0].text == want
        metrics = httpx.get(decode.url + "/metrics", timeout=60).text
        assert metric_value(metrics, "pagedserve:external_prefix_cache_hits_total") == (6 + 4) * BLOCK
    finally:
        proxy.terminate()
        proxy.wait(10)
        for s in (prefill, decode):
            assert s.stop() == 0


def test_unreachable_redis_is_left_alone_for_a_while(monkeypatch):
    """After a failure that direction (reads; lookups and writes) answers as a miss / drops the save without trying
    again until retry_after_s has passed; the other direction is not held back by it. The stores' clock is a fake
    one the test advances (no wall-clock window that a loaded machine could overrun)."""
    import socket
    import time
    import types

    pytest.importorskip("redis", reason="the redis client package (pagedserve[kv]) is not installed")
    from pagedserve.kv_transfer import stores
    from pagedserve.kv_transfer.stores import RedisStore

    now = [1000.0]
    clock = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    monkeypatch.setattr(stores, "time", types.SimpleNamespace(**{**clock, "monotonic": lambda: now[0]}))

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{port}", retry_after_s=0.2)
    assert store.get_prefix(["k"]) == [] and store.num_failures == 1
    assert store.get_prefix(["k"]) == [] and store.num_failures == 1  # reads: left alone
    store.put([("k", b"v")])  # writes were not held back by the failed read
    assert store.num_failures == 2
    assert store.missing(["k"]) == [] and store.num_failures == 2  # lookups and writes: left alone
    now[0] += 0.19
    assert store.get_prefix(["k"]) == [] and store.num_failures == 2  # not yet
    now[0] += 0.02
    assert store.get_prefix(["k"]) == [] and store.num_failures == 3
