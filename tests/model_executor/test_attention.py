"""Paged attention against a plain reference: the native CPU decode kernel and the PyTorch paths."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.model_executor.attention import AttentionMetadata, PrefillSpan, paged_attention
from pagedserve.model_executor.kernels import cpu_kernels

BS, KVH, H, HD = 16, 2, 6, 32


def reference(q, keys, values, first):
    """Causal attention of queries at positions first.. over keys 0..; q [n, H, D], keys [ctx, KVH, D]."""
    n, ctx = q.shape[0], keys.shape[0]
    k = keys.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    v = values.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * HD ** -0.5
    mask = torch.arange(ctx)[None, :] <= torch.arange(first, first + n)[:, None]
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])
def test_mixed_batch_matches_reference(use_kernel, dtype, kv_dtype, monkeypatch):
    if use_kernel and cpu_kernels() is None:
        pytest.fail("the native CPU kernel did not build (needs a C++ compiler and ninja)")
    if not use_kernel:
        monkeypatch.setattr("pagedserve.model_executor.attention.cpu_kernels", lambda: None)
    g = torch.Generator().manual_seed(0)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BS, KVH, HD, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    # three decodes (contexts 1, 17, 40), a first prefill chunk (12 tokens) and a later chunk (20 after 35)
    seqs = [(0, 1), (16, 1), (39, 1), (0, 12), (35, 20)]  # (tokens already cached, new tokens)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, full_kv, slots, queries = [], [], [], []
    for cached, new in seqs:
        n_blocks = -(-(cached + new) // BS)
        table = [perm.pop() for _ in range(n_blocks)]
        keys = torch.randn(cached + new, KVH, HD, generator=g).to(dtype)
        values = torch.randn(cached + new, KVH, HD, generator=g).to(dtype)
        pos = torch.arange(cached + new)
        slot = torch.tensor(table)[pos // BS] * BS + pos % BS
        k_cache.view(-1, KVH, HD)[slot[:cached]] = keys[:cached].to(kv_dtype)
        v_cache.view(-1, KVH, HD)[slot[:cached]] = values[:cached].to(kv_dtype)
        tables.append(table)
        full_kv.append((keys, values))
        slots.append(slot[cached:])
        queries.append(torch.randn(new, H, HD, generator=g).to(dtype))
    q = torch.cat(queries)
    k_new = torch.cat([kv[0][c:] for kv, (c, _) in zip(full_kv, seqs)])
    v_new = torch.cat([kv[1][c:] for kv, (c, _) in zip(full_kv, seqs)])
    width = max(len(t) for t in tables[:3])
    decode_bt = torch.tensor([t + [0] * (width - len(t)) for t in tables[:3]])
    prefills = []
    start = 3
    for (cached, new), table in zip(seqs[3:], tables[3:]):
        mask = None if cached == 0 else torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        prefills.append(PrefillSpan(start, new, cached + new, torch.tensor(table), mask))
        start += new
    meta = AttentionMetadata(torch.cat(slots), 3, decode_bt, torch.tensor([c + n for c, n in seqs[:3]]), BS, prefills)
    # q, k and v as the model passes them: strided views of one fused QKV output
    qkv = torch.cat([q.flatten(1), k_new.flatten(1), v_new.flatten(1)], dim=1)
    q_view = qkv[:, :H * HD].view(-1, H, HD)
    k_view = qkv[:, H * HD:(H + KVH) * HD].view(-1, KVH, HD)
    v_view = qkv[:, (H + KVH) * HD:].view(-1, KVH, HD)
    out = paged_attention(q_view, k_view, v_view, k_cache, v_cache, meta, HD ** -0.5)
    offset = 0
    tol = 1e-5 if kv_dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    for (cached, new), (keys, values) in zip(seqs, full_kv):
        expected = reference(q[offset:offset + new].float(), keys.float(), values.float(), cached)
        torch.testing.assert_close(out[offset:offset + new].float(), expected, atol=tol, rtol=tol)
        offset += new


@pytest.mark.parametrize("num_seqs, num_kv_heads, threads", [(1, 2, 2), (2, 4, 4), (1, 2, 3), (5, 2, 2), (3, 4, 1)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_every_task_split(num_seqs, num_kv_heads, threads, kv_dtype):
    """With at least as many sequences as threads the kernel runs one task per sequence; with fewer it splits each
    context into ranges and merges their partial softmaxes (cases chosen to hit both, a 1-token context leaves a
    range empty). Every split gives plain attention over the sequence's blocks."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.fail("the native CPU kernel did not build (needs a C++ compiler and ninja)")
    g = torch.Generator().manual_seed(num_seqs)
    heads, num_blocks = 8, 40
    k_cache = torch.randn(num_blocks, BS, num_kv_heads, HD, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, BS, num_kv_heads, HD, generator=g).to(kv_dtype)
    lens = torch.randint(1, 5 * BS, (num_seqs,), generator=g)
    lens[0] = 1 if num_seqs > 2 else lens[0]
    tables = torch.randperm(num_blocks, generator=g)[:num_seqs * 5].view(num_seqs, 5)
    q = torch.randn(num_seqs, heads, HD, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, HD ** -0.5)
        single = kernels.paged_decode_attention(q[:1], k_cache, v_cache, tables[:1], torch.tensor([1]), HD ** -0.5)
    finally:
        torch.set_num_threads(old)
    for i in range(num_seqs):
        keys = k_cache[tables[i]].reshape(-1, num_kv_heads, HD)[:lens[i]].float()
        values = v_cache[tables[i]].reshape(-1, num_kv_heads, HD)[:lens[i]].float()
        k = keys.repeat_interleave(heads // num_kv_heads, dim=1).transpose(0, 1)
        v = values.repeat_interleave(heads // num_kv_heads, dim=1).transpose(0, 1)
        expected = ((q[i].unsqueeze(1) @ k.transpose(1, 2)) * HD ** -0.5).softmax(-1) @ v
        torch.testing.assert_close(out[i], expected.squeeze(1), atol=1e-5, rtol=1e-5)
    # a 1-token context (split or not) returns that token's value for every head of the group
    first_value = v_cache[tables[0, 0], 0].float().repeat_interleave(heads // num_kv_heads, dim=0)
    torch.testing.assert_close(single[0], first_value, atol=1e-6, rtol=1e-6)
