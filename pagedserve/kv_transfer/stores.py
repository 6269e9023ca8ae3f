"""Key-value stores of KV block records (bytes). A store never raises to the engine: an unreachable or broken
store answers as a miss (the blocks are recomputed) and drops what it cannot save. After a failure, that direction
(reads, or lookups and writes) is left alone for a while: a dead store costs one failure per window, not one per
engine step, and a store that cannot take writes (disk full) still serves reads."""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("pagedserve")


class Backoff:
    """Skip one direction of a store's operations for `retry_after_s` after it failed, doubling while it keeps
    failing (up to `max_retry_after_s`), back to the start after a success."""

    def __init__(self, retry_after_s: float, max_retry_after_s: float = 60.0) -> None:
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self._wait_s = retry_after_s
        self._until = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self._until

    def failed(self) -> None:
        self._until = time.monotonic() + self._wait_s
        self._wait_s = min(2 * self._wait_s, self.max_retry_after_s)

    def succeeded(self) -> None:
        self._wait_s = self.retry_after_s


class KVStore:
    """get_prefix: the values of the leading keys present, stopping at the first missing one (a block is only
    useful after all the blocks before it). missing: the keys not stored. put: store what it can."""

    num_failures = 0  # operations that failed (store down, I/O error)

    def get_prefix(self, keys: list[str]) -> list[bytes]:
        raise NotImplementedError

    def missing(self, keys: list[str]) -> list[str]:
        raise NotImplementedError

    def put(self, items: list[tuple[str, bytes]]) -> None:
        raise NotImplementedError

    def _failed(self, what: str, exc: Exception) -> None:
        """Count and log (at most every 10 s: a dead store would flood the log on every step)."""
        self.num_failures += 1
        now = time.monotonic()
        if now - getattr(self, "_last_log", -1e9) > 10:
            self._last_log = now
            logger.warning("KV store %s failed (%s: %s); recomputing instead (%d failures so far)",
                           what, type(exc).__name__, exc, self.num_failures)


class LRUMemoryStore(KVStore):
    """The second tier of one instance: payloads in host memory, least recently used dropped past capacity
    (handed to `on_evict` first, when given: a disk tier below)."""

    def __init__(self, capacity_bytes: int, on_evict: Callable[[list[tuple[str, bytes]]], None] | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.on_evict = on_evict
        self.num_bytes = 0
        self.num_evictions = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def get_prefix(self, keys: list[str]) -> list[bytes]:
        found = []
        for key in keys:
            payload = self._items.get(key)
            if payload is None:
                break
            self._items.move_to_end(key)
            found.append(payload)
        return found

    def missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if k not in self._items]

    def put(self, items: list[tuple[str, bytes]]) -> None:
        evicted = []
        for key, payload in items:
            if len(payload) > self.capacity_bytes:
                evicted.append((key, payload))
                continue
            old = self._items.pop(key, None)
            self.num_bytes += len(payload) - (len(old) if old is not None else 0)
            self._items[key] = payload
            while self.num_bytes > self.capacity_bytes:
                dropped = self._items.popitem(last=False)
                self.num_bytes -= len(dropped[1])
                self.num_evictions += 1
                evicted.append(dropped)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)

    def __len__(self) -> int:
        return len(self._items)


