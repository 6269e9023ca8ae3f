"""The engine's KV connector: full KV blocks keyed by their prefix-cache hash, loaded from a store instead of
recomputed, and saved to it. The scheduler asks `fetch` which of a request's next blocks the store holds; the
model runner writes those payloads into freshly allocated pool blocks before the forward (block_io.py), and the
engine reads the blocks `save` is given (evicted or newly written ones) into payloads.

Nothing read from a store is trusted: each record is a tag followed by the payload, the tag an HMAC-SHA256 of
the record's key and payload under the instances' shared secret (PAGEDSERVE_KV_TRANSFER_SECRET; without one, the
empty key: a plain digest that catches corruption but not forgery). A record whose tag or size does not match is
a miss (counted in `num_rejected_payloads`) and is overwritten once this instance has recomputed the block. The
key's namespace holds a digest of the weights' bytes, so two checkpoints of one shape never share blocks."""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pagedserve import envs
from pagedserve.core.block_pool import BlockHash
from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.stores import DirectoryStore, KVStore, LRUMemoryStore, RedisStore, TieredStore

logger = logging.getLogger("pagedserve")

# Bumped whenever the record layout changes, so that stores written by another version are never read.
PAYLOAD_LAYOUT = "pagedserve-kv-v2:hmac-sha256-tag,layers,kv,block,heads,dim"
TAG_BYTES = hashlib.sha256().digest_size
WEIGHT_FILE_PATTERNS = ("*.safetensors",)  # what the model loader reads besides config.json
_DIGEST_CHUNK = 64 << 20  # weight files are hashed in chunks, on every core
MAX_REWRITES = 1 << 16  # rejected keys remembered for rewriting; past that the oldest are forgotten


@dataclass
class KVConnectorStats:
    """The store side (what was loaded is counted by the scheduler, at admission)."""
    num_saved_blocks: int = 0
    num_rejected_payloads: int = 0  # a stored record of the wrong size or tag: treated as a miss


def weights_digest(model_dir: str | Path) -> str:
    """SHA-256 over config.json and every byte of every weight file: any change to any weight changes it. Files are
    hashed in 64 MiB chunks on a thread pool (hashlib and pread release the GIL), the chunk digests then hashed in
    order; once at start-up, just after the loader read the same bytes (docs/DISTRIBUTED.md has its cost)."""
    root = Path(model_dir)
    h = hashlib.sha256((root / "config.json").read_bytes())
    paths = sorted({p for pattern in WEIGHT_FILE_PATTERNS for p in root.glob(pattern)})
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for path in paths:
            h.update(path.name.encode() + b"\0")
            fd = os.open(path, os.O_RDONLY)
            try:
                offsets = range(0, os.fstat(fd).st_size, _DIGEST_CHUNK)
                for digest in pool.map(lambda offset: hashlib.sha256(os.pread(fd, _DIGEST_CHUNK, offset)).digest(),
                                       offsets):
                    h.update(digest)
            finally:
                os.close(fd)
    return h.hexdigest()


def make_store(config: KVTransferConfig) -> KVStore:
    if config.kv_connector == "cpu":
        if config.path:
            return TieredStore(config.kv_buffer_size, DirectoryStore(config.path, config.disk_size))
        return LRUMemoryStore(config.kv_buffer_size)
    if config.kv_connector == "redis":
        return RedisStore(config.url, config.ttl_s)
    return DirectoryStore(config.path, config.disk_size)


