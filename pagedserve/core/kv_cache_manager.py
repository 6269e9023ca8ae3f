"""Per-request block tables on top of the block pool; `allocate_slots` is the one gate for all KV."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.block_pool import HASH_FUNCTIONS, BlockHash, BlockPool, KVBlock
from pagedserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    blocks: list[KVBlock]
    num_tokens: int


NO_HIT = PrefixHit([], 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "sha256") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = HASH_FUNCTIONS[hash_algo]
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
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
        return self.block_pool.num_used_blocks / self.block_pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest chain of cached full blocks that starts the request's tokens.

        At least the last token is left to compute: its logits are what the next sample needs.
        Pure lookup: no reference is taken until allocate_slots.
        """
        # prompt logprobs come from the prefill's logits: a request asking them computes its whole prompt
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return NO_HIT
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks, len(blocks) * self.block_size)

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
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_tokens_after = request.num_computed_tokens + prefix_hit.num_tokens + num_new_tokens
        num_slots = num_tokens_after + num_lookahead_tokens
        num_new_blocks = cdiv(num_slots, self.block_size) - len(blocks) - len(prefix_hit.blocks)
        # Hit blocks with no holder sit in the free queue: taking them shrinks what is free.
        num_free_hits = sum(1 for b in prefix_hit.blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if self.enable_caching and not blocks:  # admission (first, or after preemption)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += prefix_hit.num_tokens
            self.num_cached_blocks[request.request_id] = len(prefix_hit.blocks)  # already registered
        self.block_pool.touch(prefix_hit.blocks)
        blocks.extend(prefix_hit.blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._mark_pending(request, min(num_tokens_after, request.num_tokens) // self.block_size)
        return new_blocks

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
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        if self.save_policy == "write_through":
            self.blocks_to_save += [(blocks[i].block_id, request.block_hashes[i]) for i in range(start, num_full)]
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first: under pressure its tail is evicted before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self._clear_pending(request.request_id)
        self.block_pool.free_blocks(reversed(blocks))

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            # The salt enters the first block's key; the chain carries it to every later block.
            extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else ()
            hashes.append(self.hash_fn(parent, request.all_token_ids[i * bs:(i + 1) * bs], extra))

    def stored_and_allocated(self, requests: list[Request]) -> tuple[int, int]:
        """(token slots holding K/V, token slots allocated) over the distinct blocks these requests hold."""
        filled: dict[int, int] = {}
        for request in requests:
            for i, block in enumerate(self.req_to_blocks.get(request.request_id, ())):
                n = min(self.block_size, max(request.num_computed_tokens - i * self.block_size, 0))
                filled[block.block_id] = max(filled.get(block.block_id, 0), n)
        return sum(filled.values()), len(filled) * self.block_size
