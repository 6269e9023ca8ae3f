"""The attention backends against a plain reference and against each other: the native CPU backend (and its
SDPA fallbacks) and the PyTorch SDPA reference backend."""
from __future__ import annotations

import pytest
import torch

from pagedserve.model_executor.attention.metadata import (
    AttentionMetadata,
    PrefillSpan,
    chunk_causal_mask,
)
from pagedserve.model_executor.attention.selector import get_attention_backend
from pagedserve.model_executor.kernels import cpu_kernels

BS, KVH, H, HD = 16, 2, 6, 32


def reference(q, keys, values, first, window=None, soft_cap=None):
    """Causal attention of queries at positions first.. over keys 0..; q [n, H, D], keys [ctx, KVH, D]; with a
    window, each query sees only the last `window` positions (its own included); with a soft cap, scores become
    cap * tanh(scores / cap)."""
    n, ctx = q.shape[0], keys.shape[0]
    k = keys.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    v = values.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * HD ** -0.5
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    mask = torch.arange(ctx)[None, :] <= torch.arange(first, first + n)[:, None]
    if window is not None:
        mask &= torch.arange(ctx)[None, :] > torch.arange(first, first + n)[:, None] - window
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def make_backend(name: str, monkeypatch):
    """"cpu" (the native kernels), "cpu-fallback" (the CPU backend with its kernels off: its SDPA paths) or
    "torch" (the reference backend)."""
    if name == "cpu" and cpu_kernels() is None:
        pytest.fail("the native CPU kernel did not build (needs a C++ compiler and ninja)")
    if name == "cpu-fallback":
        monkeypatch.setattr("pagedserve.model_executor.attention.cpu.cpu_kernels", lambda: None)
    return get_attention_backend(name.removesuffix("-fallback"), torch.device("cpu"))


def mixed_batch(backend, dtype, kv_dtype):
    """Three decodes (contexts 1, 17, 40), a first prefill chunk (12 tokens) and a later chunk (20 after 35), their
    earlier context already in a cache of the backend's layout. Returns (q, k, v views of one fused QKV output,
    k_cache, v_cache, meta, [(cached, new)], [(keys, values)] of every sequence)."""
    g = torch.Generator().manual_seed(0)
    num_blocks = 64
    k_cache, v_cache = backend.allocate_kv_cache(1, num_blocks, BS, KVH, HD, kv_dtype, torch.device("cpu"))[0]
    seqs = [(0, 1), (16, 1), (39, 1), (0, 12), (35, 20)]  # (tokens already cached, new tokens)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, full_kv, slots, queries = [], [], [], []
    for cached, new in seqs:
        n_blocks = -(-(cached + new) // BS)
        table = [perm.pop() for _ in range(n_blocks)]
        keys = torch.randn(cached + new, KVH, HD, generator=g).to(dtype)
        values = torch.randn(cached + new, KVH, HD, generator=g).to(dtype)
        pos = torch.arange(cached + new)
        blocks, offsets = torch.tensor(table)[pos // BS], pos % BS
        k_cache[blocks[:cached], offsets[:cached]] = keys[:cached].to(kv_dtype)
        v_cache[blocks[:cached], offsets[:cached]] = values[:cached].to(kv_dtype)
        tables.append(table)
        full_kv.append((keys, values))
        slots.append((blocks * BS + offsets)[cached:])
        queries.append(torch.randn(new, H, HD, generator=g).to(dtype))
    q = torch.cat(queries)
    k_new = torch.cat([kv[0][c:] for kv, (c, _) in zip(full_kv, seqs)])
    v_new = torch.cat([kv[1][c:] for kv, (c, _) in zip(full_kv, seqs)])
    width = max(len(t) for t in tables[:3])
    decode_bt = torch.tensor([t + [0] * (width - len(t)) for t in tables[:3]])
    prefills = []
    start = 3
    for (cached, new), table in zip(seqs[3:], tables[3:]):
        prefills.append(PrefillSpan(start, new, cached + new, torch.tensor(table),
                                    chunk_causal_mask(cached, cached + new, torch.device("cpu"))))
        start += new
    meta = backend.build_metadata(AttentionMetadata(torch.cat(slots), 3, decode_bt,
                                                    torch.tensor([c + n for c, n in seqs[:3]]), BS, prefills))
    # q, k and v as the model passes them: strided views of one fused QKV output
    qkv = torch.cat([q.flatten(1), k_new.flatten(1), v_new.flatten(1)], dim=1)
    q_view = qkv[:, :H * HD].view(-1, H, HD)
    k_view = qkv[:, H * HD:(H + KVH) * HD].view(-1, KVH, HD)
    v_view = qkv[:, (H + KVH) * HD:].view(-1, KVH, HD)
    return q_view, k_view, v_view, k_cache, v_cache, meta, seqs, full_kv


@pytest.mark.parametrize("backend_name", ["cpu", "cpu-fallback", "torch"])
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])
def test_mixed_batch_matches_reference(backend_name, dtype, kv_dtype, monkeypatch):
    backend = make_backend(backend_name, monkeypatch)
    q, k, v, k_cache, v_cache, meta, seqs, full_kv = mixed_batch(backend, dtype, kv_dtype)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, HD ** -0.5)
    offset = 0
    tol = 1e-5 if kv_dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    for (cached, new), (keys, values) in zip(seqs, full_kv):
        expected = reference(q[offset:offset + new].float(), keys.float(), values.float(), cached)
        torch.testing.assert_close(out[offset:offset + new].float(), expected, atol=tol, rtol=tol)
        offset += new