class KVConnector:
    """Pure Python: keys, record tags, store I/O and counters. `namespace` (weights, dtypes, block shape, and which
    secret) enters every key, so different models, dtypes or secrets share one store without ever reading each
    other's blocks. A store error of any kind is a miss (or a dropped save), never an engine failure."""

    def __init__(self, config: KVTransferConfig, store: KVStore, namespace: str, block_nbytes: int,
                 secret: bytes = b"") -> None:
        self.config = config
        self.store = store
        self.namespace = namespace
        self.block_nbytes = block_nbytes
        self.stats = KVConnectorStats()
        self._secret = secret
        self._rewrite: dict[str, None] = {}  # keys of rejected records, oldest first: saved again when recomputed

    @classmethod
    def create(cls, config: KVTransferConfig, model_dir: str | Path, block_nbytes: int,
               compute: Sequence[str]) -> "KVConnector":
        """compute: what besides the weights makes the KV values and layout (KV dtype, model dtype, quantization,
        block size, layers/heads/head dim)."""
        secret = (envs.PAGEDSERVE_KV_TRANSFER_SECRET or "").encode()
        weights = f"name:{config.kv_namespace}" if config.kv_namespace else weights_digest(model_dir)
        # which secret, not the secret: instances with different secrets keep apart instead of rejecting each other
        secret_id = hmac.new(secret, b"pagedserve-kv-namespace", hashlib.sha256).hexdigest()
        identity = "|".join([PAYLOAD_LAYOUT, weights, secret_id, *compute])
        namespace = hashlib.sha256(identity.encode()).hexdigest()[:24]
        return cls(config, make_store(config), namespace, block_nbytes, secret)

    def key(self, block_hash: BlockHash) -> str:
        suffix = block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)
        return f"pagedserve:{self.namespace}:{suffix}"

    def _tag(self, key: str, payload: bytes | memoryview) -> bytes:
        mac = hmac.new(self._secret, key.encode(), hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def fetch(self, block_hashes: Sequence[BlockHash]) -> list[memoryview]:
        """Payloads of the leading blocks the store holds and that pass their check (possibly none). Every record
        read is checked: each that fails (wrong size or tag) is counted and will be rewritten, and the first ends
        the run of loaded blocks."""
        if not self.config.loads or not block_hashes:
            return []
        keys = [self.key(h) for h in block_hashes]
        try:
            records = self.store.get_prefix(keys)
        except Exception as exc:  # a store bug or an error it did not expect: a miss, as any store failure
            self.store._failed("read", exc)
            return []
        found: list[memoryview] = []
        usable = True
        for key, record in zip(keys, records):
            view = memoryview(record)
            payload = view[TAG_BYTES:]
            if len(record) != TAG_BYTES + self.block_nbytes or not hmac.compare_digest(
                    view[:TAG_BYTES], self._tag(key, payload)):
                self._reject(key)
                usable = False
            elif usable:
                found.append(payload)
        return found

    def _reject(self, key: str) -> None:
        self.stats.num_rejected_payloads += 1
        self._rewrite[key] = None
        if len(self._rewrite) > MAX_REWRITES:
            del self._rewrite[next(iter(self._rewrite))]
        if self.stats.num_rejected_payloads == 1:
            logger.warning("KV store: a stored block failed its integrity check (corrupt, truncated, or written "
                           "without the shared secret); recomputing it. Further rejections are only counted "
                           "(kv_connector_rejected_payloads).")

    def save(self, blocks: list[tuple[int, BlockHash]], read_blocks: Callable[[list[int]], list[bytes]]) -> None:
        """blocks: (pool block id, hash) of written blocks; only those the store lacks (or holds a rejected record
        of) are read and sent."""
        if not self.config.saves or not blocks:
            return
        by_key = {self.key(h): block_id for block_id, h in blocks}
        try:
            missing = self.store.missing(list(by_key))
        except Exception as exc:
            self.store._failed("lookup", exc)
            return
        if self._rewrite:
            stored = set(by_key).difference(missing)
            missing += [k for k in stored if k in self._rewrite]
        if not missing:
            return
        payloads = read_blocks([by_key[k] for k in missing])
        records = [(k, self._tag(k, p) + p) for k, p in zip(missing, payloads)]
        try:
            self.store.put(records)
        except Exception as exc:
            self.store._failed("write", exc)
            return
        for k in missing:
            self._rewrite.pop(k, None)
        self.stats.num_saved_blocks += len(missing)
