"""Physical KV blocks: ref counts, an LRU free queue with O(1) removal, and the prefix-cache hash map.

A free block may still hold a cached prefix (it keeps its hash until the allocator reuses it), so
"free" means "ref_cnt == 0", not "empty". Allocation takes from the head of the free queue, which holds
the least recently freed blocks: the LRU eviction order of the prefix cache.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.core.kv_events import BlockPoolObserver

BlockHash = bytes | int
# hash(parent block's hash, this block's token ids, extra keys) -> this block's hash
HashFn = Callable[[BlockHash | None, Sequence[int], tuple], BlockHash]


def sha256_block_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple) -> bytes:
    """Stable across processes and runs: a fixed byte serialization, no pickle, no PYTHONHASHSEED."""
    h = hashlib.sha256()
    h.update(parent if isinstance(parent, bytes) else b"\0" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        h.update(b"\x1f" + str(key).encode())
    return h.digest()


def builtin_block_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple) -> int:
    """Fast, non-cryptographic; stable within one process, which is all the cache needs."""
    return hash((parent, tuple(token_ids), extra_keys))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_block_hash, "builtin": builtin_block_hash}


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is registered in the prefix cache
    # links of the free queue (None when not in it)
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and remove-from-the-middle.

    The middle removal is what a prefix-cache hit on a free block needs; a deque cannot do it.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free KV block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        # (block id, hash) of each cached block evicted, while a KV connector saves evicted blocks elsewhere
        self.evicted: list[tuple[int, BlockHash]] | None = None
        self.observer: BlockPoolObserver | None = None  # attached only while someone listens (kv_events.py)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        if self.observer is not None:
            self.observer.on_allocated(blocks)
        return blocks

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue (it is no longer evictable)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
        if self.observer is not None and blocks:
            self.observer.on_touched(blocks)

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        if self.observer is not None:
            blocks_in_eviction_order = list(blocks_in_eviction_order)
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)
        if self.observer is not None:
            self.observer.on_freed(blocks_in_eviction_order)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash. If another block already holds that hash, keep the first."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.observer is not None:
            self.observer.on_stored(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        if self.evicted is not None:
            self.evicted.append((block.block_id, block.block_hash))
        if self.observer is not None:
            self.observer.on_removed(block, block.block_hash)
        block.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible while no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        if self.observer is not None:
            self.observer.on_cleared()
        return True