@pytest.mark.parametrize("backend_name", ["cpu", "cpu-fallback", "torch"])
@pytest.mark.parametrize("window", [1, 8, 20, 64])
def test_sliding_window_matches_reference(backend_name, window, monkeypatch):
    """Windowed decode rows (contexts 1, 17, 40) and prefill chunks (a first chunk of 12, a later chunk of 20 after
    35: it crosses the window edge) against the windowed reference; a window wider than every context is plain
    causal attention."""
    backend = make_backend(backend_name, monkeypatch)
    q, k, v, k_cache, v_cache, meta, seqs, full_kv = mixed_batch(backend, torch.float32, torch.float32)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, HD ** -0.5, window)
    offset = 0
    for (cached, new), (keys, values) in zip(seqs, full_kv):
        expected = reference(q[offset:offset + new], keys, values, cached, window)
        torch.testing.assert_close(out[offset:offset + new], expected, atol=1e-5, rtol=1e-5)
        offset += new


@pytest.mark.parametrize("backend_name", ["cpu", "cpu-fallback", "torch"])
@pytest.mark.parametrize("window", [None, 20])
def test_logits_soft_cap_matches_reference(backend_name, window, monkeypatch):
    """Gemma 2's attention-logit soft cap (a cap of 2: most scores of these random q/k are past it) on decode rows
    and prefill chunks, with and without a window: every backend, the native one by its reference path."""
    backend = make_backend(backend_name, monkeypatch)
    q, k, v, k_cache, v_cache, meta, seqs, full_kv = mixed_batch(backend, torch.float32, torch.float32)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, HD ** -0.5, window, 2.0)
    offset = 0
    for (cached, new), (keys, values) in zip(seqs, full_kv):
        expected = reference(q[offset:offset + new], keys, values, cached, window, soft_cap=2.0)
        torch.testing.assert_close(out[offset:offset + new], expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(expected, reference(q[offset:offset + new], keys, values, cached, window),
                                  atol=1e-3) or new == cached + new == 1  # the cap changes the result
        offset += new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_torch_reference_backend(dtype, monkeypatch):
    """The native CPU backend (head-major joint layout) against the PyTorch SDPA reference backend (token-major):
    the same outputs, and the same K/V written at every slot of the step."""
    cpu, ref = make_backend("cpu", monkeypatch), make_backend("torch", monkeypatch)
    assert cpu.name == "cpu" and ref.name == "torch"
    cpu_inputs, ref_inputs = mixed_batch(cpu, dtype, dtype), mixed_batch(ref, dtype, dtype)
    assert not cpu_inputs[3].is_contiguous() and ref_inputs[3].is_contiguous()  # two layouts, one indexing
    out = cpu.forward(*cpu_inputs[:6], HD ** -0.5)
    expected = ref.forward(*ref_inputs[:6], HD ** -0.5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(cpu_inputs[3], ref_inputs[3], atol=0, rtol=0)  # K cache, every block
    torch.testing.assert_close(cpu_inputs[4], ref_inputs[4], atol=0, rtol=0)


def test_each_forward_builds_the_backend_metadata_once_and_every_layer_reads_it(tiny_model_dir):
    """The metadata-builder seam: a model's forward asks its backend for its metadata once, and every layer's
    attention gets that object (here the torch backend's, whose decode mask is then built once for all layers)."""
    from pagedserve.model_executor.attention.metadata import PrefillSpan
    from pagedserve.model_executor.attention.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
    from pagedserve.model_executor.model_config import ModelConfig
    from pagedserve.model_executor.models.registry import get_model_class
    from pagedserve.model_executor.parallel_state import SINGLE
    from pagedserve.model_executor.quantization.unquantized import UnquantizedConfig

    class Recording(TorchSDPABackend):
        def __init__(self, device):
            super().__init__(device)
            self.built, self.seen = [], []

        def build_metadata(self, common):
            self.built.append(super().build_metadata(common))
            return self.built[-1]

        def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, logits_soft_cap=None,
                    sinks=None):
            self.seen.append(meta)
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, sinks)

    cfg = ModelConfig.from_dir(tiny_model_dir("llama"))
    backend = Recording(torch.device("cpu"))
    model = get_model_class(cfg.architecture)(cfg, SINGLE, backend, UnquantizedConfig("torch")).eval()
    caches = backend.allocate_kv_cache(cfg.num_layers, 4, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                                       torch.device("cpu"))
    # one decode row (context of 3 tokens in block 0) and a 5-token prefill in block 1
    meta = AttentionMetadata(torch.tensor([2] + [BS + i for i in range(5)]), 1, torch.tensor([[0]]),
                             torch.tensor([3]), BS, [PrefillSpan(1, 5, 5, torch.tensor([1]), None)])
    with torch.inference_mode():
        model(torch.arange(1, 7), torch.tensor([2, 0, 1, 2, 3, 4]), caches, meta, torch.tensor([0, 5]))
    assert len(backend.built) == 1 and isinstance(backend.built[0], TorchSDPAMetadata)
    assert len(backend.seen) == cfg.num_layers and all(m is backend.built[0] for m in backend.seen)
    assert "decode_mask" in vars(backend.built[0])  # cached on the one object every layer shared


