"""Per-request block tables on top of the block pool; `allocate_slots` is the one gate for all KV.

A hybrid model (core/kv_cache_groups.py) has one block table per KV cache group, all drawn from the one pool. A
sliding-window group keeps only the blocks its window still reaches: as a request advances, the blocks wholly
before the window of its next computed position go back to the pool (registered in the prefix cache, they stay
hittable until evicted) and the null block takes their place in the table (a block id past the pool's, never
written; attention never reads it unmasked). A prefix hit is as long as every group allows: a full group's chain
of cached blocks from the start, a sliding group's cached blocks covering the window before the hit's end (vLLM's
rule); each group's blocks are keyed by the token hash and the group.

A model with no KV cache groups (an encoder: its K/V are never read after the step that computes them) keeps no KV
at all: the pool is empty, every request's table stays empty and allocate_slots always succeeds.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.core.block_pool import HASH_FUNCTIONS, BlockHash, BlockPool, KVBlock
from pagedserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    blocks: list[KVBlock]  # group 0's
    num_tokens: int
    group_blocks: list[list[KVBlock]] = field(default_factory=list)  # groups 1.. (a hybrid model's), when it hit


NO_HIT = PrefixHit([], 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "sha256", sliding_windows: Sequence[int | None] = (None,)) -> None:
        """sliding_windows: one per KV cache group (None: full attention); the model's groups, in their order (none:
        the model keeps no KV, num_blocks 0)."""
        self.block_size = block_size
        self.sliding_windows = tuple(sliding_windows)
        self.null_block = KVBlock(num_blocks, ref_cnt=1)  # the runner allocates one block past the pool for it
        self.enable_caching = enable_caching
        self.hash_fn = HASH_FUNCTIONS[hash_algo]
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.group_req_to_blocks: list[dict[str, list[KVBlock]]] = [{} for _ in self.sliding_windows]
        self.req_to_blocks = self.group_req_to_blocks[0] if self.group_req_to_blocks else {}
        # per group: leading blocks of each request's table replaced by the null block (sliding groups only)
        self._num_skipped: list[dict[str, int]] = [{} for _ in self.sliding_windows]
        # how many leading blocks of each request are registered in the prefix cache
        self.num_cached_blocks: dict[str, int] = {}
        # full blocks scheduled but not yet written (registered only once written): hash -> request ids
        self.pending_hashes: dict[BlockHash, set[str]] = {}
        self._pending_of: dict[str, list[BlockHash]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # KV connector: (block id, hash) of written blocks to save outside the pool (see set_save_policy)
        self.save_policy: str | None = None
        self.blocks_to_save: list[tuple[int, BlockHash]] = []

    def set_save_policy(self, policy: str | None) -> None:
        """None: nothing leaves the pool. "evict": a cached block is queued for saving when the LRU evicts it
        (it must be saved before the forward that overwrites it). "write_through": every block once written."""
        self.save_policy = policy
        self.block_pool.evicted = self.blocks_to_save if policy == "evict" else None

    def take_blocks_to_save(self) -> list[tuple[int, BlockHash]]:
        blocks = self.blocks_to_save[:]
        self.blocks_to_save.clear()
        return blocks

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.num_used_blocks / max(self.block_pool.num_blocks, 1)

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    def block_ids(self, request_id: str) -> list[int]:
        """Group 0's block table (the null block's id where a sliding group 0 dropped blocks)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The block tables of groups 1.. (none for a model with one group)."""
        return [[b.block_id for b in m.get(request_id, ())] for m in self.group_req_to_blocks[1:]]

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest prefix of the request's tokens whose K/V every group holds in cached full blocks.

        At least the last token is left to compute: its logits are what the next sample needs.
        Pure lookup: no reference is taken until allocate_slots.
        """
        # prompt logprobs come from the prefill's logits: a request asking them computes its whole prompt
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return NO_HIT
        self._update_block_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        n = len(hashes)
        for g, window in enumerate(self.sliding_windows):
            if window is None:
                n = self._full_hit(g, hashes[:n])
        # a shorter hit needs another window of blocks: shrink until every sliding group has its window
        changed = True
        while changed and n:
            changed = False
            for g, window in enumerate(self.sliding_windows):
                if window is not None:
                    m = self._sliding_hit(g, hashes, n, window)
                    changed, n = changed or m < n, m
        groups = [self._hit_blocks(g, hashes[:n]) for g in range(self.num_groups)] if n else [[]]
        return PrefixHit(groups[0], n * self.block_size, groups[1:])

    def _cached(self, g: int, block_hash: BlockHash) -> KVBlock | None:
        return self.block_pool.get_cached_block(self._group_key(g, block_hash))

    def _group_key(self, g: int, block_hash: BlockHash) -> BlockHash:
        """Group 0's blocks are keyed by the token hash itself (what KV events and the KV connector see); another
        group's by that hash chained with the group's index."""
        return block_hash if g == 0 else self.hash_fn(block_hash, (), ("kv_group", g))

    def _full_hit(self, g: int, hashes: Sequence[BlockHash]) -> int:
        for i, block_hash in enumerate(hashes):
            if self._cached(g, block_hash) is None:
                return i
        return len(hashes)

    def _sliding_hit(self, g: int, hashes: Sequence[BlockHash], n: int, window: int) -> int:
        """The longest hit of at most n blocks whose last cdiv(window - 1, block_size) blocks (the keys the next
        position's window reaches) are cached in group g; scanned from the end, as vLLM's SlidingWindowManager."""
        need = cdiv(window - 1, self.block_size)
        run = 0
        for i in range(n - 1, -1, -1):
            if run == need:
                break
            run = run + 1 if self._cached(g, hashes[i]) is not None else 0
        else:
            return run  # the blocks from the first on: a hit shorter than a window, all cached (or none)
        return i + 1 + need

    def _hit_blocks(self, g: int, hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """Group g's blocks of a hit of len(hashes) blocks: the null block before a sliding group's window."""
        window = self.sliding_windows[g]
        skip = 0 if window is None else max(len(hashes) * self.block_size - window + 1, 0) // self.block_size
        return [self.null_block] * skip + [self._cached(g, h) for h in hashes[skip:]]

    def prefix_in_flight(self, request: Request, hit: PrefixHit) -> bool:
        """Whether the first block after the request's cached chain (`hit`, from get_computed_blocks) is being
        written by a running request. Waiting a step lets it hit that block (n > 1 samples, identical prompts
        arriving together) instead of computing it again; blocks are registered only once written, so it cannot
        hit them in this step."""
        if not self.pending_hashes or request.sampling_params.prompt_logprobs is not None:
            return False
        index = len(hit.blocks)
        return index < (request.num_tokens - 1) // self.block_size and \
            request.block_hashes[index] in self.pending_hashes

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix_hit: PrefixHit = NO_HIT,
                       num_lookahead_tokens: int = 0) -> list[KVBlock] | None:
        """Give the request room for `num_new_tokens` more tokens (after any prefix hit; draft tokens included),
        plus `num_lookahead_tokens` slots a draft model writes its proposals' K/V to.

        Returns the newly allocated blocks, or None, changing nothing, when the pool is short.
        """
        if not self.num_groups:  # no KV kept: nothing to allocate
            return []
        request_id = request.request_id
        tables = [m.setdefault(request_id, []) for m in self.group_req_to_blocks]
        admitted = bool(tables[0])  # holds blocks already (else: first admission, or after preemption)
        first_new = request.num_computed_tokens + prefix_hit.num_tokens  # the first position this step computes
        for g, window in enumerate(self.sliding_windows):
            if window is not None and admitted:
                self._free_behind_window(g, request_id, tables[g], first_new - window + 1)
        num_tokens_after = first_new + num_new_tokens
        num_slots = num_tokens_after + num_lookahead_tokens
        hits = [prefix_hit.blocks, *prefix_hit.group_blocks] if prefix_hit.group_blocks \
            else [prefix_hit.blocks] + [[]] * (self.num_groups - 1)
        hit_blocks = [b for blocks in hits for b in blocks if b is not self.null_block]
        num_new_blocks = [max(cdiv(num_slots, self.block_size) - len(table) - len(hit), 0)
                          for table, hit in zip(tables, hits)]
        # Hit blocks with no holder sit in the free queue: taking them shrinks what is free.
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if sum(num_new_blocks) > self.block_pool.num_free_blocks - num_free_hits:
            if not admitted:
                for m in self.group_req_to_blocks:
                    del m[request_id]
            return None
        if self.enable_caching and not admitted:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += prefix_hit.num_tokens
            self.num_cached_blocks[request_id] = len(prefix_hit.blocks)  # already registered
        self.block_pool.touch(hit_blocks)
        new_blocks = []
        for g, (table, hit, n) in enumerate(zip(tables, hits, num_new_blocks)):
            table.extend(hit)
            if hit and hit[0] is self.null_block:
                self._num_skipped[g][request_id] = hit.count(self.null_block)
            blocks = self.block_pool.get_new_blocks(n)
            table.extend(blocks)
            new_blocks += blocks
        if self.enable_caching:
            self._mark_pending(request, min(num_tokens_after, request.num_tokens) // self.block_size)
        return new_blocks

    def _free_behind_window(self, g: int, request_id: str, table: list[KVBlock], first_needed: int) -> None:
        """Sliding group g: the blocks wholly before position `first_needed` (the first key the step's window
        reaches) go back to the pool, oldest first, and the null block takes their place in the table."""
        end = min(max(first_needed, 0) // self.block_size, len(table))
        start = self._num_skipped[g].get(request_id, 0)
        if end <= start:
            return
        self.block_pool.free_blocks(table[start:end])
        table[start:end] = [self.null_block] * (end - start)
        self._num_skipped[g][request_id] = end

    def _mark_pending(self, request: Request, num_full: int) -> None:
        start = self.num_cached_blocks.get(request.request_id, 0) + len(self._pending_of.get(request.request_id, ()))
        if num_full <= start:
            return
        self._update_block_hashes(request)
        mine = self._pending_of.setdefault(request.request_id, [])
        for block_hash in request.block_hashes[start:num_full]:
            self.pending_hashes.setdefault(block_hash, set()).add(request.request_id)
            mine.append(block_hash)

    def _clear_pending(self, request_id: str) -> None:
        for block_hash in self._pending_of.pop(request_id, ()):
            holders = self.pending_hashes.get(block_hash)
            if holders is not None:
                holders.discard(request_id)
                if not holders:
                    del self.pending_hashes[block_hash]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to `num_computed_tokens` in the prefix cache.

        Called after the forward that wrote their K/V, never at scheduling: if that forward fails, no
        prefix lookup can find a block whose K/V was never written.
        """
        if not self.enable_caching or request.request_id not in self.req_to_blocks:
            return
        self._clear_pending(request.request_id)  # whatever was scheduled is written now
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for g, m in enumerate(self.group_req_to_blocks):
            blocks = m[request.request_id]
            for i in range(start, num_full):
                if blocks[i] is not self.null_block:  # (a sliding group's block behind the window: cached before)
                    self.block_pool.cache_block(blocks[i], self._group_key(g, request.block_hashes[i]))
        if self.save_policy == "write_through":
            blocks = self.req_to_blocks[request.request_id]
            self.blocks_to_save += [(blocks[i].block_id, request.block_hashes[i]) for i in range(start, num_full)]
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first: under pressure its tail is evicted before its head."""
        self.num_cached_blocks.pop(request.request_id, None)
        self._clear_pending(request.request_id)
        for m, skipped in zip(self.group_req_to_blocks, self._num_skipped):
            blocks = m.pop(request.request_id, [])
            self.block_pool.free_blocks(reversed(blocks[skipped.pop(request.request_id, 0):]))

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            # The salt and the LoRA adapter enter the first block's key; the chain carries them to every later block.
            extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else ()
            if i == 0 and request.lora_request is not None:  # (salt, adapter): never a salt's key alone
                extra = (request.cache_salt, request.lora_request.cache_key)
            hashes.append(self.hash_fn(parent, request.all_token_ids[i * bs:(i + 1) * bs], extra))

    def stored_and_allocated(self, requests: list[Request]) -> tuple[int, int]:
        """(token slots holding K/V, token slots allocated) over the distinct blocks these requests hold."""
        filled: dict[int, int] = {}
        for request in requests:
            for m in self.group_req_to_blocks:
                for i, block in enumerate(m.get(request.request_id, ())):
                    if block is not self.null_block:
                        n = min(self.block_size, max(request.num_computed_tokens - i * self.block_size, 0))
                        filled[block.block_id] = max(filled.get(block.block_id, 0), n)
        return sum(filled.values()), len(filled) * self.block_size
