"""Key-value stores of KV block payloads (bytes). A store never raises to the engine: an unreachable or broken
store answers as a miss (the blocks are recomputed) and drops what it cannot save."""
from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger("pagedserve")


class KVStore:
    """get_prefix: the payloads of the leading keys present, stopping at the first missing one (a block is only
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
    """The second tier of one instance: payloads in host memory, least recently used dropped past capacity."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
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
        for key, payload in items:
            if len(payload) > self.capacity_bytes:
                continue
            old = self._items.pop(key, None)
            self.num_bytes += len(payload) - (len(old) if old is not None else 0)
            self._items[key] = payload
            while self.num_bytes > self.capacity_bytes:
                _, dropped = self._items.popitem(last=False)
                self.num_bytes -= len(dropped)
                self.num_evictions += 1

    def __len__(self) -> int:
        return len(self._items)


class RedisStore(KVStore):
    """A Redis or Valkey server shared by instances (the `redis` client package). Short socket timeouts, and after
    a failure the server is left alone for `retry_after_s` (every operation answers as a miss / drops the save):
    an unreachable host costs one timeout per `retry_after_s`, not one per engine step."""

    def __init__(self, url: str, timeout_s: float = 1.0, retry_after_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError:
            raise ValueError("kv_connector 'redis' needs the redis package: pip install 'pagedserve[kv]'") from None
        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.retry_after_s = retry_after_s
        self._down_until = 0.0

    def _failed(self, what: str, exc: Exception) -> None:
        super()._failed(what, exc)
        self._down_until = time.monotonic() + self.retry_after_s

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    def get_prefix(self, keys: list[str]) -> list[bytes]:
        if not keys or self._down():
            return []
        try:
            values = self.client.mget(keys)
        except self._errors as exc:
            self._failed("read", exc)
            return []
        found = []
        for value in values:
            if value is None:
                break
            found.append(value)
        return found

    def missing(self, keys: list[str]) -> list[str]:
        if self._down():
            return []
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                present = pipe.execute()
        except self._errors as exc:
            self._failed("lookup", exc)
            return []
        return [k for k, p in zip(keys, present) if not p]

    def put(self, items: list[tuple[str, bytes]]) -> None:
        if not items or self._down():
            return
        try:
            self.client.mset(dict(items))
        except self._errors as exc:
            self._failed("write", exc)


class DirectoryStore(KVStore):
    """One file per block under a directory several instances share (a local disk or a network file system).
    Writes go to a temporary file renamed into place, so a reader never sees half a block."""

    def __init__(self, path: str) -> None:
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> Path:
        return self.root / key.replace("/", "-")

    def get_prefix(self, keys: list[str]) -> list[bytes]:
        found = []
        for key in keys:
            try:
                found.append(self._file(key).read_bytes())
            except FileNotFoundError:
                break
            except OSError as exc:
                self._failed("read", exc)
                break
        return found

    def missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if not self._file(k).exists()]

    def put(self, items: list[tuple[str, bytes]]) -> None:
        for key, payload in items:
            try:
                fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
                with os.fdopen(fd, "wb") as f:
                    f.write(payload)
                os.replace(tmp, self._file(key))
            except OSError as exc:
                self._failed("write", exc)
                return
