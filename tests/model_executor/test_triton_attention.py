"""The Triton attention backend (pagedserve/model_executor/attention/triton.py) against a plain PyTorch
reference and the PyTorch SDPA reference backend. Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are
defined); on a CUDA machine the same tests run the compiled kernels (benchmarks/device_check.sh)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():  # before triton is first imported: it patches triton.language then
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[triton]')")

from pagedserve.model_executor.attention import triton as ta  # noqa: E402
from pagedserve.model_executor.attention.metadata import (  # noqa: E402
    AttentionMetadata,
    PrefillSpan,
    chunk_causal_mask,
)
from pagedserve.model_executor.attention.selector import get_attention_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: list[int],
                        positions: list[int], scale: float, window: int | None = None,
                        soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D] at `positions` of one request: softmax over its context up to each row's position (its last
    `window` positions with a window; scores capped at soft_cap * tanh(scores / soft_cap) with a cap; a sink logit
    per head in each denominator with sinks), float32."""
    block_size, kvh, hd = k_cache.shape[1:]
    ctx = max(positions) + 1
    keys = k_cache[block_ids].reshape(-1, kvh, hd)[:ctx].float()
    values = v_cache[block_ids].reshape(-1, kvh, hd)[:ctx].float()
    group = q.shape[1] // kvh
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.float(), keys) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    visible = torch.arange(ctx)[None, :] <= torch.tensor(positions)[:, None]
    if window is not None:
        visible &= torch.arange(ctx)[None, :] > torch.tensor(positions)[:, None] - window
    scores = scores.masked_fill(~visible.to(scores.device)[None], float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)), dim=-1)
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1)[..., :ctx], values)


def random_cache(num_blocks: int, block_size: int, kvh: int, hd: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kvh, hd)
    return (torch.randn(shape, generator=g).to(DEVICE, dtype), torch.randn(shape, generator=g).to(DEVICE, dtype))


def random_tables(lens: list[int], block_size: int, num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled block ids per request (block 0 left free as padding)."""
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)).add(1).tolist()
    tables, at = [], 0
    for n in lens:
        used = -(-n // block_size)
        tables.append(perm[at:at + used])
        at += used
    return tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(16, 4, 2, 32), (4, 6, 2, 16), (1, 2, 2, 8),
                                                                (32, 8, 1, 24)])
def test_decode_matches_reference(dtype, block_size, heads, kv_heads, head_dim):
    """Decode rows of several lengths; partitions of 32 tokens (two 16-token tiles: a GPU's tl.dot needs K >= 16),
    so the longer rows are split-K over several partitions and merged, and a partition may end inside a block. head_dim 24 and 6 heads / 2 KV heads pad the
    head and group tiles."""
    lens = [1, 5, 37, 70]
    num_blocks = 64 if block_size > 1 else 160
    k_cache, v_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=block_size)
    tables = random_tables(lens, block_size, num_blocks, seed=1)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    ta.decode_attention(q, k_cache, v_cache, bt, torch.tensor(lens, device=DEVICE), scale, out,
                        partition=32, block_n=16)
    for i, n in enumerate(lens):
        want = reference_attention(q[i:i + 1], k_cache, v_cache, tables[i], [n - 1], scale)
        torch.testing.assert_close(out[i:i + 1].float(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("window, soft_cap, sinks", [(20, None, False), (40, 2.0, False), (None, 2.0, False),
                                                     (1, None, False), (None, None, True), (20, None, True)])
def test_decode_window_and_soft_cap_over_partitions(window, soft_cap, sinks):
    """Sliding window, soft cap and sinks (gpt-oss: merged once with the partitions) in the decode kernel: rows of
    1-100 tokens over 32-token partitions, so whole partitions lie before a row's window (they contribute nothing)
    and a window may start inside a tile."""
    lens, block_size, kvh, hd = [1, 5, 37, 70, 100], 16, 2, 16
    k_cache, v_cache = random_cache(64, block_size, kvh, hd, torch.float32, seed=12)
    tables = random_tables(lens, block_size, 64, seed=13)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    q = torch.randn(len(lens), 4, hd, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    sink_logits = torch.randn(4, generator=torch.Generator().manual_seed(18)).mul(3).to(DEVICE) if sinks else None
    out = torch.empty_like(q)
    ta.decode_attention(q, k_cache, v_cache, bt, torch.tensor(lens, device=DEVICE), 0.5, out, partition=32,
                        block_n=16, window=window, soft_cap=soft_cap, sinks=sink_logits)
    for i, n in enumerate(lens):
        want = reference_attention(q[i:i + 1], k_cache, v_cache, tables[i], [n - 1], 0.5, window, soft_cap,
                                   sink_logits)
        torch.testing.assert_close(out[i:i + 1], want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window, soft_cap, sinks", [(20, None, False), (5, 2.0, False), (None, 2.0, False),
                                                     (None, None, True), (20, None, True)])
def test_prefill_window_and_soft_cap(window, soft_cap, sinks):
    """A chunk of 40 after 50 tokens and a first chunk of 37, 16-row query tiles: each tile starts at its first
    row's window, each row keeps its own lower bound; with sinks (gpt-oss) each row's denominator has its head's."""
    block_size, kvh, hd = 8, 2, 16
    k_cache, v_cache = random_cache(40, block_size, kvh, hd, torch.float32, seed=15)
    for first, n in ((50, 40), (0, 37)):
        table = random_tables([first + n], block_size, 40, seed=16)[0]
        q = torch.randn(n, 4, hd, generator=torch.Generator().manual_seed(17)).to(DEVICE)
        sink_logits = torch.randn(4, generator=torch.Generator().manual_seed(19)).mul(3).to(DEVICE) if sinks else None
        out = torch.empty_like(q)
        ta.prefill_attention(q, k_cache, v_cache, torch.tensor(table, device=DEVICE), first + n, 0.5, out,
                             block_m=16, block_n=16, window=window, soft_cap=soft_cap, sinks=sink_logits)
        want = reference_attention(q, k_cache, v_cache, table, list(range(first, first + n)), 0.5, window, soft_cap,
                                   sink_logits)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_decode_tiles_below_sixteen_tokens_are_refused():
    """A GPU's tl.dot needs K >= 16 (p @ v over a tile's tokens); the interpreter would run 8, the GPU would not."""
    q = torch.zeros(1, 2, 16, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="tl.dot needs K >= 16"):
        ta.decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long, device=DEVICE),
                            torch.ones(1, dtype=torch.long, device=DEVICE), 1.0, torch.empty_like(q), block_n=8)


