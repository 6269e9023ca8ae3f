"""Unit tests of KVCacheManager: block tables, allocate_slots, free order, prefix caching, stats."""
from __future__ import annotations

import hashlib
import itertools
import os
import struct
import subprocess
import sys

import pytest

from pagedserve.core.block_pool import builtin_block_hash, sha256_block_hash
from pagedserve.core.kv_cache_manager import KVCacheManager, PrefixHit, cdiv
from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams

HASH_ALGOS = ["sha256", "builtin"]
_ids = itertools.count()


def make_request(tokens, request_id: str | None = None, cache_salt: str | None = None,
                 max_tokens: int = 16) -> Request:
    return Request(request_id or f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens),
                   max_tokens, cache_salt=cache_salt)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None):
    """Admission as the scheduler does it: lookup, allocate the rest (or `num_new`), then 'run' the chunk."""
    hit = kv.get_computed_blocks(request)
    n = request.num_tokens - hit.num_tokens if num_new is None else num_new
    new = kv.allocate_slots(request, n, hit)
    if new is not None:
        request.num_computed_tokens = hit.num_tokens + n
        kv.cache_blocks(request, request.num_computed_tokens)  # the forward wrote them
    return hit, new


def decode(kv: KVCacheManager, request: Request, token: int):
    """One decode step: append a sampled token, allocate its slot, 'run' it."""
    request.append_output_token(token)
    new = kv.allocate_slots(request, 1)
    if new is not None:
        request.num_computed_tokens += 1
        kv.cache_blocks(request, request.num_computed_tokens)
    return new


def snapshot(kv: KVCacheManager):
    pool = kv.block_pool
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        [b.block_id for b in pool.free_queue],
        pool.num_free_blocks,
        dict(pool.cached_blocks),
        {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_to_blocks.items()},
        dict(kv.num_cached_blocks),
        kv.prefix_cache_queries,
        kv.prefix_cache_hits,
        pool.num_evictions,
    )


def free_queue_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_queue]


# ---------------------------------------------------------------------------- allocation
@pytest.mark.parametrize("num_tokens,block_size", [(1, 4), (4, 4), (5, 4), (10, 4), (16, 16), (17, 16), (7, 1)])
def test_allocate_ceil_blocks(num_tokens, block_size):
    kv = KVCacheManager(64, block_size, enable_caching=False)
    r = make_request(range(num_tokens))
    new = kv.allocate_slots(r, num_tokens)
    assert len(new) == cdiv(num_tokens, block_size)
    assert kv.block_ids(r.request_id) == [b.block_id for b in new]
    assert kv.num_free_blocks == 64 - len(new)
    assert all(b.ref_cnt == 1 for b in new)


def test_allocate_incrementally_for_chunks_and_decodes():
    kv = KVCacheManager(16, 4, enable_caching=False)
    r = make_request(range(10))
    assert len(admit(kv, r, num_new=3)[1]) == 1  # tokens 0..2 -> 1 block
    assert len(admit_more(kv, r, 5)) == 1  # tokens 3..7 -> block 2 (8 slots)
    assert len(admit_more(kv, r, 2)) == 1  # 8..9 -> 3 blocks
    assert len(kv.block_ids(r.request_id)) == 3
    assert decode(kv, r, 100) == []  # token 10 fits block 2 (slots 8..11)
    assert decode(kv, r, 101) == []  # token 11
    assert len(decode(kv, r, 102)) == 1  # token 12 needs block 3
    assert len(kv.block_ids(r.request_id)) == 4


def admit_more(kv: KVCacheManager, request: Request, n: int):
    new = kv.allocate_slots(request, n)
    request.num_computed_tokens += n
    kv.cache_blocks(request, request.num_computed_tokens)
    return new


def test_block_ids_of_unknown_request_is_empty():
    kv = KVCacheManager(4, 4)
    assert kv.block_ids("nope") == []


@pytest.mark.parametrize("enable_caching", [True, False])
def test_allocate_returns_none_and_changes_nothing_for_new_request(enable_caching):
    kv = KVCacheManager(4, 4, enable_caching=enable_caching)
    a = make_request(range(10))
    admit(kv, a)  # 3 blocks
    before = snapshot(kv)
    b = make_request(range(100, 108))  # needs 2 blocks, 1 free
    hit, new = admit(kv, b)
    assert new is None
    assert snapshot(kv) == before
    assert b.request_id not in kv.req_to_blocks
    assert kv.block_ids(b.request_id) == []


