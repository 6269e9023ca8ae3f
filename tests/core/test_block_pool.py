"""Unit tests of the physical block layer: FreeBlockQueue and BlockPool (pure Python, no model)."""
from __future__ import annotations

import pytest

from pagedserve.core.block_pool import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def queue_ids(pool_or_queue) -> list[int]:
    queue = pool_or_queue.free_queue if isinstance(pool_or_queue, BlockPool) else pool_or_queue
    return ids(queue)


def assert_pool_consistent(pool: BlockPool) -> None:
    """Free queue == exactly the ref-0 blocks; links are consistent; cached map agrees with block hashes."""
    in_queue = queue_ids(pool)
    assert len(in_queue) == len(set(in_queue)) == pool.num_free_blocks
    assert set(in_queue) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    for block in pool.blocks:
        if block.ref_cnt > 0:
            assert block.prev_free is None and block.next_free is None
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    assert pool.num_used_blocks == pool.num_blocks - pool.num_free_blocks


# ---------------------------------------------------------------------------- FreeBlockQueue
class TestFreeBlockQueue:
    def make(self, n: int) -> tuple[list[KVBlock], FreeBlockQueue]:
        blocks = [KVBlock(i) for i in range(n)]
        return blocks, FreeBlockQueue(blocks)

    def test_initial_order_and_count(self):
        _, q = self.make(5)
        assert queue_ids(q) == [0, 1, 2, 3, 4]
        assert q.num_free_blocks == 5

    def test_empty_queue(self):
        q = FreeBlockQueue([])
        assert q.num_free_blocks == 0
        assert list(q) == []
        with pytest.raises(ValueError):
            q.popleft()

    def test_popleft_takes_head_in_order(self):
        blocks, q = self.make(3)
        assert q.popleft() is blocks[0]
        assert q.popleft() is blocks[1]
        assert q.num_free_blocks == 1
        assert queue_ids(q) == [2]
        assert q.popleft() is blocks[2]
        assert q.num_free_blocks == 0
        with pytest.raises(ValueError):
            q.popleft()

    def test_popped_block_is_unlinked(self):
        _, q = self.make(2)
        b = q.popleft()
        assert b.prev_free is None and b.next_free is None

    def test_append_goes_to_tail(self):
        blocks, q = self.make(3)
        b0 = q.popleft()
        q.append(b0)
        assert queue_ids(q) == [1, 2, 0]
        assert q.num_free_blocks == 3

    def test_remove_from_middle_head_and_tail(self):
        blocks, q = self.make(5)
        q.remove(blocks[2])  # middle
        assert queue_ids(q) == [0, 1, 3, 4]
        q.remove(blocks[0])  # head
        assert queue_ids(q) == [1, 3, 4]
        q.remove(blocks[4])  # tail
        assert queue_ids(q) == [1, 3]
        assert q.num_free_blocks == 2
        for b in (blocks[0], blocks[2], blocks[4]):
            assert b.prev_free is None and b.next_free is None
        # the list is still usable at both ends
        q.append(blocks[2])
        assert queue_ids(q) == [1, 3, 2]
        assert q.popleft() is blocks[1]
        assert queue_ids(q) == [3, 2]

    def test_remove_only_element(self):
        blocks, q = self.make(1)
        q.remove(blocks[0])
        assert q.num_free_blocks == 0 and list(q) == []
        q.append(blocks[0])
        assert queue_ids(q) == [0]

    def test_remove_touches_only_the_neighbours(self):
        """O(1) removal: unlinking a middle block rewires its two neighbours and nothing else."""
        blocks, q = self.make(1_000)
        links = {b.block_id: (b.prev_free, b.next_free) for b in blocks}
        q.remove(blocks[500])
        changed = {b.block_id for b in blocks if (b.prev_free, b.next_free) != links[b.block_id]}
        assert changed == {499, 500, 501}
        assert blocks[499].next_free is blocks[501] and blocks[501].prev_free is blocks[499]
        assert q.num_free_blocks == 999

    def test_mixed_operations_match_a_reference_list(self):
        import random

        rng = random.Random(0)
        blocks, q = self.make(50)
        ref = list(range(50))
        for _ in range(2_000):
            op = rng.random()
            if op < 0.35 and ref:
                assert q.popleft().block_id == ref.pop(0)
            elif op < 0.7 and ref:
                victim = rng.choice(ref)
                q.remove(blocks[victim])
                ref.remove(victim)
            else:
                outside = [i for i in range(50) if i not in ref]
                if outside:
                    b = rng.choice(outside)
                    q.append(blocks[b])
                    ref.append(b)
            assert queue_ids(q) == ref
            assert q.num_free_blocks == len(ref)


