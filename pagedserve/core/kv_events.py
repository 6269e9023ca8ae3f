"""What the block pool did, for whoever listens: per-block state changes and vLLM-compatible KV-cache events.

The pool calls a `BlockPoolObserver` only while one is attached (`BlockPool.observer`); with none attached the
hooks cost one attribute test per pool call. `KVEventCollector` is the observer the engine's event recorder
attaches while someone listens: it gathers, per engine step, the block ids whose state changed, counts of
allocated / freed / stored / evicted / prefix-hit blocks, and the KV-cache events a KV-aware router consumes,
with vLLM's names and fields (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.core.block_pool import BlockHash, KVBlock


class BlockState(enum.IntEnum):
    """What a dashboard paints for one physical block."""
    FREE = 0  # ref count 0, no cached prefix
    CACHED = 1  # ref count 0 but holds a cached prefix: reusable by a hit until the allocator evicts it
    IN_USE = 2  # held by one sequence
    SHARED = 3  # held by several sequences (n > 1 samples, a shared prefix)


def block_state(block: KVBlock) -> BlockState:
    if block.ref_cnt > 1:
        return BlockState.SHARED
    if block.ref_cnt == 1:
        return BlockState.IN_USE
    return BlockState.CACHED if block.block_hash is not None else BlockState.FREE


def encode_block_hash(block_hash: BlockHash | None) -> str | int | None:
    """JSON form of a block hash: hex for sha256 bytes, the int itself for the builtin hash."""
    return block_hash.hex() if isinstance(block_hash, bytes) else block_hash


# ------------------------------------------------------------------------ vLLM-compatible KV-cache events
@dataclass
class BlockStored:
    """Blocks newly registered in the prefix cache (vLLM's fields; lora_id: the LoRA adapter's id, None for the base
    model; medium is always None here)."""
    block_hashes: list[str | int]
    parent_block_hash: str | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass
class BlockRemoved:
    """Cached blocks whose hash was dropped (evicted to reuse the block)."""
    block_hashes: list[str | int]
    medium: str | None = None


@dataclass
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPoolObserver(Protocol):
    def on_allocated(self, blocks: Sequence[KVBlock]) -> None: ...
    def on_touched(self, blocks: Sequence[KVBlock]) -> None: ...  # prefix-cache hits take a reference
    def on_freed(self, blocks: Sequence[KVBlock]) -> None: ...  # a reference dropped (maybe not the last)
    def on_stored(self, block: KVBlock) -> None: ...  # its hash is registered now
    def on_removed(self, block: KVBlock, block_hash: BlockHash) -> None: ...  # its hash was evicted
    def on_cleared(self) -> None: ...


@dataclass
class KVStepDelta:
    """What the pool did during one engine step."""
    num_allocated: int = 0
    num_freed: int = 0  # blocks whose last reference was dropped
    num_stored: int = 0
    num_evicted: int = 0
    num_hit_blocks: int = 0
    changed: list[tuple[int, int]] = field(default_factory=list)  # (block id, BlockState) after the step
    stored_hashes: list[BlockHash] = field(default_factory=list)  # in registration order
    removed_hashes: list[BlockHash] = field(default_factory=list)
    cleared: bool = False


class KVEventCollector:
    """A BlockPoolObserver that accumulates one step's changes; `take()` hands them over and resets.

    It keeps every block's last reported state, so a step reports only the blocks whose state really changed and
    the count of blocks in each state costs O(changed blocks), not O(pool).
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._blocks = blocks
        self.states = [int(block_state(b)) for b in blocks]
        self.counts = [0] * len(BlockState)
        for state in self.states:
            self.counts[state] += 1
        self._delta = KVStepDelta()
        self._dirty: set[int] = set()

    def on_allocated(self, blocks: Sequence[KVBlock]) -> None:
        self._delta.num_allocated += len(blocks)
        self._dirty.update(b.block_id for b in blocks)

    def on_touched(self, blocks: Sequence[KVBlock]) -> None:
        self._delta.num_hit_blocks += len(blocks)
        self._dirty.update(b.block_id for b in blocks)

    def on_freed(self, blocks: Sequence[KVBlock]) -> None:
        self._delta.num_freed += sum(1 for b in blocks if b.ref_cnt == 0)
        self._dirty.update(b.block_id for b in blocks)

    def on_stored(self, block: KVBlock) -> None:
        self._delta.num_stored += 1
        self._delta.stored_hashes.append(block.block_hash)
        self._dirty.add(block.block_id)

    def on_removed(self, block: KVBlock, block_hash: BlockHash) -> None:
        self._delta.num_evicted += 1
        self._delta.removed_hashes.append(block_hash)
        self._dirty.add(block.block_id)

    def on_cleared(self) -> None:
        self._delta.cleared = True

    def take(self) -> KVStepDelta:
        delta, self._delta = self._delta, KVStepDelta()
        ids = range(len(self._blocks)) if delta.cleared else sorted(self._dirty)
        self._dirty = set()
        for i in ids:
            state = int(block_state(self._blocks[i]))
            if state != self.states[i]:
                self.counts[self.states[i]] -= 1
                self.counts[state] += 1
                self.states[i] = state
                delta.changed.append((i, state))
        return delta