def test_decode_long_context_default_partitions_and_padding_rows():
    """A 1500-token row over the default 512-token partitions (3 of them, the last partial) next to a padding
    row (context length 0, as in a CUDA graph's padded batch) whose output is 0, not NaN."""
    block_size, kvh, hd = 16, 2, 16
    k_cache, v_cache = random_cache(100, block_size, kvh, hd, torch.float32, seed=3)
    tables = random_tables([1500], block_size, 100, seed=4)
    bt = torch.tensor([tables[0], [0] * len(tables[0])], device=DEVICE)
    q = torch.randn(2, 4, hd, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    ta.decode_attention(q, k_cache, v_cache, bt, torch.tensor([1500, 0], device=DEVICE), 0.25, out)
    torch.testing.assert_close(out[:1], reference_attention(q[:1], k_cache, v_cache, tables[0], [1499], 0.25),
                               atol=2e-5, rtol=2e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_chunk_with_offset(dtype, kv_dtype, block_size):
    """A chunk of 21 tokens after 30 tokens of earlier context (causal with an offset), GQA 4:2, query tiles of
    16 rows (the second one partial), and a first chunk (no earlier context)."""
    kvh, hd, heads = 2, 16, 4
    k_cache, v_cache = random_cache(40, block_size, kvh, hd, kv_dtype, seed=6)
    for first, n in ((30, 21), (0, 19)):
        table = random_tables([first + n], block_size, 40, seed=7)[0]
        q = torch.randn(n, heads, hd, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
        out = torch.empty_like(q)
        ta.prefill_attention(q, k_cache, v_cache, torch.tensor(table, device=DEVICE), first + n, 0.3, out,
                             block_m=16, block_n=16)
        want = reference_attention(q, k_cache, v_cache, table, list(range(first, first + n)), 0.3)
        tol = max(TOLERANCE[dtype], TOLERANCE[kv_dtype])
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_by_slot_mapping(kv_dtype):
    """K/V views with the QKV output's strides land at their slots, converted to the cache dtype; a negative
    slot (a padding row) writes nothing."""
    kvh, hd = 3, 12
    qkv = torch.randn(4, (4 + 2 * kvh) * hd).to(DEVICE)
    k = qkv[:, 4 * hd:(4 + kvh) * hd].view(4, kvh, hd)
    v = qkv[:, (4 + kvh) * hd:].view(4, kvh, hd)
    k_cache = torch.zeros(5, 4, kvh, hd, dtype=kv_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([9, 2, -1, 17], device=DEVICE)
    ta.write_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kvh, hd), v_cache.view(-1, kvh, hd)
    # exact on a GPU; Triton's interpreter truncates float32 -> bfloat16 instead of rounding (one ulp off)
    ulp = 2.0 ** -7 if kv_dtype == torch.bfloat16 and DEVICE.type == "cpu" else 0.0
    for row, slot in ((0, 9), (1, 2), (3, 17)):
        torch.testing.assert_close(flat_k[slot], k[row].to(kv_dtype), rtol=ulp, atol=0)
        torch.testing.assert_close(flat_v[slot], v[row].to(kv_dtype), rtol=ulp, atol=0)
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 3  # nothing else written


@pytest.mark.parametrize("window, soft_cap, sinks", [(None, None, False), (8, None, False), (None, 3.0, False),
                                                     (8, 3.0, False), (8, None, True)])
def test_mixed_step_through_paged_attention(window, soft_cap, sinks):
    """The backend's entry point on a step as the runner builds it: two decode rows, then a first prefill chunk
    and a later one, against the reference after the step's K/V are written, and against the PyTorch SDPA
    reference backend on a copy of the cache (same layout: both token-major). With a sliding window (8: the later
    chunk crosses its edge) or a logits soft cap (Gemma 2's), in the kernels, against the reference backend's
    windowed masks and cap (tested in test_attention.py); with gpt-oss's sinks against its sink column."""
    block_size, kvh, hd, heads = 8, 2, 16, 4
    k_cache, v_cache = random_cache(30, block_size, kvh, hd, torch.float32, seed=9)
    # (earlier context, new tokens): two decodes, a first chunk, a chunk after 12 tokens
    spans = [(20, 1), (6, 1), (0, 11), (12, 10)]
    tables = random_tables([a + n for a, n in spans], block_size, 30, seed=10)
    width = max(len(t) for t in tables[:2])
    slots, start, prefills = [], 0, []
    for (first, n), table in zip(spans, tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(first, first + n)]
        if n > 1:
            prefills.append(PrefillSpan(start, n, first + n, torch.tensor(table, device=DEVICE),
                                        chunk_causal_mask(first, first + n, DEVICE)))
        start += n
    meta = AttentionMetadata(torch.tensor(slots, device=DEVICE), 2,
                             torch.tensor([t + [0] * (width - len(t)) for t in tables[:2]], device=DEVICE),
                             torch.tensor([21, 7], device=DEVICE), block_size, prefills)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(start, h, hd, generator=g).to(DEVICE) for h in (heads, kvh, kvh))
    sink_logits = torch.randn(heads, generator=g).mul(3).to(DEVICE) if sinks else None
    backend, reference = get_attention_backend("triton", DEVICE), get_attention_backend("torch", DEVICE)
    assert isinstance(backend, ta.TritonAttentionBackend)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    out = backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(meta), 0.25, window, soft_cap,
                          sink_logits)
    torch.testing.assert_close(out, reference.forward(q, k, v, ref_k_cache, ref_v_cache,
                                                      reference.build_metadata(meta), 0.25, window, soft_cap,
                                                      sink_logits),
                               atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(k_cache, ref_k_cache, atol=0, rtol=0)
    if window is not None or soft_cap is not None or sinks:
        return
    start = 0
    for (first, n), table in zip(spans, tables):
        want = reference_attention(q[start:start + n], k_cache, v_cache, table, list(range(first, first + n)), 0.25)
        torch.testing.assert_close(out[start:start + n], want, atol=2e-5, rtol=2e-5)
        start += n


def test_graph_width_floor_is_one_decode_partition():
    backend = ta.TritonAttentionBackend(DEVICE)
    assert backend.supports_cuda_graphs and backend.cuda_graph_min_width_tokens == ta.DECODE_PARTITION


H100_H200_MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the tests above run the compiled kernels")
def test_kernels_compile_for_sm90():
    """Outside the interpreter, every kernel goes through Triton's real compiler down to a cubin for sm_90 (no GPU
    needed), in bfloat16 (tensor-core dots) and float32 (IEEE dots), at head_dim 128; each fits the shared memory
    of an H100/H200 block."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "triton_compile_check.py")
    r = subprocess.run([sys.executable, script, "bf16", "fp32"], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    shared = [int(n) for n in re.findall(r"compiled for sm_90, (\d+) bytes", r.stdout)]
    assert len(shared) == 30 and max(shared) <= H100_H200_MAX_SHARED, r.stdout  # 15 kernels x 2 dtypes