def test_attention_backend_engine_argument():
    import argparse

    from pagedserve.config import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args([]).attention_backend == "auto"
    assert EngineArgs.from_cli_args(parser.parse_args(["--attention-backend", "torch"])).attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend must be one of auto, cpu, triton, torch"):
        EngineArgs(attention_backend="flash")


def test_selector_resolves_names_and_refuses_bad_ones(monkeypatch):
    from pagedserve.model_executor.attention.selector import (
        ATTENTION_BACKENDS,
        resolve_attention_backend_name,
    )

    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND", raising=False)
    assert set(ATTENTION_BACKENDS) == {"cpu", "triton", "torch"}
    assert resolve_attention_backend_name("auto", "cpu") == "cpu"
    assert resolve_attention_backend_name("auto", "mps") == "torch"
    assert resolve_attention_backend_name("torch", "cuda") == "torch"
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "torch")  # the default of "auto" only
    assert resolve_attention_backend_name("auto", "cpu") == "torch"
    assert resolve_attention_backend_name("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match="auto, cpu, triton, torch"):
        get_attention_backend("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        get_attention_backend("cpu", torch.device("meta"))


@pytest.mark.parametrize("num_seqs, num_kv_heads, threads", [(1, 2, 2), (2, 4, 4), (1, 2, 3), (5, 2, 2), (3, 4, 1)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 23])
def test_decode_kernel_every_task_split(num_seqs, num_kv_heads, threads, kv_dtype, window):
    """With at least as many sequences as threads the kernel runs one task per sequence; with fewer it splits each
    context into ranges and merges their partial softmaxes (cases chosen to hit both, a 1-token context leaves a
    range empty). Every split gives plain attention over the sequence's blocks; with a window (23: it starts inside
    a block) over each sequence's last 23 positions."""
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
        out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, HD ** -0.5, window=window)
        single = kernels.paged_decode_attention(q[:1], k_cache, v_cache, tables[:1], torch.tensor([1]), HD ** -0.5)
    finally:
        torch.set_num_threads(old)
    for i in range(num_seqs):
        first = max(0, int(lens[i]) - window) if window else 0
        keys = k_cache[tables[i]].reshape(-1, num_kv_heads, HD)[first:lens[i]].float()
        values = v_cache[tables[i]].reshape(-1, num_kv_heads, HD)[first:lens[i]].float()
        k = keys.repeat_interleave(heads // num_kv_heads, dim=1).transpose(0, 1)
        v = values.repeat_interleave(heads // num_kv_heads, dim=1).transpose(0, 1)
        expected = ((q[i].unsqueeze(1) @ k.transpose(1, 2)) * HD ** -0.5).softmax(-1) @ v
        torch.testing.assert_close(out[i], expected.squeeze(1), atol=1e-5, rtol=1e-5)
    # a 1-token context (split or not) returns that token's value for every head of the group
    first_value = v_cache[tables[0, 0], 0].float().repeat_interleave(heads // num_kv_heads, dim=0)
    torch.testing.assert_close(single[0], first_value, atol=1e-6, rtol=1e-6)