def test_allocate_returns_none_and_changes_nothing_for_running_request():
    kv = KVCacheManager(4, 4)
    a = make_request(range(8))
    b = make_request(range(100, 106))
    admit(kv, a)  # 2 blocks
    admit(kv, b)  # 2 blocks, pool full
    before = snapshot(kv)
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1) is None
    assert snapshot(kv) == before
    assert kv.block_ids(a.request_id) == before[5][a.request_id]  # its table is kept


def test_allocate_none_with_free_prefix_hits_changes_nothing():
    """Hit blocks sitting in the free queue count against what is free; a refusal leaves them there."""
    kv = KVCacheManager(4, 4)
    a = make_request(range(9))  # 3 blocks, 2 full ones get cached
    admit(kv, a)
    kv.free(a)
    before = snapshot(kv)
    b = make_request(list(range(9)) + list(range(50, 58)))  # 17 tokens: 5 blocks, 2 hit, 3 new; only 2 left
    hit, new = admit(kv, b)
    assert hit.num_tokens == 8 and new is None
    assert snapshot(kv) == before
    assert all(blk.ref_cnt == 0 and blk.block_hash is not None for blk in hit.blocks)

    # one token shorter fits exactly: 4 blocks = 2 hits + 2 new
    c = make_request(list(range(9)) + list(range(50, 57)))
    hit, new = admit(kv, c)
    assert hit.num_tokens == 8 and len(new) == 2
    assert kv.num_free_blocks == 0
    assert kv.block_ids(c.request_id)[:2] == [blk.block_id for blk in hit.blocks]


# ---------------------------------------------------------------------------- free
def test_free_releases_everything_in_reverse_order():
    kv = KVCacheManager(6, 4, enable_caching=False)
    a = make_request(range(14))  # 4 blocks: 0 1 2 3
    admit(kv, a)
    assert kv.block_ids(a.request_id) == [0, 1, 2, 3]
    kv.free(a)
    assert kv.block_ids(a.request_id) == []
    assert a.request_id not in kv.req_to_blocks and a.request_id not in kv.num_cached_blocks
    assert kv.num_free_blocks == 6
    # free blocks 4 5 untouched at the head, then a's blocks last-first: its tail is evicted before its head
    assert free_queue_ids(kv) == [4, 5, 3, 2, 1, 0]


def test_free_unknown_request_is_noop():
    kv = KVCacheManager(2, 4)
    kv.free(make_request([1, 2]))
    assert kv.num_free_blocks == 2


def test_last_block_is_evicted_before_first():
    kv = KVCacheManager(3, 4)
    a = make_request(range(12))  # 3 full blocks, all cached
    admit(kv, a)
    assert len(kv.block_pool.cached_blocks) == 3
    kv.free(a)
    assert free_queue_ids(kv) == [2, 1, 0]
    other = make_request(range(100, 103))  # a partial block: it registers nothing itself
    admit(kv, other)  # takes a's last block
    assert kv.block_ids(other.request_id) == [2]
    assert kv.block_pool.num_evictions == 1
    assert kv.block_pool.blocks[0].block_hash == a.block_hashes[0]
    assert kv.block_pool.blocks[1].block_hash == a.block_hashes[1]
    assert kv.block_pool.blocks[2].block_hash is None
    assert kv.block_pool.get_cached_block(a.block_hashes[2]) is None


# ---------------------------------------------------------------------------- prefix caching
@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_same_prompt_hits_all_full_blocks(algo):
    kv = KVCacheManager(16, 4, hash_algo=algo)
    a = make_request(range(10))
    admit(kv, a)
    b = make_request(range(10))
    hit, new = admit(kv, b)
    assert hit.num_tokens == 8
    assert [blk.block_id for blk in hit.blocks] == kv.block_ids(a.request_id)[:2]
    assert len(new) == 1  # the partial third block is b's own
    assert kv.block_ids(b.request_id)[:2] == kv.block_ids(a.request_id)[:2]
    assert kv.block_ids(b.request_id)[2] != kv.block_ids(a.request_id)[2]
    assert [blk.ref_cnt for blk in hit.blocks] == [2, 2]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_block_aligned_prompt_leaves_last_token_to_compute(algo):
    kv = KVCacheManager(16, 4, hash_algo=algo)
    a = make_request(range(8))
    admit(kv, a)
    assert len(kv.block_pool.cached_blocks) == 2
    b = make_request(range(8))
    hit, new = admit(kv, b)
    assert hit.num_tokens == 4  # not 8: the last token must be computed for its logits
    assert len(new) == 1
    assert b.num_computed_tokens == 8


