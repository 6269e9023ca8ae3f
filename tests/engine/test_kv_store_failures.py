"""KV stores that fail (issue 47, finding 14), for real: a write that fails mid-file (the process's file size limit,
as on a full disk), a directory that is no longer one, a Redis server out of memory, a Redis key's expiry."""
from __future__ import annotations

import os
import resource
import signal
import time
import traceback

import pytest
from test_kv_transfer import BLOCK, generate, make_llm, tokens

from pagedserve.kv_transfer.stores import DirectoryStore


def tmp_files(path) -> list[str]:
    return [f.name for f in path.iterdir() if f.name.startswith(".tmp-")]


def limit_file_size(limit: int) -> None:
    """RLIMIT_FSIZE: a write past limit bytes fails with EFBIG, as on a full disk. Only in_forked_child: the limit
    holds for every file the process writes, so in pytest's own process it also fails pytest's writes to a log file
    already past it (CI's output went to one, and the run stopped mid-suite with exit 1)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal that kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def in_forked_child(body) -> None:
    """Run body() in a forked child; its exception's traceback comes back as this test's failure."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_fd)
        error = b""
        try:
            body()
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            error = traceback.format_exc().encode()
        os.write(write_fd, error)
        os._exit(1 if error else 0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        error = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child failed:\n{error}"


def test_failed_directory_write_leaves_nothing_and_backs_off(tmp_path):
    """A write that fails half-way leaves no temporary file (before: one per failed block, forever); writes then
    back off (no retry per step), reads go on."""

    def body():
        store = DirectoryStore(str(tmp_path), retry_after_s=0.3)
        store.put([("kept", b"k" * 100)])
        limit_file_size(1000)
        store.put([("big", b"x" * 5000), ("next", b"y" * 10)])
        assert store.num_failures == 1 and tmp_files(tmp_path) == []
        assert store.missing(["big", "next"]) == []  # lookups and writes are backed off: nothing to save for now
        store.put([("small", b"s" * 10)])
        assert store.num_failures == 1 and not (tmp_path / "small").exists()
        assert store.get_prefix(["kept"]) == [b"k" * 100]  # reads are not held back
        time.sleep(0.35)
        store.put([("small", b"s" * 10)])
        assert store.get_prefix(["small"]) == [b"s" * 10] and store.missing(["big", "small"]) == ["big"]

    in_forked_child(body)


def test_stale_temporary_files_are_swept_at_start(tmp_path):
    """A writer killed mid-write leaves a temporary file; the next store on the directory deletes those older than
    STALE_TMP_S, and leaves a fresh one (another instance may be writing it)."""
    stale, fresh = tmp_path / ".tmp-stale", tmp_path / ".tmp-fresh"
    stale.write_bytes(b"half a block")
    fresh.write_bytes(b"being written")
    old = time.time() - DirectoryStore.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    DirectoryStore(str(tmp_path))
    assert tmp_files(tmp_path) == [".tmp-fresh"]


def test_directory_blocks_reach_the_disk_before_their_name(tmp_path, monkeypatch):
    """Each block's data is fsynced before it is renamed into place: after a crash a file under a block's name
    never has its size without its data (os.replace alone orders neither)."""
    from pagedserve.kv_transfer import stores

    synced, replaced = [], []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src, dst):
        assert str(src) in synced, "renamed before its data was synced"
        replaced.append(str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(stores.os, "fsync", fsync)
    monkeypatch.setattr(stores.os, "replace", replace)
    DirectoryStore(str(tmp_path)).put([("a", b"1" * 64), ("b", b"2" * 64)])
    assert replaced == [str(tmp_path / "a"), str(tmp_path / "b")] and len(synced) == 2


def test_directory_that_is_no_longer_one_only_costs_recompute(model_dir, tmp_path):
    """The store's directory replaced by a file while serving (ENOTDIR on every read and write): requests succeed
    with the right outputs, the failures are counted, no step fails."""
    prompt = tokens(50, 31)
    expected = generate(make_llm(model_dir), [prompt])[0]
    path = tmp_path / "kv"
    llm = make_llm(model_dir, kv_transfer_config={"kv_connector": "directory", "path": str(path)})
    assert generate(llm, [prompt])[0] == expected
    for f in path.iterdir():
        f.unlink()
    path.rmdir()
    path.write_bytes(b"not a directory")
    outputs, computed = generate(llm, [tokens(20, 32) + prompt])
    assert computed == 70 and outputs == generate(make_llm(model_dir), [tokens(20, 32) + prompt])[0]
    engine = llm.llm_engine
    assert engine.kv_connector.store.num_failures > 0 and engine.num_step_failures == 0


def test_failed_redis_write_does_not_suppress_reads(model_dir, redis_url):
    """A Redis server that refuses writes (maxmemory reached, noeviction) but serves reads: an instance whose save
    failed still loads stored blocks at once (before: every read was skipped for 5 s after the failed write)."""
    import redis

    url, _ = redis_url
    config = {"kv_connector": "redis", "url": url}
    prompt, other = tokens(100, 33), tokens(60, 34)
    expected = generate(make_llm(model_dir), [prompt])[0]
    generate(make_llm(model_dir, kv_transfer_config={**config, "kv_role": "kv_producer"}), [prompt])
    client = redis.Redis.from_url(url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    b = make_llm(model_dir, kv_transfer_config=config)
    generate(b, [other])  # its write-through save is refused (OOM)
    failures = b.llm_engine.kv_connector.store.num_failures
    assert failures > 0
    outputs, computed = generate(b, [prompt])
    assert outputs == expected and computed == 100 - 6 * BLOCK
    client.config_set("maxmemory", 0)


def test_redis_keys_expire(model_dir, redis_url):
    """Each stored block gets the configured TTL (default a day): blocks of a model nobody serves any more go."""
    import redis

    url, _ = redis_url
    client = redis.Redis.from_url(url)
    for config, bound in [({"ttl_s": 120}, 120), ({}, 24 * 3600)]:
        client.flushall()
        llm = make_llm(model_dir, kv_transfer_config={"kv_connector": "redis", "url": url, **config})
        generate(llm, [tokens(40, 35)])
        keys = client.keys("pagedserve:*")
        assert len(keys) == 2 and all(0 < client.ttl(k) <= bound for k in keys)
    with pytest.raises(ValueError, match="ttl_s"):
        make_llm(model_dir, kv_transfer_config={"kv_connector": "directory", "path": "x", "ttl_s": 5})