class RedisStore(KVStore):
    """A Redis or Valkey server shared by instances (the `redis` client package). Short socket timeouts; reads
    and writes back off separately (Backoff). Each key expires `ttl_s` after it was written (None: never); the
    server's own `maxmemory` with an LRU policy bounds the memory (docs/DISTRIBUTED.md)."""

    def __init__(self, url: str, ttl_s: int | None = None, timeout_s: float = 1.0,
                 retry_after_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError:
            raise ValueError("kv_connector 'redis' needs the redis package: pip install 'pagedserve[kv]'") from None
        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ttl_s = ttl_s
        self.reads = Backoff(retry_after_s)
        self.writes = Backoff(retry_after_s)

    def get_prefix(self, keys: list[str]) -> list[bytes]:
        if not keys or not self.reads.ready():
            return []
        try:
            values = self.client.mget(keys)
        except self._errors as exc:
            self._failed("read", exc)
            self.reads.failed()
            return []
        self.reads.succeeded()
        found = []
        for value in values:
            if value is None:
                break
            found.append(value)
        return found

    def missing(self, keys: list[str]) -> list[str]:
        """(On the save path: a failure backs off writes, not reads.)"""
        if not self.writes.ready():
            return []
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                present = pipe.execute()
        except self._errors as exc:
            self._failed("lookup", exc)
            self.writes.failed()
            return []
        return [k for k, p in zip(keys, present) if not p]

    def put(self, items: list[tuple[str, bytes]]) -> None:
        if not items or not self.writes.ready():
            return
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for key, value in items:
                    pipe.set(key, value, ex=self.ttl_s)
                pipe.execute()
        except self._errors as exc:
            self._failed("write", exc)
            self.writes.failed()
            return
        self.writes.succeeded()


class DirectoryStore(KVStore):
    """One file per block under a directory several instances share (a local disk or a network file system).
    A block is written to a temporary file, flushed to the disk (fsync) and only then renamed into place: a reader
    never sees half a block, nor after a crash a file whose size arrived before its data. A write that fails
    removes its temporary file; temporary files older than STALE_TMP_S (a writer killed mid-write) are swept at
    start and at each scan. Reads and writes back off separately after failures (Backoff): a full disk still
    serves reads.

    capacity_bytes (None: unbounded) bounds the files, least recently used deleted first. Recency is the file's
    mtime, which a read refreshes: every instance sharing the directory sees the same order. Writers only count
    their own bytes between scans; once the count passes the capacity, the directory is scanned (every writer's
    files) and trimmed to LOW_WATERMARK of it, so a scan happens once per tenth of the capacity written. With
    several writers the directory may pass the bound by about that tenth per extra writer, until the next scan."""

    LOW_WATERMARK = 0.9
    STALE_TMP_S = 600.0  # far longer than any write takes: a temporary file this old has no writer any more
    _TMP_PREFIX = ".tmp-"

    def __init__(self, path: str, capacity_bytes: int | None = None, retry_after_s: float = 5.0) -> None:
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.num_evictions = 0
        self.reads = Backoff(retry_after_s)
        self.writes = Backoff(retry_after_s)
        self._num_bytes = sum(size for _, size, _ in self._files())  # (also sweeps stale temporary files)

    def _file(self, key: str) -> Path:
        return self.root / key.replace("/", "-")

    def get_prefix(self, keys: list[str]) -> list[bytes]:
        if not self.reads.ready():
            return []
        found = []
        for key in keys:
            path = self._file(key)
            try:
                found.append(path.read_bytes())
                if self.capacity_bytes is not None:
                    os.utime(path)  # recently used: trimmed last
            except FileNotFoundError:
                break
            except OSError as exc:
                self._failed("read", exc)
                self.reads.failed()
                break
        return found

    def missing(self, keys: list[str]) -> list[str]:
        """(On the save path: a failure backs off writes, not reads.)"""
        if not self.writes.ready():
            return []
        try:
            return [k for k in keys if not self._file(k).exists()]
        except OSError as exc:  # EACCES, EIO: exists() only hides "not found"
            self._failed("lookup", exc)
            self.writes.failed()
            return []

    def put(self, items: list[tuple[str, bytes]]) -> None:
        if not items or not self.writes.ready():
            return
        for key, payload in items:
            if self.capacity_bytes is not None and len(payload) > self.capacity_bytes:
                continue
            try:
                self._write(self._file(key), payload)
            except OSError as exc:
                self._failed("write", exc)
                self.writes.failed()
                return
            self._num_bytes += len(payload)
        self.writes.succeeded()
        if self.capacity_bytes is not None and self._num_bytes > self.capacity_bytes:
            self._trim()

    def _write(self, path: Path, payload: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=self._TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _files(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of the stored blocks; files deleted meanwhile by another instance are skipped, and
        stale temporary files are deleted."""
        files = []
        stale_before = time.time() - self.STALE_TMP_S
        with os.scandir(self.root) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.startswith(self._TMP_PREFIX):
                    if st.st_mtime < stale_before:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                files.append((st.st_mtime, st.st_size, entry.path))
        return files

    def _trim(self) -> None:
        try:
            files = sorted(self._files())
        except OSError as exc:
            self._failed("scan", exc)
            return
        total = sum(size for _, size, _ in files)
        target = self.LOW_WATERMARK * self.capacity_bytes
        for _, size, path in files:
            if total <= target:
                break
            try:
                os.unlink(path)
                self.num_evictions += 1
            except FileNotFoundError:  # another instance trimmed it first
                pass
            except OSError as exc:
                self._failed("delete", exc)
                break
            total -= size
        self._num_bytes = total


class TieredStore(KVStore):
    """A host-memory LRU over a bounded directory: what memory evicts is written to disk, and each block of a
    lookup is looked for in memory, then on disk. A block read back from disk stays there (not promoted): it
    is in the pool again, and when the pool evicts it once more `missing` finds it on disk, so it is not rewritten."""

    def __init__(self, memory_bytes: int, disk: DirectoryStore) -> None:
        self.disk = disk
        self.memory = LRUMemoryStore(memory_bytes, on_evict=disk.put)

    @property
    def num_failures(self) -> int:  # type: ignore[override]
        return self.disk.num_failures

    def _failed(self, what: str, exc: Exception) -> None:
        self.disk._failed(what, exc)

    def get_prefix(self, keys: list[str]) -> list[bytes]:
        found = []
        for key in keys:  # a run of leading blocks may alternate between the tiers
            payload = self.memory.get_prefix([key]) or self.disk.get_prefix([key])
            if not payload:
                break
            found += payload
        return found

    def missing(self, keys: list[str]) -> list[str]:
        return self.disk.missing(self.memory.missing(keys))

    def put(self, items: list[tuple[str, bytes]]) -> None:
        self.memory.put(items)

    def __len__(self) -> int:
        return len(self.memory)
