"""Every native CPU op, in every instruction-set build this CPU can run (the best one, plain AVX-512 without BF16,
AVX2, the compiler's baseline "generic"), against the PyTorch reference, in float32 and bfloat16.

The matrix is generated from what each build can run on this CPU (`Capabilities`, derived from the level and
/proc/cpuinfo and checked against what the loaded build reports): a case a build cannot run (prefill attention or a
small-GEMM dtype outside its level, AMX tiles on a CPU without them) is not generated, and every generated case
calls its kernel and compares. The ops a build lacks are checked to be refused (test_build_capabilities). Builds
other than the engine's default one are marked `kernels_build` (each is a ~1 min compile the first time on 2 cores)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Callable, Iterable

import pytest
import torch
import torch.nn.functional as F

from pagedserve.model_executor import kernels as K

from kernel_capabilities import Capabilities, capabilities

BF16_TOL = dict(atol=2e-2, rtol=1.6e-2)  # one bfloat16 rounding step
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
DTYPES = [torch.float32, torch.bfloat16]
CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def isas_to_test() -> list[str]:
    """The best level this CPU runs (the engine's), then plain AVX-512 and AVX2 where it has them, then "generic"."""
    supported = K.supported_isas()
    return [supported[0]] + [isa for isa in ("avx512", "avx2", "generic") if isa in supported and isa != supported[0]]


ISAS = isas_to_test()
CAPS = {isa: capabilities(isa, K.cpu_flags()) for isa in ISAS}


def _case_id(value) -> str:
    return str(value).removeprefix("torch.") if not isinstance(value, bool) else ("T" if value else "F")


def over_builds(argnames: str, cases: Callable[[Capabilities], Iterable[tuple]] = lambda caps: [()]):
    """Parametrize a test over every build in ISAS x the cases `cases(caps)` that build can run. The test takes
    `isa` (and through it the `ops` fixture) plus `argnames`."""
    names = ["isa", *(n.strip() for n in argnames.split(",") if n.strip())]
    params = []
    for isa in ISAS:
        marks = () if isa == ISAS[0] else (pytest.mark.kernels_build(isa),)  # built before the tests (conftest)
        for case in cases(CAPS[isa]):
            params.append(pytest.param(isa, *case, marks=marks, id="-".join(map(_case_id, (isa, *case)))))
    return pytest.mark.parametrize(names, params)


@pytest.fixture
def ops(isa):
    module = K.load_cpu_kernels(isa)  # built once per level and process (cached by the kernels module)
    if module is None:
        pytest.fail(f"the native CPU kernels ({isa}) did not build (needs a C++ compiler and ninja)")
    assert module.isa() == isa
    return module


@contextlib.contextmanager
def amx_tiles(ops, enable: bool):
    """The AMX path on or off for the block (the previous setting after)."""
    before = ops.amx_tiles()
    assert ops.set_amx_tiles(enable) == (enable and CAPS[ops.isa()].amx)
    try:
        yield
    finally:
        ops.set_amx_tiles(before)


pytestmark = pytest.mark.usefixtures("one_thread")


def _tol(dtype):
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


@over_builds("")
def test_build_capabilities(ops):
    """The build reports exactly the capabilities the matrix was generated from, and refuses what it lacks."""
    caps = CAPS[ops.isa()]
    for d in (32, 40, 48, 64, 128):
        assert ops.native_prefill(d) == (caps.prefill and d % 16 == 0), d
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        assert ops.native_small_gemm(dtype) == (dtype in caps.gemm_dtypes), dtype
    assert ops.amx_tiles() == caps.amx
    assert ops.lora_bf16_pairs() == caps.lora_bf16_pairs
    if not caps.gemm_dtypes:  # no small-GEMM row tiles to prefetch for
        assert ops.small_gemm_prefetch() == 0 and ops.set_small_gemm_prefetch(8) == 0
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = _kv_caches(4, 16, 2, 40, torch.float32, "heads", g)
    with pytest.raises(RuntimeError, match="not built for head_dim 40"):
        ops.paged_prefill_attention(torch.randn(3, 4, 40), k_cache, v_cache, torch.tensor([0]), 0, 0.1,
                                    torch.empty(3, 4, 40))
    for dtype in {torch.float32, torch.bfloat16, torch.int8} - set(caps.gemm_dtypes):
        with pytest.raises(RuntimeError, match="natively"):
            ops.pack_small_gemm_weight(torch.zeros(8, 64, dtype=dtype))


@over_builds("")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_fp32", [False, True])
@pytest.mark.parametrize("rows, n", [(1, 80), (7, 576), (33, 100)])
def test_rms_norm(ops, dtype, weight_fp32, rows, n):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, generator=g)
    w = w if weight_fp32 else w.to(dtype)
    big = torch.randn(rows, n + 16, generator=g).to(dtype)
    x = big[:, :n]  # strided rows, as the model passes views
    residual = torch.randn(rows, n, generator=g).to(dtype)
    expected = F.rms_norm(x.float(), (n,), w.float(), 1e-6).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, None, w, 1e-6), expected, **_tol(dtype))
    res = residual.clone()
    out = ops.rms_norm(x, res, w, 1e-6)
    summed = (residual + x)  # PyTorch's add in the stream's dtype (one rounding)
    torch.testing.assert_close(res, summed, atol=0, rtol=0)
    torch.testing.assert_close(out, F.rms_norm(summed.float(), (n,), w.float(), 1e-6).to(dtype), **_tol(dtype))