def test_single_block_prompt_never_hits():
    kv = KVCacheManager(8, 4)
    admit(kv, make_request(range(4)))
    hit, _ = admit(kv, make_request(range(4)))
    assert hit.num_tokens == 0 and hit.blocks == []


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_partial_block_prefix_does_not_hit(algo):
    kv = KVCacheManager(16, 4, hash_algo=algo)
    a = make_request(range(3))  # no full block
    admit(kv, a)
    assert kv.block_pool.cached_blocks == {}
    b = make_request(list(range(3)) + [90, 91, 92, 93, 94])
    hit, _ = admit(kv, b)
    assert hit.num_tokens == 0

    c = make_request(range(6))  # one full block + 2
    admit(kv, c)
    d = make_request(list(range(6)) + [70, 71, 72, 73])
    hit, _ = admit(kv, d)
    assert hit.num_tokens == 4  # only the full block, not the 6 shared tokens


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_cache_salt_isolation(algo):
    kv = KVCacheManager(32, 4, hash_algo=algo)
    admit(kv, make_request(range(10), cache_salt="alice"))
    assert admit(kv, make_request(range(10), cache_salt="bob"))[0].num_tokens == 0
    assert admit(kv, make_request(range(10)))[0].num_tokens == 0  # no salt vs salt
    assert admit(kv, make_request(range(10), cache_salt=""))[0].num_tokens == 0  # empty salt != no salt
    assert admit(kv, make_request(range(10), cache_salt="alice"))[0].num_tokens == 8
    # an unsalted prompt is cached too and only hit by unsalted requests
    assert admit(kv, make_request(range(10)))[0].num_tokens == 8


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_salt_changes_every_block_hash(algo):
    kv = KVCacheManager(32, 4, hash_algo=algo)
    a, b = make_request(range(12), cache_salt="s1"), make_request(range(12), cache_salt="s2")
    kv.get_computed_blocks(a)
    kv.get_computed_blocks(b)
    assert len(a.block_hashes) == 3
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes))


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hashes_are_chained(algo):
    kv = KVCacheManager(32, 4, hash_algo=algo)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    a = make_request(x + y + [0])
    admit(kv, a)
    b = make_request(z + y + [0])  # same second block after a different first one
    hit, _ = admit(kv, b)
    assert hit.num_tokens == 0
    assert b.block_hashes[1] != a.block_hashes[1]
    # the second block alone at the start of a prompt does not hit either
    c = make_request(y + [0, 0, 0, 0, 0])
    assert admit(kv, c)[0].num_tokens == 0
    # identical token blocks at different positions hash differently
    d = make_request(x + x + x)
    kv.get_computed_blocks(d)
    assert len(set(d.block_hashes)) == 3


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hit_on_blocks_freed_by_finished_request(algo):
    kv = KVCacheManager(8, 4, hash_algo=algo)
    a = make_request(range(10))
    admit(kv, a)
    a_blocks = kv.block_ids(a.request_id)
    kv.free(a)
    assert kv.num_free_blocks == 8
    b = make_request(list(range(10)) + [42])
    hit, new = admit(kv, b)
    assert hit.num_tokens == 8
    assert [blk.block_id for blk in hit.blocks] == a_blocks[:2]
    assert all(blk.ref_cnt == 1 for blk in hit.blocks)
    assert not {blk.block_id for blk in hit.blocks} & set(free_queue_ids(kv))
    assert kv.num_free_blocks == 8 - 3
    assert kv.block_pool.num_evictions == 0


def test_decoded_tokens_become_cacheable():
    kv = KVCacheManager(8, 4)
    a = make_request([1, 2, 3])
    admit(kv, a)
    assert kv.block_pool.cached_blocks == {}
    decode(kv, a, 4)  # tokens [1 2 3 4] fill block 0
    assert len(kv.block_pool.cached_blocks) == 1
    b = make_request([1, 2, 3, 4, 5])
    assert admit(kv, b)[0].num_tokens == 4


