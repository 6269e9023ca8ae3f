"""The GGUF block kernel alone at decode/prefill row counts, on a real file's weights, against our int8 and float32.

    python benchmarks/gguf_kernel_rows.py --gguf /work/peers/models/qwen3-0.6b-Q4_0.gguf --rows 1,16,32,256 \
        --threads 1 --build before=/tmp/old/_cpu_avx2.so --build after=pagedserve/model_executor/kernels/_cpu_avx2...so

One decoder layer's products as the engine runs them (q/k/v and gate/up fused, every part in the type the file
stores it in, e.g. Q4_K_M's Q6_K v_proj) plus the LM head (`output`, or the tied `token_embd`), each timed hot (one
weight, repeated: the kernel's arithmetic, not the memory). The same shapes run through our int8 product (the
native small GEMM where this CPU has it, else fbgemm's dynamic int8 linear, what `--quantization int8` runs on
AVX2) and float32 `F.linear`. `--build LABEL=SO` (repeatable) loads given builds of the kernels module and
alternates them round by round (default: the tree's own build), so an A/B of a kernel change is paired; the
builds' module names must differ (one process imports a module name once).
Prints microseconds per call (median over rounds) and GMAC/s (multiply-adds of the product per second); with several
builds, each build's speed relative to the first's (first's time / its time) in parentheses. `--cpu-time` (one
thread) times the calling thread's CPU time and takes the minimum over rounds instead: other processes on a shared
machine then add only their cache and frequency effects, never their run time, so small kernel differences show.
`--cold-mb MB` streams the weights from memory, as a decode step does (its weights are in no cache): each product
cycles through copies of its packed weight totalling at least MB (more than the last-level cache), and each build's
weight GB/s is printed in braces (no int8 / float32 peers then). The host allocator is set as the engine sets it
(host_allocator.py): otherwise a many-row product's output of 32 MiB or more is faulted in on every call (at 2048
rows of Qwen3-0.6B's QKV and gate/up, ~40% of the time).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.model_executor.host_allocator import keep_freed_memory
from pagedserve.model_executor.kernels import cpu_kernels

# fused products of a decoder layer -> the GGUF tensors of layer 0 they hold, in order
PRODUCTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
            "down": ("ffn_down",)}


def load_build(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def file_products(path: str, layer: int, with_head: bool) -> dict[str, list[tuple[np.ndarray, int, int]]]:
    """product -> its parts as (raw blocks [N, row bytes] uint8, ggml type id, K)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = {p: [f"blk.{layer}.{n}.weight" for n in parts] for p, parts in PRODUCTS.items()}
    if with_head:
        names["head"] = ["output.weight" if "output.weight" in tensors else "token_embd.weight"]
    out = {}
    for product, parts in names.items():
        out[product] = [(np.array(tensors[n].data), int(tensors[n].tensor_type), int(tensors[n].shape[0]))
                        for n in parts]
    return out


