"""Decode step time with each CPU-path change switched off and on, alternating in one process.

    python benchmarks/cpu_path_ab.py --model /tmp/smollm2 --batch-sizes 1,32,64 --context 128 --rounds 4
    python benchmarks/cpu_path_ab.py --suite bf16 --model /tmp/smollm2 --batch-sizes 1,32 --context 128 --rounds 5

This machine's timings drift by 20% and more between processes and minutes, so a before/after pair is only
meaningful when both are measured side by side: the variants below run round-robin on engines built once (one
per linear backend and KV dtype, the same requests and KV contents), `--rounds` times, each round a median over `--steps` greedy decode steps;
the table reports the median over rounds. Variants (each adds one change to the one before):

  baseline      pre-packed oneDNN linears at every row count, PyTorch small ops (norm, rotary, silu*mul)
  +mkl-small-m  F.linear (MKL) below ONEDNN_MIN_ROWS rows (quantization/unquantized.py)
  +fused-ops    the compiled small ops (kernels/layer_ops.cpp): RMSNorm with the residual add, rotary in place,
                silu*mul (batch-1 products still through MKL)
  +native-gemm  products of up to NATIVE_GEMM_MAX_ROWS rows through the native packed small GEMM (small_gemm.cpp;
                it replaced the batch-1 GEMV of the first measurements) - the engine's default
  +bf16-kv      the same on a second engine with --kv-cache-dtype bfloat16 (half the KV bytes)
(all float32 models.)

`--suite prefetch`: one engine per `--dtypes`, the small GEMM's prefetch distance (`set_small_gemm_prefetch`: k
steps each weight stream is prefetched ahead; its default depends on the CPU) set to each of `--prefetch-steps`
in turn, round-robin on the same engine.

`--suite bf16` (issue 12): a float32 and a bfloat16 engine on the same checkpoint, round-robin:

  fp32          --dtype float32, the default CPU path
  bf16-before   --dtype bfloat16 as it ran before the native ops took bfloat16: PyTorch small ops (with float32
                round trips), oneDNN for batch-1 products, K/V written by index_copy_, decode attention on a
                float32 copy of q
  bf16-onednn   --dtype bfloat16 end to end: native RMSNorm/rotary/silu*mul/KV write/decode attention reading
                and writing bfloat16; GEMMs on oneDNN at every row count
  bf16          the same with the native packed small GEMM (VDPBF16PS, or AMX tiles where the CPU has them) up to
                native_gemm_max_rows(bfloat16) rows (default)
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import pagedserve.model_executor.quantization.unquantized as unquantized
from pagedserve.entrypoints.llm import LLM
from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.sampling_params import SamplingParams

VARIANTS = {  # name -> (linear backend, ONEDNN_MIN_ROWS, native small ops, KV cache dtype)
    "baseline": ("onednn", 1, False, "auto"),
    "+mkl-small-m": ("onednn", unquantized.ONEDNN_MIN_ROWS, False, "auto"),
    "+fused-ops": ("onednn", unquantized.ONEDNN_MIN_ROWS, True, "auto"),
    "+native-gemm": ("native", unquantized.ONEDNN_MIN_ROWS, True, "auto"),
    "+bf16-kv": ("native", unquantized.ONEDNN_MIN_ROWS, True, "bfloat16"),
}
DEFAULT = "+native-gemm"


class LegacyBf16Attention:
    """The kernels as the CPU attention backend used them before they took bfloat16: K/V written by index_copy_, decode
    attention on a float32 copy of q, its output copied back."""

    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name):  # every other kernel as it is
        return getattr(self.real, name)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        if k.dtype == torch.float32:
            return self.real.write_kv(k, v, k_cache, v_cache, slot_mapping)
        blocks, offsets = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
        k_cache[blocks, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, offsets] = v.to(v_cache.dtype)

    def paged_decode_attention(self, q, k_cache, v_cache, tables, lens, scale, out=None):
        if q.dtype == torch.float32:
            return self.real.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out)
        o = self.real.paged_decode_attention(q.float(), k_cache, v_cache, tables, lens, scale)
        out.copy_(o)
        return out


BF16_VARIANTS = {  # name -> (model dtype, small ops in bf16 native, attention glue, native GEMM rows; None: default)
    "fp32": ("float32", True, "new", None),
    "bf16-before": ("bfloat16", False, "legacy", 0),
    "bf16-onednn": ("bfloat16", True, "new", 0),
    "bf16": ("bfloat16", True, "new", None),
}


def set_native_gemm_rows(engine, rows: int | None) -> None:
    """Every packed Linear of the engine's model takes the native small GEMM up to `rows` rows (None: its default),
    and so does the whole-stack decode."""
    model = engine.runner.model
    for module in model.modules():
        if isinstance(module, Linear) and getattr(module, "small_gemm_weight", None) is not None:
            default = unquantized.native_gemm_max_rows(module.small_gemm_weight.dtype)
            module.native_max_rows = default if rows is None else rows
    if model.fused_decode is not None:
        model.fused_decode.max_rows = min(m.native_max_rows for m in model.modules()
                                          if isinstance(m, Linear) and m.small_gemm_weight is not None)


def set_fused_ops(engine, on: bool) -> None:
    """The attention backend's fused small ops (RMSNorm, rotary, silu*mul) on, or PyTorch's ops (and no
    whole-stack decode, which runs them natively)."""
    runner = engine.runner
    if not hasattr(runner, "native_decode_stack"):  # the model's own, kept while switched off
        runner.native_decode_stack = runner.model.fused_decode
    if on:
        runner.attn_backend.__dict__.pop("fused_ops", None)
    else:
        runner.attn_backend.fused_ops = lambda x: None
    runner.model.fused_decode = runner.native_decode_stack if on else None


def decoding_engine(model: str, batch: int, context: int, threads: int, kv_cache_dtype: str,
                    dtype: str = "float32", linear_backend: str = "auto"):
    """An engine with `batch` requests past their prefill, each with `context` tokens in the cache."""
    decode_budget = 512  # more decode steps than the rounds take: no request finishes mid-measurement
    llm = LLM(model, num_threads=threads, max_model_len=context + decode_budget, kv_cache_dtype=kv_cache_dtype,
              num_kv_blocks=batch * -(-(context + decode_budget) // 16), dtype=dtype,
              linear_backend=linear_backend)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=decode_budget, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(str(i), rng.integers(0, engine.model_config.vocab_size, context).tolist(), params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    engine.step()
    return engine


def step_ms(engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", default="1,32,64")
    p.add_argument("--context", type=int, default=128, help="tokens in each request's KV cache")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--suite", choices=["issue7", "bf16", "prefetch"], default="issue7")
    p.add_argument("--dtypes", default="float32", help="--suite prefetch: the model dtypes, one engine each")
    p.add_argument("--prefetch-steps", default="4,16", help="--suite prefetch: the distances compared")
    args = p.parse_args(argv)
    if cpu_kernels() is None:
        raise SystemExit("the native CPU kernels did not build: nothing to compare")
    if args.suite == "bf16":
        return bf16_suite(args)
    if args.suite == "prefetch":
        return prefetch_suite(args)
    print(f"| B | {' | '.join(VARIANTS)} | default vs baseline |")
    print(f"|---:|{'---:|' * (len(VARIANTS) + 1)}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        # the "onednn" engine keeps the float weights its 1-row F.linear (MKL) needs; "native" drops them
        engines = {(backend, kv_dtype): decoding_engine(args.model, batch, args.context, args.threads, kv_dtype,
                                                        linear_backend=backend)
                   for backend, _, _, kv_dtype in VARIANTS.values()}
        results: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, (backend, min_rows, native, kv_dtype) in VARIANTS.items():
                unquantized.ONEDNN_MIN_ROWS = min_rows
                engine = engines[backend, kv_dtype]
                set_fused_ops(engine, native)
                engine.step()  # the first step after a switch warms caches for the new path
                results[name].append(step_ms(engine, args.steps))
        med = {name: float(np.median(v)) for name, v in results.items()}
        cells = " | ".join(f"{med[n]:.1f}" for n in VARIANTS)
        print(f"| {batch} | {cells} | {med['baseline'] / med[DEFAULT]:.2f}x |", flush=True)
        del engines
    return 0


def bf16_suite(args) -> int:
    kernels = cpu_kernels()
    print(f"native kernels: {kernels.isa()}; threads {args.threads}; context {args.context}; decode step ms "
          f"(median over {args.rounds} rounds of per-round medians of {args.steps} steps)")
    print(f"| B | {' | '.join(BF16_VARIANTS)} | bf16 vs fp32 | bf16 vs bf16-before | bf16 vs bf16-onednn |")
    print(f"|---:|{'---:|' * (len(BF16_VARIANTS) + 3)}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        engines = {dtype: decoding_engine(args.model, batch, args.context, args.threads, "auto", dtype)
                   for dtype in ("float32", "bfloat16")}
        results: dict[str, list[float]] = {name: [] for name in BF16_VARIANTS}
        try:
            for _ in range(args.rounds):
                for name, (dtype, native_small, glue, gemm_rows) in BF16_VARIANTS.items():
                    set_fused_ops(engines[dtype], native_small)
                    engines[dtype].runner.attn_backend.kernels = \
                        kernels if glue == "new" else LegacyBf16Attention(kernels)
                    set_native_gemm_rows(engines[dtype], gemm_rows)
                    engines[dtype].step()  # the first step after a switch warms caches for the new path
                    results[name].append(step_ms(engines[dtype], args.steps))
        finally:
            for engine in engines.values():
                set_fused_ops(engine, True)
                engine.runner.attn_backend.kernels = kernels
        med = {name: float(np.median(v)) for name, v in results.items()}
        cells = " | ".join(f"{med[n]:.1f}" for n in BF16_VARIANTS)
        print(f"| {batch} | {cells} | {med['fp32'] / med['bf16']:.2f}x | {med['bf16-before'] / med['bf16']:.2f}x | "
              f"{med['bf16-onednn'] / med['bf16']:.2f}x |", flush=True)
        del engines
    return 0


def prefetch_suite(args) -> int:
    kernels = cpu_kernels()
    distances = [int(s) for s in args.prefetch_steps.split(",")]
    default = kernels.small_gemm_prefetch()
    print(f"native kernels: {kernels.isa()}; threads {args.threads}; context {args.context}; default prefetch "
          f"{default} k steps; decode step ms (median over {args.rounds} rounds of per-round medians of {args.steps} "
          f"steps); ratio: the first distance's time / each one's")
    print(f"| dtype | B | {' | '.join(f'{s} steps' for s in distances)} |")
    print(f"|---|---:|{'---:|' * len(distances)}")
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            engine = decoding_engine(args.model, batch, args.context, args.threads, "auto", dtype)
            results: dict[int, list[float]] = {s: [] for s in distances}
            try:
                for _ in range(args.rounds):
                    for s in distances:
                        kernels.set_small_gemm_prefetch(s)
                        engine.step()
                        results[s].append(step_ms(engine, args.steps))
            finally:
                kernels.set_small_gemm_prefetch(default)
            med = {s: float(np.median(v)) for s, v in results.items()}
            first = distances[0]
            cells = " | ".join(f"{med[s]:.1f} ({med[first] / med[s]:.2f}x)" for s in distances)
            print(f"| {dtype} | {batch} | {cells} |", flush=True)
            del engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