# ---------------------------------------------------------------------------- BlockPool
class TestBlockPool:
    def test_initial_state(self):
        pool = BlockPool(4, enable_caching=True)
        assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
        assert queue_ids(pool) == [0, 1, 2, 3]
        assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
        assert_pool_consistent(pool)

    def test_get_new_blocks_takes_from_head(self):
        pool = BlockPool(5, enable_caching=True)
        got = pool.get_new_blocks(2)
        assert ids(got) == [0, 1]
        assert all(b.ref_cnt == 1 for b in got)
        assert queue_ids(pool) == [2, 3, 4]
        assert pool.num_free_blocks == 3 and pool.num_used_blocks == 2
        assert_pool_consistent(pool)

    def test_get_zero_blocks(self):
        pool = BlockPool(2, enable_caching=False)
        assert pool.get_new_blocks(0) == []
        assert pool.num_free_blocks == 2

    def test_get_new_blocks_raises_when_short_and_changes_nothing(self):
        pool = BlockPool(3, enable_caching=True)
        pool.get_new_blocks(2)
        with pytest.raises(ValueError):
            pool.get_new_blocks(2)
        assert queue_ids(pool) == [2]
        assert pool.blocks[2].ref_cnt == 0
        assert_pool_consistent(pool)

    def test_free_returns_to_tail_in_given_order(self):
        pool = BlockPool(5, enable_caching=True)
        a = pool.get_new_blocks(3)  # 0 1 2
        pool.free_blocks(reversed(a))
        assert queue_ids(pool) == [3, 4, 2, 1, 0]
        assert all(b.ref_cnt == 0 for b in a)
        # the next allocation takes the least recently freed first (LRU)
        assert ids(pool.get_new_blocks(3)) == [3, 4, 2]
        assert_pool_consistent(pool)

    def test_double_free_asserts(self):
        pool = BlockPool(2, enable_caching=True)
        (b,) = pool.get_new_blocks(1)
        pool.free_blocks([b])
        with pytest.raises(AssertionError):
            pool.free_blocks([b])

    def test_shared_block_returns_to_queue_only_at_ref_zero(self):
        pool = BlockPool(3, enable_caching=True)
        (b,) = pool.get_new_blocks(1)
        pool.touch([b])  # a second holder
        assert b.ref_cnt == 2
        pool.free_blocks([b])
        assert b.ref_cnt == 1 and b.block_id not in queue_ids(pool)
        pool.free_blocks([b])
        assert b.ref_cnt == 0 and queue_ids(pool)[-1] == b.block_id
        assert_pool_consistent(pool)

    def test_touch_removes_free_block_from_queue(self):
        pool = BlockPool(4, enable_caching=True)
        blocks = pool.get_new_blocks(4)
        pool.free_blocks(blocks)  # queue: 0 1 2 3
        pool.touch([pool.blocks[2]])
        assert pool.blocks[2].ref_cnt == 1
        assert queue_ids(pool) == [0, 1, 3]
        assert pool.num_free_blocks == 3
        # a touched block is never handed out again while referenced
        assert 2 not in ids(pool.get_new_blocks(3))
        assert_pool_consistent(pool)

    def test_touch_referenced_block_only_increments(self):
        pool = BlockPool(3, enable_caching=True)
        (b,) = pool.get_new_blocks(1)
        before = queue_ids(pool)
        pool.touch([b])
        assert b.ref_cnt == 2 and queue_ids(pool) == before

    def test_cached_block_keeps_hash_while_free(self):
        pool = BlockPool(3, enable_caching=True)
        (b,) = pool.get_new_blocks(1)
        pool.cache_block(b, b"h0")
        pool.free_blocks([b])
        assert b.ref_cnt == 0 and b.block_hash == b"h0"
        assert pool.get_cached_block(b"h0") is b
        assert pool.num_evictions == 0
        assert_pool_consistent(pool)

    def test_cached_free_block_can_be_revived_by_touch(self):
        pool = BlockPool(3, enable_caching=True)
        (b,) = pool.get_new_blocks(1)
        pool.cache_block(b, b"h0")
        pool.free_blocks([b])
        hit = pool.get_cached_block(b"h0")
        pool.touch([hit])
        assert hit.ref_cnt == 1 and hit.block_hash == b"h0"
        assert hit.block_id not in queue_ids(pool)
        assert pool.num_evictions == 0
        assert_pool_consistent(pool)

    def test_eviction_happens_only_on_reallocation(self):
        pool = BlockPool(2, enable_caching=True)
        b0, b1 = pool.get_new_blocks(2)
        pool.cache_block(b0, b"h0")
        pool.cache_block(b1, b"h1")
        pool.free_blocks([b1, b0])  # queue: 1 0 -> b1 is evicted first
        assert pool.num_evictions == 0
        (got,) = pool.get_new_blocks(1)
        assert got is b1
        assert got.block_hash is None
        assert pool.get_cached_block(b"h1") is None
        assert pool.get_cached_block(b"h0") is b0  # untouched
        assert pool.num_evictions == 1
        (got,) = pool.get_new_blocks(1)
        assert got is b0 and pool.get_cached_block(b"h0") is None
        assert pool.num_evictions == 2
        assert pool.cached_blocks == {}
        assert_pool_consistent(pool)

    def test_reallocating_uncached_block_is_not_an_eviction(self):
        pool = BlockPool(2, enable_caching=True)
        pool.free_blocks(pool.get_new_blocks(2))
        pool.get_new_blocks(2)
        assert pool.num_evictions == 0

    def test_eviction_only_takes_ref0_blocks(self):
        pool = BlockPool(4, enable_caching=True)
        blocks = pool.get_new_blocks(4)
        for i, b in enumerate(blocks):
            pool.cache_block(b, f"h{i}".encode())
        pool.free_blocks([blocks[0], blocks[2]])  # only 0 and 2 are evictable
        new = pool.get_new_blocks(2)
        assert set(ids(new)) == {0, 2}
        assert pool.get_cached_block(b"h1") is blocks[1]
        assert pool.get_cached_block(b"h3") is blocks[3]
        assert blocks[1].block_hash == b"h1" and blocks[3].block_hash == b"h3"
        with pytest.raises(ValueError):
            pool.get_new_blocks(1)
        assert_pool_consistent(pool)

    def test_cache_block_keeps_first_holder_of_a_hash(self):
        pool = BlockPool(3, enable_caching=True)
        a, b = pool.get_new_blocks(2)
        pool.cache_block(a, b"same")
        pool.cache_block(b, b"same")
        assert pool.get_cached_block(b"same") is a
        assert b.block_hash is None
        # evicting the duplicate does not drop the original's entry
        pool.free_blocks([b])
        pool.get_new_blocks(2)  # takes 2 then b
        assert pool.get_cached_block(b"same") is a
        assert pool.num_evictions == 0

    def test_cache_block_does_not_rehash_a_cached_block(self):
        pool = BlockPool(2, enable_caching=True)
        (a,) = pool.get_new_blocks(1)
        pool.cache_block(a, b"first")
        pool.cache_block(a, b"second")
        assert a.block_hash == b"first"
        assert pool.get_cached_block(b"second") is None

    def test_never_hands_out_a_referenced_block(self):
        import random

        rng = random.Random(1)
        pool = BlockPool(16, enable_caching=True)
        held: list[KVBlock] = []
        for step in range(3_000):
            r = rng.random()
            if r < 0.4 and pool.num_free_blocks:
                n = rng.randint(1, pool.num_free_blocks)
                new = pool.get_new_blocks(n)
                assert all(b.ref_cnt == 1 for b in new)
                assert not {id(b) for b in new} & {id(b) for b in held}
                for b in new:
                    if rng.random() < 0.5:
                        pool.cache_block(b, rng.randrange(8))
                held.extend(new)
            elif r < 0.55 and pool.cached_blocks:
                b = pool.get_cached_block(rng.choice(list(pool.cached_blocks)))
                pool.touch([b])
                held.append(b)
            elif held:
                b = held.pop(rng.randrange(len(held)))
                pool.free_blocks([b])
            assert sum(b.ref_cnt for b in pool.blocks) == len(held)
            assert_pool_consistent(pool)

    def test_reset_prefix_cache(self):
        pool = BlockPool(2, enable_caching=True)
        (a,) = pool.get_new_blocks(1)
        pool.cache_block(a, b"h")
        assert pool.reset_prefix_cache() is False  # a block is in use
        assert pool.get_cached_block(b"h") is a
        pool.free_blocks([a])
        assert pool.reset_prefix_cache() is True
        assert pool.cached_blocks == {} and a.block_hash is None