def int8_product(ops, n: int, k: int):
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 1e-3
    if ops.native_small_gemm(torch.int8, k):
        packed = ops.pack_small_gemm_weight(q)
        shift = 128 * q.sum(dim=1, dtype=torch.int32)
        return lambda x: ops.small_gemm_int8(x, packed, scale, shift, n, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(n, dtype=torch.long), 0)
        packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def time_call(fn, min_s: float, clock=time.perf_counter) -> float:
    """Seconds per call: the best of 3 batches after a warm-up, each batch at least min_s / 3 long."""
    fn()
    t0, n = clock(), 0
    while clock() - t0 < min_s / 3:
        fn()
        n += 1
    best = float("inf")
    for _ in range(3):
        t0 = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - t0) / n)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="a GGUF file (its layer --layer and its head are timed)")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--rows", default="1,16,32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=0.3, help="per product, row count, build and round")
    p.add_argument("--no-head", action="store_true")
    p.add_argument("--no-peers", action="store_true", help="skip int8 and float32")
    p.add_argument("--cold-mb", type=float, default=0.0, help="cycle each product through copies of its packed "
                   "weight totalling at least this many MB, so that every call reads it from memory")
    p.add_argument("--build", action="append", default=[], metavar="LABEL=SO")
    p.add_argument("--cpu-time", action="store_true", help="the calling thread's CPU time, minimum over rounds "
                   "(--threads 1 only: the other threads' time is not counted)")
    args = p.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time counts the calling thread only: use --threads 1")
    clock, summary = (time.thread_time, min) if args.cpu_time else (time.perf_counter, statistics.median)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # outputs reused as the engine's are, not page-faulted in every call
    modules = [Path(b.split("=", 1)[1]).name.split(".")[0] for b in args.build]
    if len(set(modules)) < len(modules):  # the second import of a module name returns the first build's code
        p.error(f"--build: two builds with the same module name ({', '.join(modules)}) cannot be compared in one "
                "process; compare a JIT build (pagedserve_cpu_<isa>_<hash>) against a prebuilt _cpu_<isa>")
    builds = {b.split("=", 1)[0]: load_build(b.split("=", 1)[1]) for b in args.build} or {"tree": cpu_kernels()}
    products = file_products(args.gguf, args.layer, not args.no_head)
    rows = [int(r) for r in args.rows.split(",")]
    fns: dict[tuple[str, str], object] = {}  # (engine, product) -> x -> y
    shapes, weight_bytes = {}, {}
    for product, parts in products.items():
        k = parts[0][2]
        n = sum(raw.shape[0] for raw, _, _ in parts)
        shapes[product] = (n, k, "+".join(sorted({_type_name(t) for _, t, _ in parts})))
        for label, ops in builds.items():
            packed = torch.cat([ops.gguf_repack(torch.from_numpy(raw), t, raw.shape[0], k) for raw, t, _ in parts])
            layout = torch.tensor([[t, raw.shape[0]] for raw, t, _ in parts], dtype=torch.int64)
            weight_bytes[product] = packed.numel()
            copies = itertools.cycle([packed] + [packed.clone() for _ in range(
                math.ceil(args.cold_mb * 1e6 / packed.numel()) - 1)])
            fns[(label, product)] = lambda x, ops=ops, copies=copies, layout=layout: ops.gguf_gemm(
                x, next(copies), layout, None)
        if not args.no_peers and not args.cold_mb:
            fns[("int8", product)] = int8_product(next(iter(builds.values())), n, k)
            w = torch.randn(n, k)
            fns[("fp32", product)] = lambda x, w=w: F.linear(x, w)
    engines = list(dict.fromkeys(e for e, _ in fns))
    print(f"{args.gguf}: layer {args.layer}, threads {args.threads}, rounds {args.rounds}; us per call "
          f"({'CPU time, min' if args.cpu_time else 'median'}), GMAC/s in brackets" +
          (f", speed vs {next(iter(builds))} in parentheses" if len(builds) > 1 else ""))
    for m in rows:
        times: dict[tuple[str, str], list[float]] = {key: [] for key in fns}
        xs = {k: torch.randn(m, k) for _, k, _ in shapes.values()}
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]  # alternate, so drift hits every engine alike
            for product, (n, k, _) in shapes.items():
                for engine in order:
                    times[(engine, product)].append(time_call(lambda: fns[(engine, product)](xs[k]), args.min_seconds,
                                                              clock))
        for product, (n, k, types) in shapes.items():
            cells = []
            first = summary(times[(next(iter(builds)), product)])
            for engine in engines:
                t = summary(times[(engine, product)])
                ratio = f" ({first / t:.3f})" if engine in builds and len(builds) > 1 else ""
                stream = f" {{{weight_bytes[product] / t / 1e9:4.1f} GB/s}}" if args.cold_mb and engine in builds else ""
                cells.append(f"{engine} {t * 1e6:9.1f} [{m * n * k / t / 1e9:5.1f}]{stream}{ratio}")
            print(f"rows {m:4d} {product:8s} {n:6d}x{k:<5d} {types:10s} " + "  ".join(cells), flush=True)
    return 0


def _type_name(type_id: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(type_id).name


if __name__ == "__main__":
    raise SystemExit(main())
