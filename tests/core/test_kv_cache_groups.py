"""KV cache groups (core/kv_cache_groups.py) and the manager's sliding-window groups: blocks behind the window go
back to the pool, a prefix hit needs each sliding group's window blocks (vLLM's rule), every block comes back."""
from __future__ import annotations

from test_kv_cache_manager import admit, decode, make_request

from pagedserve.core.kv_cache_groups import KVCacheGroup, layer_cache_slots, make_kv_cache_groups
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv

BS = 4
WINDOW = 8


def test_uniform_models_have_one_group():
    assert make_kv_cache_groups([None] * 4) == [KVCacheGroup((0, 1, 2, 3), None)]
    assert make_kv_cache_groups([4096] * 3) == [KVCacheGroup((0, 1, 2), 4096)]  # Mistral: one sliding group


def test_gemma3_layers_split_into_groups_of_the_full_layers_count():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # gemma-3-1b: 4 full layers, 22 sliding
    groups = make_kv_cache_groups(windows)
    assert groups[0] == KVCacheGroup((5, 11, 17, 23), None)  # full attention first
    assert [g.sliding_window for g in groups[1:]] == [512] * 6
    assert [len(g.layers) for g in groups] == [4, 4, 4, 4, 4, 4, 2]
    slots = layer_cache_slots(groups)
    assert sorted(slots) == list(range(26))
    assert slots[5] == (0, 0) and slots[0] == (1, 0) and slots[25] == (6, 1)
    assert max(t for _, t in slots.values()) == 3  # four KV tensors shared by the seven groups


def _hybrid(num_blocks=64, caching=True):
    return KVCacheManager(num_blocks, BS, caching, "builtin", sliding_windows=(None, WINDOW))


def _used(kv, request_id, g):
    return [b for b in kv.group_req_to_blocks[g][request_id] if b is not kv.null_block]


def test_sliding_group_frees_the_blocks_behind_its_window():
    kv = _hybrid()
    r = make_request(range(100, 141))  # 41 tokens
    pos = 0
    while pos < r.num_tokens:  # chunks of 8, as chunked prefill runs them
        n = min(8, r.num_tokens - pos)
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens = pos = pos + n
        kv.cache_blocks(r, pos)
    for t in range(20):
        decode(kv, r, 7 + t)
    num_tokens = r.num_computed_tokens
    full, sliding = kv.group_req_to_blocks[0][r.request_id], kv.group_req_to_blocks[1][r.request_id]
    assert len(full) == len(sliding) >= cdiv(num_tokens, BS)
    assert kv.null_block not in full
    # the last computed position's window (and the next one's) lies in the sliding group's last blocks
    kept = _used(kv, r.request_id, 1)
    assert len(kept) <= cdiv(WINDOW - 1, BS) + 1
    assert sliding[:-len(kept)] == [kv.null_block] * (len(sliding) - len(kept))
    assert kv.block_pool.num_used_blocks == len(full) + len(kept)
    assert kv.group_block_ids(r.request_id)[0][0] == kv.null_block.block_id == 64  # one past the pool
    kv.free(r)
    assert kv.block_pool.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_prefix_hit_needs_the_sliding_groups_window_blocks():
    kv = _hybrid()
    prompt = list(range(200, 241))  # 41 tokens: 10 full blocks
    a = make_request(prompt)
    admit(kv, a)
    kv.free(a)
    b = make_request(prompt + [1, 2, 3])  # 44 tokens: at most 10 blocks hit (the last token is computed)
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 40
    full, sliding = hit.blocks, hit.group_blocks[0]
    assert kv.null_block not in full
    skipped = (40 - WINDOW + 1) // BS  # blocks wholly before the window of position 40
    assert sliding[:skipped] == [kv.null_block] * skipped and kv.null_block not in sliding[skipped:]
    # the sliding group loses the last block of that window: the hit ends one block earlier, where the window's
    # blocks are all cached
    kv.block_pool._evict(sliding[-1])
    assert kv.get_computed_blocks(b).num_tokens == 36
    # the full group's chain breaks earlier: the hit is no longer than it
    kv.block_pool._evict(full[3])
    assert kv.get_computed_blocks(b).num_tokens == 12
    _, new = admit(kv, b)
    assert new is not None and b.num_computed_tokens == b.num_tokens
    kv.free(b)
    assert kv.block_pool.num_free_blocks == kv.num_blocks


def test_a_hit_shorter_than_the_window_needs_every_block():
    kv = _hybrid()
    a = make_request(range(300, 309))  # 9 tokens: 2 full blocks
    admit(kv, a)
    kv.free(a)
    b = make_request(list(range(300, 309)) + [5])
    kv.block_pool._evict(kv.get_computed_blocks(b).group_blocks[0][0])  # the sliding group's first block
    assert kv.get_computed_blocks(b).num_tokens == 0


def test_pool_short_changes_nothing_and_preemption_frees_every_group():
    kv = _hybrid(num_blocks=12)
    r = make_request(range(40))  # 10 blocks in each group at once: more than the pool
    assert kv.allocate_slots(r, 40) is None
    assert r.request_id not in kv.req_to_blocks and kv.block_pool.num_free_blocks == 12
    assert kv.allocate_slots(r, 16) is not None  # a chunk fits: 4 blocks per group
    r.num_computed_tokens = 16
    kv.cache_blocks(r, 16)
    # 4 blocks free; the next 8 tokens take 2 per group, and the window of position 16 starts at 9: the sliding
    # group's blocks 0 and 1 are freed first
    assert kv.allocate_slots(r, 8) is not None
    assert kv.block_pool.num_free_blocks == 2
    assert _used(kv, r.request_id, 1)[0] is kv.group_req_to_blocks[1][r.request_id][2]
    kv.free(r)  # preemption: every group's blocks back
    assert kv.block_pool.num_free_blocks == 12 and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