def test_hit_after_partial_eviction_keeps_only_leading_chain():
    kv = KVCacheManager(4, 4)
    a = make_request(range(13))  # blocks 0..3; 3 full ones cached
    admit(kv, a)
    kv.free(a)
    assert free_queue_ids(kv) == [3, 2, 1, 0]
    other = make_request(range(100, 106))  # takes 3 (uncached) and 2 (a's third full block)
    admit(kv, other)
    assert kv.block_ids(other.request_id) == [3, 2]
    assert kv.block_pool.num_evictions == 1
    kv.free(other)
    b = make_request(range(13))
    hit, _ = admit(kv, b)
    assert hit.num_tokens == 8
    assert [blk.block_id for blk in hit.blocks] == [0, 1]


def test_evicted_first_block_breaks_the_whole_chain():
    kv = KVCacheManager(4, 4)
    a = make_request(range(13))
    admit(kv, a)
    kv.free(a)
    pool = kv.block_pool
    # evict only a's first block: hold every other free block, then allocate one
    others = [b for b in pool.free_queue if b.block_id != 0]
    pool.touch(others)
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 0 and pool.num_evictions == 1
    pool.free_blocks([evicted])
    pool.free_blocks(others)
    assert pool.blocks[1].block_hash is not None and pool.blocks[2].block_hash is not None
    b = make_request(range(13))
    hit, _ = admit(kv, b)
    assert hit.num_tokens == 0


def test_scheduled_blocks_are_registered_only_once_written():
    """A block's hash is registered after the forward wrote its K/V: if that forward fails, nothing that was
    never written can be found by a prefix lookup."""
    kv = KVCacheManager(8, 4)
    a = make_request(range(10))
    kv.allocate_slots(a, 10)  # scheduled, not yet computed
    b = make_request(range(10))
    assert kv.get_computed_blocks(b).num_tokens == 0
    assert kv.block_pool.cached_blocks == {}
    kv.cache_blocks(a, 6)  # the forward wrote 6 tokens: one full block
    assert kv.get_computed_blocks(b).num_tokens == 4
    kv.cache_blocks(a, 10)
    assert kv.get_computed_blocks(b).num_tokens == 8
    kv.free(a)  # a failed request's unwritten blocks go back unhashed
    c = make_request(range(10))
    kv.allocate_slots(c, 10)
    kv.free(c)
    assert len(kv.block_pool.cached_blocks) == 2


def test_chunked_prefill_registers_only_covered_full_blocks():
    kv = KVCacheManager(8, 4)
    a = make_request(range(12))
    admit(kv, a, num_new=5)  # block 0 full, block 1 has 1 token
    assert len(kv.block_pool.cached_blocks) == 1
    assert kv.num_cached_blocks[a.request_id] == 1
    admit_more(kv, a, 7)
    assert len(kv.block_pool.cached_blocks) == 3
    assert kv.num_cached_blocks[a.request_id] == 3


def test_caching_disabled_never_hits_or_registers():
    kv = KVCacheManager(8, 4, enable_caching=False)
    a = make_request(range(10))
    admit(kv, a)
    hit, _ = admit(kv, make_request(range(10)))
    assert hit.num_tokens == 0
    assert kv.block_pool.cached_blocks == {}
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0


# ---------------------------------------------------------------------------- hashes
def documented_sha256_block_hash(parent: bytes | None, token_ids: list[int], extra_keys: tuple) -> bytes:
    """The serialization the sha256 block hash documents, written out independently: the parent's 32-byte digest
    (zeros for the first block), the token ids as little-endian int64, then 0x1f + str(key) in UTF-8 per extra key."""
    data = (parent or bytes(32)) + b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids)
    return hashlib.sha256(data + b"".join(b"\x1f" + str(k).encode("utf-8") for k in extra_keys)).digest()


