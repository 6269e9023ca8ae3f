"""The engine's KV connector: full KV blocks keyed by their prefix-cache hash, loaded from a store instead of
recomputed, and saved to it. The scheduler asks `fetch` which of a request's next blocks the store holds; the
model runner writes those payloads into freshly allocated pool blocks before the forward, and reads the blocks
`save` is given (evicted or newly written ones) into payloads."""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.core.block_pool import BlockHash
from pagedserve.kv_transfer.config import KVTransferConfig
from pagedserve.kv_transfer.stores import DirectoryStore, KVStore, LRUMemoryStore, RedisStore, TieredStore

# Bumped whenever the payload layout changes, so that stores written by another version are never read.
PAYLOAD_LAYOUT = "pagedserve-kv-v1:layers,kv,block,heads,dim"


@dataclass
class KVConnectorStats:
    """The store side (what was loaded is counted by the scheduler, at admission)."""
    num_saved_blocks: int = 0
    num_rejected_payloads: int = 0  # a stored payload of the wrong size: treated as a miss


def model_fingerprint(model_dir: str | Path) -> str:
    """What makes KV of one model reusable by another instance: its config and its weights (names, sizes and the
    first MiB of each weight file: cheap, and two checkpoints of one shape differ there)."""
    root = Path(model_dir)
    h = hashlib.sha256((root / "config.json").read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()


def make_store(config: KVTransferConfig) -> KVStore:
    if config.kv_connector == "cpu":
        if config.path:
            return TieredStore(config.kv_buffer_size, DirectoryStore(config.path, config.disk_size))
        return LRUMemoryStore(config.kv_buffer_size)
    if config.kv_connector == "redis":
        return RedisStore(config.url)
    return DirectoryStore(config.path, config.disk_size)


class KVConnector:
    """Pure Python: keys, store I/O and counters. `namespace` (model, KV dtype, block shape) enters every key,
    so different models or dtypes can share one store without ever reading each other's blocks."""

    def __init__(self, config: KVTransferConfig, store: KVStore, namespace: str, block_nbytes: int) -> None:
        self.config = config
        self.store = store
        self.namespace = namespace
        self.block_nbytes = block_nbytes
        self.stats = KVConnectorStats()

    @classmethod
    def create(cls, config: KVTransferConfig, model_dir: str | Path, kv_dtype: str, block_size: int,
               layout: tuple[int, int, int], block_nbytes: int) -> "KVConnector":
        """layout: (num_layers, num_kv_heads, head_dim) of the KV cache."""
        identity = "|".join([PAYLOAD_LAYOUT, model_fingerprint(model_dir), kv_dtype, str(block_size),
                             ",".join(map(str, layout))])
        namespace = hashlib.sha256(identity.encode()).hexdigest()[:24]
        return cls(config, make_store(config), namespace, block_nbytes)

    def key(self, block_hash: BlockHash) -> str:
        suffix = block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)
        return f"pagedserve:{self.namespace}:{suffix}"

    def fetch(self, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the leading blocks the store holds (possibly none); a wrong-sized one ends the run."""
        if not self.config.loads or not block_hashes:
            return []
        found = []
        for payload in self.store.get_prefix([self.key(h) for h in block_hashes]):
            if len(payload) != self.block_nbytes:
                self.stats.num_rejected_payloads += 1
                break
            found.append(payload)
        return found

    def save(self, blocks: list[tuple[int, BlockHash]], read_blocks: Callable[[list[int]], list[bytes]]) -> None:
        """blocks: (pool block id, hash) of written blocks; only those the store lacks are read and sent."""
        if not self.config.saves or not blocks:
            return
        by_key = {self.key(h): block_id for block_id, h in blocks}
        missing = self.store.missing(list(by_key))
        if not missing:
            return
        payloads = read_blocks([by_key[k] for k in missing])
        self.store.put(list(zip(missing, payloads)))
        self.stats.num_saved_blocks += len(missing)
