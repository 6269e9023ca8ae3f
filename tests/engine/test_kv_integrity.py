"""What an instance loads from a shared KV store is verified, never trusted: each stored block carries a tag (an
HMAC-SHA256 of its key and bytes, keyed by PAGEDSERVE_KV_TRANSFER_SECRET when the instances share one), and the
key's namespace covers every byte of the weights. Real directories, a real redis-server, real engines; every
output is compared token for token with an engine without a connector."""
from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import struct
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from test_kv_transfer import BLOCK, generate, make_llm, tokens

from pagedserve.kv_transfer.connector import TAG_BYTES, weights_digest
from pagedserve.metrics.prometheus import PrometheusStatLogger, render

PROMPT_LEN = 100  # 6 full blocks before the last token


def block_keys(llm, prompt: list[int]) -> list[str]:
    """The store keys of the prompt's full blocks, in order."""
    engine = llm.llm_engine
    hash_fn, parent, keys = engine.kv_cache_manager.hash_fn, None, []
    for i in range(len(prompt) // BLOCK):
        parent = hash_fn(parent, prompt[i * BLOCK:(i + 1) * BLOCK], ())
        keys.append(engine.kv_connector.key(parent))
    return keys


def rejected_metric(llm) -> float:
    """pagedserve:kv_connector_rejected_payloads_total as the Prometheus logger exports it."""
    registry = CollectorRegistry()
    PrometheusStatLogger(registry, "m").update_scheduler_stats(llm.llm_engine.get_stats().scheduler)
    for line in render(registry).decode().splitlines():
        if line.startswith("pagedserve:kv_connector_rejected_payloads_total{"):
            return float(line.rpartition(" ")[2])
    raise AssertionError("pagedserve:kv_connector_rejected_payloads_total is not exported")


class DirectoryRecords:
    def __init__(self, path):
        self.path = path

    def read(self, key: str) -> bytes:
        return (self.path / key).read_bytes()

    def overwrite(self, key: str, record: bytes) -> None:
        with open(self.path / key, "r+b") as f:  # in place: same inode, same size
            f.write(record)


class RedisRecords:
    def __init__(self, url: str):
        import redis

        self.client = redis.Redis.from_url(url)

    def read(self, key: str) -> bytes:
        return self.client.get(key)

    def overwrite(self, key: str, record: bytes) -> None:
        self.client.set(key, record, keepttl=True)


@pytest.fixture(params=["directory", "redis"])
def shared_store(request, tmp_path):
    """(kv_transfer_config, raw access to the stored records) of a real directory or a real redis-server."""
    if request.param == "directory":
        path = tmp_path / "kv"
        return {"kv_connector": "directory", "path": str(path)}, DirectoryRecords(path)
    url, _ = request.getfixturevalue("redis_url")
    return {"kv_connector": "redis", "url": url}, RedisRecords(url)


@pytest.mark.parametrize("damage", ["zeros", "random"])
def test_blocks_overwritten_in_place_are_rejected_and_repaired(model_dir, shared_store, damage):
    """Issue 47, finding 1: every stored block overwritten in place with bytes of the same size. Before, a fresh
    instance loaded them (length check only) and generated [0, 0, 0, ...]; now it loads none, counts each as
    rejected, generates the original tokens, and rewrites them, so that the next instance loads them again."""
    config, records = shared_store
    prompt = tokens(PROMPT_LEN, 21)
    expected = generate(make_llm(model_dir), [prompt])[0]
    producer = make_llm(model_dir, kv_transfer_config={**config, "kv_role": "kv_producer"})
    assert generate(producer, [prompt])[0] == expected
    keys = block_keys(producer, prompt)
    for i, key in enumerate(keys):
        size = len(records.read(key))
        damaged = bytes(size) if damage == "zeros" else hashlib.shake_256(f"{i}".encode()).digest(size)
        records.overwrite(key, damaged)
        assert len(records.read(key)) == size
    fresh = make_llm(model_dir, kv_transfer_config=config)
    outputs, computed = generate(fresh, [prompt])
    assert outputs == expected and computed == PROMPT_LEN
    stats = fresh.llm_engine.get_stats().scheduler
    assert stats.external_prefix_cache_hits == 0
    assert fresh.llm_engine.kv_connector.stats.num_rejected_payloads == len(keys)
    assert stats.kv_connector_rejected_payloads == len(keys) and rejected_metric(fresh) == len(keys)
    # the rejected records were rewritten by the instance that recomputed them
    again = make_llm(model_dir, kv_transfer_config=config)
    outputs, computed = generate(again, [prompt])
    assert outputs == expected and computed == PROMPT_LEN - len(keys) * BLOCK
    assert again.llm_engine.kv_connector.stats.num_rejected_payloads == 0


def test_forged_blocks_need_the_shared_secret(model_dir, tmp_path, monkeypatch):
    """With PAGEDSERVE_KV_TRANSFER_SECRET, whoever can write to the store but lacks the secret cannot make an
    instance load a block: a record with a valid unkeyed digest is rejected; signed with the secret it loads (the
    control: the tag is what decides). Instances with another secret never even look at these keys."""
    config = {"kv_connector": "directory", "path": str(tmp_path / "kv")}
    records = DirectoryRecords(tmp_path / "kv")
    prompt = tokens(PROMPT_LEN, 22)
    monkeypatch.setenv("PAGEDSERVE_KV_TRANSFER_SECRET", "correct horse battery staple")
    producer = make_llm(model_dir, kv_transfer_config={**config, "kv_role": "kv_producer"})
    generate(producer, [prompt])
    first = block_keys(producer, prompt)[0]
    payload = bytes(len(records.read(first)) - TAG_BYTES)  # zeros where the block's K and V were

    def forge(secret: bytes) -> None:
        mac = hmac.new(secret, first.encode(), hashlib.sha256)
        mac.update(payload)
        records.overwrite(first, mac.digest() + payload)

    forge(b"")  # the plain digest: what anyone without the secret can compute
    victim = make_llm(model_dir, kv_transfer_config=config)
    assert generate(victim, [prompt])[1] == PROMPT_LEN
    assert victim.llm_engine.kv_connector.stats.num_rejected_payloads == 1
    forge(b"correct horse battery staple")
    insider = make_llm(model_dir, kv_transfer_config=config)
    assert generate(insider, [prompt])[1] == PROMPT_LEN - 6 * BLOCK  # loaded, forged block included
    assert insider.llm_engine.kv_connector.stats.num_rejected_payloads == 0
    monkeypatch.setenv("PAGEDSERVE_KV_TRANSFER_SECRET", "another secret")
    stranger = make_llm(model_dir, kv_transfer_config=config)
    assert stranger.llm_engine.kv_connector.namespace != producer.llm_engine.kv_connector.namespace
    assert generate(stranger, [prompt])[1] == PROMPT_LEN
    assert stranger.llm_engine.kv_connector.stats.num_rejected_payloads == 0


def sign_flipped_copy(src, dst, tensor: str):
    """A copy of a checkpoint with one tensor's sign flipped, in place in the safetensors bytes (bfloat16 or float32
    little-endian: the sign is the top bit of each element's last byte). Same names, sizes and config."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    entry = json.loads(data[8:8 + header_len])[tensor]
    width = {"BF16": 2, "F16": 2, "F32": 4}[entry["dtype"]]
    start, end = (8 + header_len + offset for offset in entry["data_offsets"])
    for i in range(start + width - 1, end, width):
        data[i] ^= 0x80
    path.write_bytes(bytes(data))
    return dst, start


def test_a_model_with_other_weights_never_shares_kv(tmp_path):
    """Issue 47, finding 2: the demo model and a copy with layer 0's down_proj sign-flipped (its bytes lie past the
    first MiB of the file, which was all the namespace looked at) share a directory store: different namespaces,
    no block of one is loaded by the other, each generates its own output. With an explicit kv_namespace the
    operator vouches that instances serve the same weights: then they do share."""
    from pagedserve.demo_model_path import default_model_path

    original = Path(default_model_path())
    flipped, offset = sign_flipped_copy(original, tmp_path / "flipped", "model.layers.0.mlp.down_proj.weight")
    assert offset > 1 << 20
    prompt = tokens(PROMPT_LEN, 23)
    config = {"kv_connector": "directory", "path": str(tmp_path / "kv")}
    own = generate(make_llm(flipped), [prompt])[0]
    a = make_llm(original, kv_transfer_config=config)
    b = make_llm(flipped, kv_transfer_config=config)
    assert a.llm_engine.kv_connector.namespace != b.llm_engine.kv_connector.namespace
    assert generate(a, [prompt])[1] == PROMPT_LEN
    outputs, computed = generate(b, [prompt])
    assert outputs == own and computed == PROMPT_LEN
    assert b.llm_engine.get_stats().scheduler.external_prefix_cache_hits == 0
    named = {**config, "kv_namespace": "vouched"}
    c, d = make_llm(original, kv_transfer_config=named), make_llm(flipped, kv_transfer_config=named)
    assert c.llm_engine.kv_connector.namespace == d.llm_engine.kv_connector.namespace
    generate(c, [prompt])
    assert generate(d, [prompt])[1] == PROMPT_LEN - 6 * BLOCK


def test_weights_digest_covers_every_byte(tmp_path, model_dir):
    """One flipped bit anywhere in any weight file changes the digest; renaming nothing, resizing nothing."""
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    before = weights_digest(copy)
    path = next(copy.glob("*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert weights_digest(copy) != before
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert weights_digest(copy) == before