def test_sha256_block_hash_is_a_fixed_serialization():
    first = sha256_block_hash(None, [1, 2, 3, 4], ())
    assert first == documented_sha256_block_hash(None, [1, 2, 3, 4], ()) and len(first) == 32
    assert first == hashlib.sha256(b"\0" * 32 + struct.pack("<4q", 1, 2, 3, 4)).digest()
    chained = sha256_block_hash(first, [5, 6, 7, 8], ())
    assert chained == documented_sha256_block_hash(first, [5, 6, 7, 8], ())
    assert chained != sha256_block_hash(None, [5, 6, 7, 8], ())  # the parent is part of the key
    for extra in (("salt",), ("salt", 7), ("sält",)):
        assert sha256_block_hash(None, [1, 2, 3, 4], extra) == documented_sha256_block_hash(None, [1, 2, 3, 4], extra)
        assert sha256_block_hash(None, [1, 2, 3, 4], extra) != first
    big = [2**40, -1, 0, 151_935]  # ids are 8 bytes each, never truncated
    assert sha256_block_hash(None, big, ()) == documented_sha256_block_hash(None, big, ())


def test_sha256_hashes_stable_across_processes():
    code = (
        "from pagedserve.core.kv_cache_manager import KVCacheManager\n"
        "from pagedserve.core.request import Request\n"
        "from pagedserve.sampling_params import SamplingParams\n"
        "kv = KVCacheManager(8, 4, hash_algo='sha256')\n"
        "r = Request('x', list(range(13)), SamplingParams(), 16, cache_salt='s')\n"
        "kv.get_computed_blocks(r)\n"
        "print(','.join(h.hex() for h in r.block_hashes))\n"
    )
    outputs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        outputs.add(res.stdout.strip())
    kv = KVCacheManager(8, 4, hash_algo="sha256")
    r = make_request(range(13), cache_salt="s")
    kv.get_computed_blocks(r)
    assert outputs == {",".join(h.hex() for h in r.block_hashes)}


def test_builtin_hash_is_deterministic_within_process():
    assert builtin_block_hash(None, [1, 2], ()) == builtin_block_hash(None, (1, 2), ())
    assert builtin_block_hash(None, [1, 2], ()) != builtin_block_hash(None, [2, 1], ())
    assert builtin_block_hash(7, [1, 2], ()) != builtin_block_hash(8, [1, 2], ())
    assert builtin_block_hash(None, [1, 2], ("s",)) != builtin_block_hash(None, [1, 2], ())


def test_unknown_hash_algo_rejected():
    with pytest.raises(KeyError):
        KVCacheManager(4, 4, hash_algo="md5")


# ---------------------------------------------------------------------------- stats
def test_prefix_cache_counters():
    kv = KVCacheManager(16, 4)
    a = make_request(range(10))
    admit(kv, a)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    b = make_request(list(range(10)) + [1, 2])  # 12 tokens, hits 8
    admit(kv, b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (22, 8)
    # later chunks / decodes of a running request are not queries
    decode(kv, b, 5)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (22, 8)
    # a refused admission is not counted
    kv2 = KVCacheManager(1, 4)
    big = make_request(range(9))
    assert admit(kv2, big)[1] is None
    assert (kv2.prefix_cache_queries, kv2.prefix_cache_hits) == (0, 0)


def test_readmission_after_free_counts_again():
    kv = KVCacheManager(16, 4)
    a = make_request(range(10))
    admit(kv, a)
    kv.free(a)
    a.num_computed_tokens = 0  # as after preemption
    hit, _ = admit(kv, a)
    assert hit.num_tokens == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)


def test_usage():
    kv = KVCacheManager(4, 4)
    assert kv.usage == 0.0
    admit(kv, make_request(range(5)))
    assert kv.usage == 0.5


def test_stored_and_allocated():
    kv = KVCacheManager(16, 4)
    a = make_request(range(10))
    admit(kv, a)  # 10 computed over 3 blocks
    assert kv.stored_and_allocated([a]) == (10, 12)
    b = make_request(range(10))  # shares 2 blocks with a
    admit(kv, b)
    # distinct blocks: a's 3 + b's own third block = 4; shared blocks are counted once
    assert kv.stored_and_allocated([a, b]) == (8 + 2 + 2, 16)
    # a request mid-prefill: allocated but not computed slots
    c = make_request(range(200, 220))
    hit, _ = admit(kv, c, num_new=6)
    assert kv.stored_and_allocated([c]) == (6, 8)
    assert kv.stored_and_allocated([]) == (0, 0)


def test_prefix_hit_dataclass_no_hit_default():
    kv = KVCacheManager(4, 4)
    r = make_request(range(3))
    new = kv.allocate_slots(r, 3)
    assert len(new) == 1
    assert isinstance(kv.get_computed_blocks(r), PrefixHit)
