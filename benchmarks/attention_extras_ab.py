"""Windowed, soft-capped and sink attention on the CPU: the native kernels against the reference paths they replace.

    python benchmarks/attention_extras_ab.py [--context 8192] [--chunk 2048] [--batch 4] [--rounds 5] [--threads 1]

Before issue 51's kernel work the CPU backend ran a sliding layer's prefill chunks, every row of a soft-capped layer
(Gemma 2) and every row of a layer with sinks (gpt-oss) through the reference paths (attention/torch_sdpa.py: SDPA
over the window's gathered blocks, or explicit matmuls for a cap or sinks); now the native decode and prefill
kernels take all three. One layer's attention, random bfloat16 cache and queries, per case:

  * prefill: one --chunk-token chunk ending at --context (the chunk after context - chunk cached tokens);
  * decode: --batch rows, each with a --context-token context (not for a window alone: its decode was native).

Shapes: gemma-3-1b's sliding layer (4 heads / 1 KV head of 256, window 512), gemma-2-2b's sliding layer (8 / 4 of
256, window 4096, soft cap 50), gpt-oss-20b's sliding layer (64 / 8 of 64, window 128, sinks). The variants alternate
within each round; the table gives the best round's CPU time per call (process time: one thread, so wall time on
a quiet core) and the ratio.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from pagedserve.model_executor.attention.cpu import CpuAttentionBackend
from pagedserve.model_executor.attention.metadata import AttentionMetadata, PrefillSpan, chunk_causal_mask
from pagedserve.model_executor.attention.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata

BLOCK = 16
# name: (heads, KV heads, head_dim, window, soft cap, sinks), the steps that ran the reference before (a window
# alone was native in decode already)
SHAPES = {
    "gemma-3-1b sliding": ((4, 1, 256, 512, None, False), ("prefill",)),
    "gemma-2-2b sliding, cap 50": ((8, 4, 256, 4096, 50.0, False), ("prefill", "decode")),
    "gpt-oss-20b sliding, sinks": ((64, 8, 64, 128, None, True), ("prefill", "decode")),
}


def case(shape, kind: str, context: int, chunk: int, batch: int):
    """(q, k, v, caches, metadata, extras) of one layer's step: a prefill chunk or `batch` decode rows."""
    heads, kvh, d, window, cap, sinks = shape
    rows = chunk if kind == "prefill" else batch
    seqs = 1 if kind == "prefill" else batch
    per_seq = -(-context // BLOCK)
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(seqs * per_seq, 2, kvh, BLOCK, d, generator=g) * 0.5).bfloat16()
    k_cache, v_cache = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    tables = torch.arange(seqs * per_seq).view(seqs, per_seq)
    q = torch.randn(rows, heads, d, generator=g).bfloat16()
    k = torch.randn(rows, kvh, d, generator=g).bfloat16()
    v = torch.randn(rows, kvh, d, generator=g).bfloat16()
    if kind == "prefill":
        first = context - chunk
        slots = torch.arange(first, context)
        meta = AttentionMetadata(slots, 0, None, None, BLOCK,
                                 [PrefillSpan(0, chunk, context, tables[0], chunk_causal_mask(first, context, "cpu"))])
    else:
        slots = tables[:, -1] * BLOCK + (context - 1) % BLOCK
        meta = AttentionMetadata(slots, batch, tables, torch.full((batch,), context), BLOCK, [])
    extras = (window, cap, torch.randn(heads, generator=g) if sinks else None)
    return q, k, v, k_cache, v_cache, meta, d ** -0.5, extras


def cpu_ms(fn, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = CpuAttentionBackend(torch.device("cpu"))
    assert native.kernels is not None, "the native CPU kernels did not load"
    print(f"kernels {native.kernels.isa()}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}", flush=True)
    print("| layer | step | reference ms | native ms | reference / native |\n|---|---|---|---|---|")
    for name, (shape, kinds) in SHAPES.items():
        for kind in kinds:
            q, k, v, kc, vc, meta, scale, (window, cap, sinks) = case(shape, kind, args.context, args.chunk,
                                                                      args.batch)
            ref_meta = TorchSDPAMetadata.from_common(meta)  # its decode mask built once, as once per engine step
            variants = {
                "reference": lambda: TorchSDPABackend.attend(q, k, v, kc, vc, ref_meta, scale, window, cap, sinks),
                "native": lambda: native.forward(q, k, v, kc, vc, meta, scale, window, cap, sinks),
            }
            torch.testing.assert_close(variants["native"]().float(), variants["reference"]().float(), atol=3e-2,
                                       rtol=3e-2)
            calls = 1 if kind == "prefill" else 20
            best = {n: float("inf") for n in variants}
            for r in range(args.rounds):
                for n in (variants if r % 2 == 0 else reversed(list(variants))):
                    best[n] = min(best[n], cpu_ms(variants[n], calls))
            print(f"| {name} | {kind} | {best['reference']:.2f} | {best['native']:.2f} | "
                  f"{best['reference'] / best['native']:.2f}x |", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