@over_builds("")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 48), (5, 1536), (40, 37)])
def test_silu_and_mul(ops, dtype, rows, n):
    g = torch.Generator().manual_seed(n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 3
    gate_up[0, :4] = torch.tensor([-1e4, -95.0, 95.0, 1e4])  # where e^-x leaves float32's range
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (F.silu(gate) * up).to(dtype)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), expected, **_tol(dtype))


@over_builds("")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 48), (5, 1536), (40, 37)])
def test_gelu_tanh_and_mul(ops, dtype, rows, n):
    """Gemma's GeGLU against PyTorch's tanh-approximated gelu, past float32's exp range at the extremes."""
    g = torch.Generator().manual_seed(n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 3
    gate_up[0, :4] = torch.tensor([-1e4, -95.0, 95.0, 1e4])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (F.gelu(gate, approximate="tanh") * up).to(dtype)
    torch.testing.assert_close(ops.gelu_tanh_and_mul(gate_up), expected, **_tol(dtype))


@over_builds("")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cos_dtype", ["float32", "same"])
@pytest.mark.parametrize("tokens, d", [(1, 64), (9, 128), (20, 32)])
def test_rotary(ops, dtype, cos_dtype, tokens, d):
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads = 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    x = qkv[:, :(heads + kv_heads) * d].view(tokens, heads + kv_heads, d)  # strided, as in the model
    angles = torch.rand(tokens, 1, d // 2, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    if cos_dtype == "same":
        cos, sin = cos.to(dtype), sin.to(dtype)
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.float(), sin.float()
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
    untouched = qkv[:, (heads + kv_heads) * d:].clone()
    ops.rotary_inplace(x, cos, sin)
    torch.testing.assert_close(x, expected, **_tol(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], untouched)


LAYOUTS = ("split", "joint", "heads")


def _kv_caches(blocks, bs, kvh, d, dtype, layout, g=None):
    """Random K and V caches indexed [blocks, bs, kvh, d] (zeros without g): two token-major tensors ("split", the
    GPU layout), the halves of one token-major [blocks, 2, bs, kvh, d] tensor ("joint"), or views of one head-major
    [blocks, 2, kvh, bs, d] tensor ("heads", the runner's CPU layout: each block's K and V one run, each KV head's
    rows of a block contiguous)."""
    make = (lambda shape: torch.randn(shape, generator=g).to(dtype)) if g is not None else \
        (lambda shape: torch.zeros(shape, dtype=dtype))
    if layout == "heads":
        kv = make((blocks, 2, kvh, bs, d))
        return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    if layout == "joint":
        kv = make((blocks, 2, bs, kvh, d))
        return kv[:, 0], kv[:, 1]
    return make((blocks, bs, kvh, d)), make((blocks, bs, kvh, d))


@over_builds("")
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_kv(ops, src_dtype, cache_dtype, layout):
    g = torch.Generator().manual_seed(3)
    tokens, kvh, d, blocks, bs = 21, 3, 64, 8, 16
    qkv = torch.randn(tokens, (3 + 2 * kvh) * d, generator=g).to(src_dtype)
    k = qkv[:, 3 * d:(3 + kvh) * d].view(tokens, kvh, d)
    v = qkv[:, (3 + kvh) * d:].view(tokens, kvh, d)
    k_cache, v_cache = _kv_caches(blocks, bs, kvh, d, cache_dtype, layout)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    ops.write_kv(k, v, k_cache, v_cache, slots)
    k_rows, v_rows = k_cache.reshape(-1, kvh, d), v_cache.reshape(-1, kvh, d)
    assert torch.equal(k_rows[slots], k.to(cache_dtype))  # rounded as .to() rounds
    assert torch.equal(v_rows[slots], v.to(cache_dtype))
    others = torch.ones(blocks * bs, dtype=torch.bool)
    others[slots] = False
    assert not k_rows[others].any() and not v_rows[others].any()


@over_builds("")
def test_kv_cache_layout_checked(ops):
    """A block must be one dense token- or head-major run and K and V laid out alike; anything else is refused, not
    misread."""
    rows = torch.randn(2, 3, 64)
    dims_apart = torch.randn(5, 16, 64, 3).transpose(2, 3)  # [5, 16, 3, 64], a head's dims 3 apart
    padded = torch.randn(5, 16, 3, 80)[..., :64]  # rows with gaps between them
    for cache in (dims_apart, padded):
        with pytest.raises(RuntimeError, match="must be one dense"):
            ops.write_kv(rows, rows, cache, cache, torch.tensor([0, 1]))
    joint_k, _ = _kv_caches(5, 16, 3, 64, torch.float32, "joint")
    with pytest.raises(RuntimeError, match="one shape, dtype and layout"):
        ops.write_kv(rows, rows, joint_k, torch.zeros(5, 16, 3, 64), torch.tensor([0, 1]))


@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("num_seqs, threads, layout", [(1, 2, "heads"), (4, 2, "split"), (3, 1, "joint"),
                                                      (5, 2, "heads")])
@pytest.mark.parametrize("heads, kvh, d, bs", [(9, 3, 64, 16), (4, 2, 128, 8), (6, 6, 48, 16), (4, 1, 40, 4),
                                              (16, 2, 32, 16), (9, 1, 32, 8), (4, 4, 64, 16), (10, 2, 32, 32)])
@over_builds("amx", lambda caps: [(amx,) for amx in caps.amx_modes])
def test_decode_attention(ops, q_dtype, cache_dtype, num_seqs, threads, layout, heads, kvh, d, bs, amx):
    """Head sizes: SmolLM2's and Qwen3's (the AVX-512 path, VDPBF16PS for d % 32 == 0; in bfloat16 with a bfloat16
    cache the grouped path that sums values in bfloat16 pairs, on AMX tiles where the CPU has them), 48 (16-wide
    tail of the value sums), 40 (not a multiple of 16: the portable path); query heads per KV head 1, 2, 3, 5 and 8
    (the grouped path's largest) and 9 (past it); block sizes that split the 16-token chunks (the tile path copies
    their keys) or hold two, and block tables in random order; every cache layout (_kv_caches)."""
    with amx_tiles(ops, amx):
        _check_decode_attention(ops, q_dtype, cache_dtype, num_seqs, threads, layout, heads, kvh, d, bs)


def _check_decode_attention(ops, q_dtype, cache_dtype, num_seqs, threads, layout, heads, kvh, d, bs):
    g = torch.Generator().manual_seed(num_seqs)
    blocks = 40
    k_cache, v_cache = _kv_caches(blocks, bs, kvh, d, cache_dtype, layout, g)
    per_seq = blocks // num_seqs
    lens = torch.randint(1, per_seq * bs, (num_seqs,), generator=g)
    tables = torch.randperm(blocks, generator=g)[:num_seqs * per_seq].view(num_seqs, per_seq)
    qkv = torch.randn(num_seqs, (heads + 2 * kvh) * d, generator=g).to(q_dtype)
    q = qkv[:, :heads * d].view(num_seqs, heads, d)  # strided between sequences, as in the model
    torch.set_num_threads(threads)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    into = torch.empty(num_seqs, heads, d, dtype=q_dtype)
    ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, into)
    assert out.dtype == q_dtype and torch.equal(out, into)
    for i in range(num_seqs):
        keys = k_cache[tables[i]].reshape(-1, kvh, d)[:lens[i]].float().repeat_interleave(heads // kvh, dim=1)
        values = v_cache[tables[i]].reshape(-1, kvh, d)[:lens[i]].float().repeat_interleave(heads // kvh, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), keys) * d ** -0.5
        expected = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(out[i].float(), expected, **(_tol(q_dtype) if q_dtype != torch.float32 else
                                                                dict(atol=1e-5, rtol=1e-4)))


@pytest.mark.parametrize("scale", [0.0, -0.125])
@over_builds("op", lambda caps: [("decode",)] + ([("prefill",)] if caps.prefill else []))
def test_attention_refuses_a_scale_that_is_not_positive(ops, op, scale):
    """The softmax takes its running max over the unscaled scores (max(scale s) = scale max(s) needs scale > 0), so
    both attention ops refuse any other scale with a clear error instead of returning wrong weights."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = _kv_caches(4, 16, 2, 64, torch.float32, "heads", g)
    q = torch.randn(3, 4, 64, generator=g)
    with pytest.raises(RuntimeError, match="scale must be positive"):
        if op == "decode":
            ops.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0], [1], [2]]), torch.tensor([5, 9, 16]),
                                       scale)
        else:
            ops.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0]), 0, scale, torch.empty_like(q))


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("n, first, threads, layout", [(37, 0, 1, "heads"), (20, 45, 2, "split"), (1, 16, 1, "heads"),
                                                     (70, 3, 2, "joint"), (50, 21, 2, "heads"), (45, 290, 2, "heads")])
@pytest.mark.parametrize("heads, kvh, d, bs", [(9, 3, 64, 16), (4, 2, 128, 8), (6, 6, 48, 4), (5, 1, 32, 16)])
@over_builds("amx", lambda caps: [(amx,) for amx in caps.amx_modes] if caps.prefill else [])
def test_prefill_attention(ops, q_dtype, cache_dtype, n, first, threads, layout, heads, kvh, d, bs, amx):
    """A prefill chunk of n tokens after `first` cached ones, causal over the paged cache (tiles of 32 query tokens
    and chunks of 16 keys cut at odd places); built on AVX-512 for head_dim % 16 == 0 only. The vector paths take
    rows eight at a time (5 heads per KV head: a tile's rows end in blocks of 1-7) with one softmax update per 256
    keys (335 keys: a full update, then a partial one). In bfloat16 with a bfloat16 cache and head_dim % 32 == 0
    the rows go 16 at a time on AMX tiles where the CPU has them (amx=False keeps the vector path there). Generated
    for the AVX-512 builds only (test_build_capabilities checks the others refuse it)."""
    with amx_tiles(ops, amx):
        _check_prefill_attention(ops, q_dtype, cache_dtype, n, first, threads, layout, heads, kvh, d, bs)


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("n, threads", [(37, 1), (300, 2), (5, 1)])
@pytest.mark.parametrize("heads, kvh, d, bs", [(12, 12, 32, 16), (5, 1, 64, 8)])
@over_builds("amx", lambda caps: [(amx,) for amx in caps.amx_modes] if caps.prefill else [])
def test_prefill_attention_bidirectional(ops, q_dtype, cache_dtype, n, threads, heads, kvh, d, bs, amx):
    """causal false (an encoder's whole prompt): every row sees all n keys, on the vector and AMX paths."""
    with amx_tiles(ops, amx):
        _check_prefill_attention(ops, q_dtype, cache_dtype, n, 0, threads, "heads", heads, kvh, d, bs, causal=False)


def _check_prefill_attention(ops, q_dtype, cache_dtype, n, first, threads, layout, heads, kvh, d, bs, causal=True):
    assert ops.native_prefill(d)
    g = torch.Generator().manual_seed(n + first)
    ctx = first + n
    blocks = max(60, -(-ctx // bs) + 4)
    k_cache, v_cache = _kv_caches(blocks, bs, kvh, d, cache_dtype, layout, g)
    block_ids = torch.randperm(blocks, generator=g)[:-(-ctx // bs)]
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=g).to(q_dtype)
    q = qkv[:, :heads * d].view(n, heads, d)  # strided between tokens, as in the model
    out_rows = torch.zeros(n + 2, heads * d, dtype=q_dtype)
    out = out_rows[1:-1].view(n, heads, d)
    torch.set_num_threads(threads)
    ops.paged_prefill_attention(q, k_cache, v_cache, block_ids, first, d ** -0.5, out, causal)
    assert not out_rows[0].any() and not out_rows[-1].any()
    keys = k_cache[block_ids].reshape(-1, kvh, d)[:ctx].float().repeat_interleave(heads // kvh, dim=1)
    values = v_cache[block_ids].reshape(-1, kvh, d)[:ctx].float().repeat_interleave(heads // kvh, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), keys) * d ** -0.5
    visible = torch.arange(ctx)[None, :] <= torch.arange(first, ctx)[:, None] if causal else \
        torch.ones(n, ctx, dtype=torch.bool)
    expected = torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    torch.testing.assert_close(out.float(), expected, **(_tol(q_dtype) if q_dtype != torch.float32 else
                                                         dict(atol=1e-5, rtol=1e-4)))


@pytest.mark.parametrize("rows, n, k", [(0, 200, 576), (1, 163, 100), (1, 1536, 576), (3, 5, 32), (8, 64, 34),
                                        (9, 49, 2), (13, 200, 64), (16, 200, 576), (20, 97, 1040), (40, 33, 96)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunks", [True, False])
@over_builds("dtype", lambda caps: [(d,) for d in DTYPES if d in caps.gemm_dtypes])
def test_small_gemm(ops, dtype, rows, n, k, bias, chunks):
    """No rows (a pooled step's last MLP can have none), every row tile (1-8 rows, 8-row tiles then a tail), 1-3
    column blocks per task and a partial last block; 9-20 rows take K in chunks of 64 k steps (K = 576 and 1040:
    several chunks, a partial last one, several groups) with chunks=True, whatever this CPU's default
    (small_gemm_chunks). Generated for the dtypes the build runs natively (elsewhere the Linear stays on oneDNN:
    test_layers)."""
    with small_gemm_chunks(ops, chunks):
        _check_small_gemm(ops, dtype, rows, n, k, bias)


@contextlib.contextmanager
def small_gemm_chunks(ops, enable: bool):
    """The small GEMM's chunks of K on or off for the block (the CPU's default after)."""
    default = ops.small_gemm_chunks()
    assert ops.set_small_gemm_chunks(enable) == enable
    try:
        yield
    finally:
        ops.set_small_gemm_chunks(default)


def amd_family() -> int:
    """The CPU family from /proc/cpuinfo on an AMD CPU (0x19 Zen 3/4, 0x1A Zen 5), 0 on other vendors."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    return int(info.get("cpu family", "0")) if info.get("vendor_id") == "AuthenticAMD" else 0


@over_builds("")
def test_small_gemm_chunks_default(ops):
    """The chunks run by default only where they were measured faster: AMD Zen 5 and later (family 0x1A+); never in
    builds without AVX-512."""
    assert ops.small_gemm_chunks() == (amd_family() >= 0x1A and ops.isa() not in ("avx2", "generic"))


@over_builds("", lambda caps: [()] if torch.float32 in caps.gemm_dtypes else [])
def test_small_gemm_prefetch(ops):
    """The prefetch distance of calls of up to 8 rows (one row tile): 4 k steps by default on AMD Zen 4 (family
    0x19, where it measured faster), 16 elsewhere (none without AVX-512: test_build_capabilities). Any distance from
    0 to 64 gives the same bits (a hint only, also past a block's end); others are a ValueError."""
    default = ops.small_gemm_prefetch()
    assert default == (4 if amd_family() == 0x19 else 16)
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(5, 1040, generator=g), torch.randn(200, 1040, generator=g)
    packed = ops.pack_small_gemm_weight(w)
    expected = ops.small_gemm(x, packed, 200)
    try:
        for steps in (0, 1, 64):
            assert ops.set_small_gemm_prefetch(steps) == steps == ops.small_gemm_prefetch()
            assert torch.equal(ops.small_gemm(x, packed, 200), expected)
        for bad in (-1, 65):
            with pytest.raises(ValueError, match="0-64 k steps"):
                ops.set_small_gemm_prefetch(bad)
    finally:
        ops.set_small_gemm_prefetch(default)
    assert ops.small_gemm_prefetch() == default


def _check_small_gemm(ops, dtype, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * n * k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    y = ops.small_gemm(x, ops.pack_small_gemm_weight(w), n, b)
    assert y.dtype == dtype and y.shape == (rows, n)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=1.6e-2)
    torch.testing.assert_close(y.float(), expected, **tol)


@over_builds("", lambda caps: [()] if torch.float32 in caps.gemm_dtypes else [])
def test_small_gemm_rejects_mismatched_shapes(ops):
    packed = ops.pack_small_gemm_weight(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.small_gemm(torch.randn(2, 63), packed, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.small_gemm(torch.randn(2, 64), packed, 17)
    if ops.native_small_gemm(torch.bfloat16):
        with pytest.raises(RuntimeError, match="groups of 2"):
            ops.pack_small_gemm_weight(torch.randn(8, 33).bfloat16())
    if ops.native_small_gemm(torch.int8):
        with pytest.raises(RuntimeError, match="groups of 4"):
            ops.pack_small_gemm_weight(torch.zeros(8, 34, dtype=torch.int8))
        q = ops.pack_small_gemm_weight(torch.zeros(40, 64, dtype=torch.int8))
        with pytest.raises(RuntimeError, match="scales float32"):
            ops.small_gemm_int8(torch.randn(2, 64), q, torch.ones(40), torch.zeros(40), 40)  # shifts not int32


def _quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n, k", [(0, 200, 576), (1, 163, 100), (1, 1536, 576), (3, 5, 32), (8, 64, 36),
                                        (9, 49, 4), (13, 200, 64), (40, 33, 96), (20, 1536, 576), (16, 97, 1040),
                                        (40, 70, 128)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunks", [True, False])
@over_builds("amx", lambda caps: [(amx,) for amx in caps.amx_modes] if torch.int8 in caps.gemm_dtypes else [])
def test_small_gemm_int8(ops, dtype, rows, n, k, bias, amx, chunks):
    """The VNNI int8 path: x quantized per row (round(x / s) with s = max|x| / 127), then exact integer sums,
    scaled back by the row's and the column's scales. Reference: the same quantization in float64. On AMX CPUs 2+
    rows with K % 64 == 0 run on AMX-INT8 tiles (one or two 16-row tiles per pass of up to 32 rows; an odd number
    of column blocks); amx=False keeps VNNI there. chunks: as in test_small_gemm. Generated for the AVX512-BF16
    build (which also targets VNNI); elsewhere the int8 Linear stays on fbgemm."""
    with amx_tiles(ops, amx), small_gemm_chunks(ops, chunks):
        _check_small_gemm_int8(ops, dtype, rows, n, k, bias)


def _check_small_gemm_int8(ops, dtype, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * n * k + 1)
    x = torch.randn(rows, k, generator=g).to(dtype)
    if rows >= 3:
        x[2] = 0  # an all-zero row: scale 1, output = bias
    q, scale = _quantize_per_channel(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    xd = x.double()
    row_scale = (xd.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-300)
    xq = torch.round(xd / row_scale)
    expected = (xq @ q.double().t()) * row_scale * scale.double()
    if b is not None:
        expected = expected + b.double()
    shift = 128 * q.sum(dim=1, dtype=torch.int32)
    y = ops.small_gemm_int8(x, ops.pack_small_gemm_weight(q), scale.float(), shift, n, b)
    assert y.dtype == dtype and y.shape == (rows, n)
    # float32: the kernel scales by 127 / max|x| where the reference divides, which moves rare values across a
    # rounding boundary (one quantization step of one product); bfloat16: one rounding of the output
    step = (row_scale * scale.double()).expand(rows, n) * 127
    tol = step + (1e-4 if dtype == torch.float32 else 1.6e-2 * expected.abs() + 5e-2)
    assert ((y.double() - expected).abs() <= tol).all()


@over_builds("")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 1), (1, 49152), (3, 17), (33, 1000), (2, 64), (4, 129)])
def test_argmax_rows(ops, dtype, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    big = torch.randn(rows, n + 8, generator=g).to(dtype)
    logits = big[:, :n]  # strided rows
    torch.testing.assert_close(ops.argmax_rows(logits), logits.max(dim=-1).indices, atol=0, rtol=0)
    # ties: the first index wins, wherever the tied maxima fall relative to the 64-float blocks (bf16 rounding makes
    # many more of them in the random rows above too)
    tied = torch.zeros(rows, n, dtype=dtype)
    for r in range(rows):
        first = (r * 37) % n
        tied[r, first] = tied[r, (first + 63) % n] = tied[r, n - 1] = 5.0
    torch.testing.assert_close(ops.argmax_rows(tied), tied.max(dim=-1).indices, atol=0, rtol=0)
    # banned tokens: -inf entries, and a row that is all -inf (index 0, as torch)
    masked = logits.clone()
    masked[:, ::2] = float("-inf")
    masked[0] = float("-inf")
    torch.testing.assert_close(ops.argmax_rows(masked), masked.max(dim=-1).indices, atol=0, rtol=0)


@pytest.mark.kernels_build(ISAS[-1])
def test_forced_isa_is_the_one_loaded():
    """PAGEDSERVE_CPU_ISA picks the build that cpu_kernels() (what the layers call) returns."""
    isa = ISAS[-1]
    code = "from pagedserve.model_executor.kernels import cpu_kernels; print(cpu_kernels().isa())"
    env = {**os.environ, "PAGEDSERVE_CPU_ISA": isa}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == isa


@over_builds("")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_in_place(ops, dtype):
    """Qwen3's q/k norms: [T, heads, D] views inside the QKV output, normed in place (out=x) or into a new tensor."""
    g = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, d = 7, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)
    q = qkv[:, :heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    expected_q = F.rms_norm(q.float(), (d,), w.float(), 1e-6).to(dtype)
    expected_k = F.rms_norm(k.float(), (d,), w.float(), 1e-6).to(dtype)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    fresh = ops.rms_norm(k, None, w, 1e-6)
    assert fresh.is_contiguous() and fresh.shape == k.shape
    torch.testing.assert_close(fresh, expected_k, **_tol(dtype))
    assert ops.rms_norm(q, None, w, 1e-6, q).data_ptr() == q.data_ptr()
    ops.rms_norm(k, None, w, 1e-6, k)
    torch.testing.assert_close(q, expected_q, **_tol(dtype))
    torch.testing.assert_close(k, expected_k, **_tol(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)


def _reference_attention(q, keys, values, positions, scale, window=0, soft_cap=0.0, sinks=None):
    """q [n, H, D] at `positions` ([n]) over keys/values [ctx, H, D] (float32, GQA repeated): causal, each row's last
    `window` positions only (0: all), scores soft-capped (0: not), with a sink logit per head in each softmax's
    denominator (Hugging Face's eager order)."""
    scores = torch.einsum("thd,shd->hts", q.float(), keys) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    key_pos = torch.arange(keys.shape[0])[None, :]
    visible = key_pos <= positions[:, None]
    if window:
        visible &= key_pos > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.view(-1, 1, 1).expand(-1, scores.shape[1], 1)), dim=-1)
    probs = scores.softmax(-1)[..., :keys.shape[0]]
    return torch.einsum("hts,shd->thd", probs, values)


EXTRAS = [(0, 0.0, False), (40, 0.0, False), (0, 5.0, False), (0, 0.0, True), (40, 5.0, True), (16, 0.0, True)]


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("window, soft_cap, sinks", EXTRAS)
@pytest.mark.parametrize("n, first, threads", [(37, 0, 1), (70, 45, 2), (5, 300, 1), (300, 19, 2)])
@pytest.mark.parametrize("heads, kvh, d, bs", [(4, 2, 64, 16), (5, 1, 32, 8), (4, 4, 16, 16)])
@over_builds("amx", lambda caps: [(amx,) for amx in caps.amx_modes] if caps.prefill else [])
def test_prefill_attention_window_soft_cap_sinks(ops, q_dtype, cache_dtype, window, soft_cap, sinks, n, first, threads,
                                                 heads, kvh, d, bs, amx):
    """Sliding windows (Gemma's and gpt-oss's sliding layers: 16 and 40 keys, so that chunks of 5-300 tokens after 0-300
    cached ones cross the window's edge inside a chunk, at tile and update boundaries), Gemma 2's logit soft cap and
    gpt-oss's sinks, alone and together, on the float32, bfloat16-pair and AMX paths, against the reference. The
    blocks wholly behind the first row's window are NaN in the cache (a sliding layer's freed blocks): reading any
    of them would poison the output."""
    g = torch.Generator().manual_seed(n + first + window)
    ctx = first + n
    blocks = -(-ctx // bs) + 2
    k_cache, v_cache = _kv_caches(blocks + 1, bs, kvh, d, cache_dtype, "heads", g)
    block_ids = torch.randperm(blocks, generator=g)[:-(-ctx // bs)]
    keys = k_cache[block_ids].reshape(-1, kvh, d)[:ctx].float().repeat_interleave(heads // kvh, dim=1)
    values = v_cache[block_ids].reshape(-1, kvh, d)[:ctx].float().repeat_interleave(heads // kvh, dim=1)
    if window and first - window + 1 >= bs:  # the blocks behind the window point at a poisoned block
        k_cache[blocks], v_cache[blocks] = float("nan"), float("nan")
        block_ids[:(first - window + 1) // bs] = blocks
    q = torch.randn(n, heads, d, generator=g).to(q_dtype)
    sink_logits = torch.randn(heads, generator=g) * 2 if sinks else None
    out = torch.empty_like(q)
    torch.set_num_threads(threads)
    with amx_tiles(ops, amx):
        ops.paged_prefill_attention(q, k_cache, v_cache, block_ids, first, d ** -0.5, out, window=window,
                                    soft_cap=soft_cap, sinks=sink_logits)
    expected = _reference_attention(q, keys, values, torch.arange(first, ctx), d ** -0.5, window, soft_cap,
                                    sink_logits)
    torch.testing.assert_close(out.float(), expected, **(_tol(q_dtype) if q_dtype != torch.float32 else
                                                         dict(atol=1e-5, rtol=1e-4)))


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("window, soft_cap, sinks", EXTRAS)
@pytest.mark.parametrize("num_seqs, threads", [(3, 1), (1, 2)])
@pytest.mark.parametrize("heads, kvh, d, bs", [(4, 2, 64, 16), (6, 2, 40, 8), (4, 4, 16, 16)])
@over_builds("amx", lambda caps: [(amx,) for amx in caps.amx_modes])
def test_decode_attention_window_soft_cap_sinks(ops, q_dtype, cache_dtype, window, soft_cap, sinks, num_seqs, threads,
                                                heads, kvh, d, bs, amx):
    """The same extras in decode attention, on every path (bfloat16 grouped / AMX, float32 chunks, head_dim 40's
    portable loop) and with one long row split over two threads (its partial softmaxes merged with the sink)."""
    g = torch.Generator().manual_seed(num_seqs + window + d)
    blocks = 60
    k_cache, v_cache = _kv_caches(blocks, bs, kvh, d, cache_dtype, "heads", g)
    per_seq = blocks // num_seqs
    lens = torch.randint(per_seq * bs // 2, per_seq * bs, (num_seqs,), generator=g)
    tables = torch.randperm(blocks, generator=g)[:num_seqs * per_seq].view(num_seqs, per_seq)
    q = torch.randn(num_seqs, heads, d, generator=g).to(q_dtype)
    sink_logits = torch.randn(heads, generator=g) * 2 if sinks else None
    torch.set_num_threads(threads)
    with amx_tiles(ops, amx):
        out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, window=window,
                                         soft_cap=soft_cap, sinks=sink_logits)
    for i in range(num_seqs):
        keys = k_cache[tables[i]].reshape(-1, kvh, d)[:lens[i]].float().repeat_interleave(heads // kvh, dim=1)
        values = v_cache[tables[i]].reshape(-1, kvh, d)[:lens[i]].float().repeat_interleave(heads // kvh, dim=1)
        expected = _reference_attention(q[i:i + 1], keys, values, lens[i:i + 1] - 1, d ** -0.5, window, soft_cap,
                                         sink_logits)
        torch.testing.assert_close(out[i:i + 1].float(), expected, **(_tol(q_dtype) if q_dtype != torch.float32 else
                                                                      dict(atol=1e-5, rtol=1e-4)))


@over_builds("op", lambda caps: [("decode",)] + ([("prefill",)] if caps.prefill else []))
def test_attention_refuses_bad_extras(ops, op):
    """Sinks of the wrong length or dtype, a negative window or soft cap: a clear error, not a read past the sinks."""
    k_cache, v_cache = _kv_caches(4, 16, 2, 64, torch.float32, "heads")
    q = torch.randn(3, 4, 64)
    call = (lambda **kw: ops.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0], [1], [2]]),
                                                    torch.tensor([5, 9, 16]), 0.125, **kw)) if op == "decode" else \
        (lambda **kw: ops.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0]), 0, 0.125,
                                                  torch.empty_like(q), **kw))
    for kwargs in (dict(sinks=torch.zeros(3)), dict(sinks=torch.zeros(4, dtype=torch.bfloat16))):
        with pytest.raises(RuntimeError, match="sinks must be"):
            call(**kwargs)
    for kwargs in (dict(window=-1), dict(soft_cap=-1.0)):
        with pytest.raises(RuntimeError, match="must be >= 0"):
            call(**kwargs)


@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 40, 300])
@over_builds("amx", lambda caps: [(amx,) for amx in caps.amx_modes] if caps.prefill else [])
def test_prefill_attention_same_bits_however_chunked(ops, q_dtype, window, amx):
    """A row's output does not depend on how its prompt was cut into chunks (a draft model and its target, or a
    prefix-cache hit, chunk the same prompt differently and must agree bitwise): one 150-token chunk after 200
    cached tokens against the same rows as chunks of 37, 64 and 49."""
    g = torch.Generator().manual_seed(window)
    heads, kvh, d, bs, first, n = 4, 2, 64, 16, 200, 150
    k_cache, v_cache = _kv_caches(-(-(first + n) // bs), bs, kvh, d, q_dtype, "heads", g)
    block_ids = torch.arange(k_cache.shape[0])
    q = torch.randn(n, heads, d, generator=g).to(q_dtype)
    whole, parts = torch.empty_like(q), torch.empty_like(q)
    with amx_tiles(ops, amx):
        ops.paged_prefill_attention(q, k_cache, v_cache, block_ids, first, d ** -0.5, whole, window=window)
        start = 0
        for size in (37, 64, 49):
            ops.paged_prefill_attention(q[start:start + size], k_cache, v_cache, block_ids, first + start, d ** -0.5,
                                        parts[start:start + size], window=window)
            start += size
    assert torch.equal(whole, parts)
