"""The decoder's GEMMs at decode row counts: pre-packed oneDNN vs the native packed small GEMM, side by side.

    python benchmarks/gemm_ab.py --shape smollm2-135m --dtype bfloat16 --rows 1,2,4,8,16,32,64 --threads 2

Every layer gets its own random weights (as in a model: each product streams its weight from memory, none is
still in cache from the call before), one set per backend; per row count the backends alternate over
`--rounds` rounds, each timing all the layers' products once (qkv, o, gate_up, down). Reports ms per pass over
the layers (median over rounds) and oneDNN / native.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.benchmarks.shapes import SHAPES
from pagedserve.model_executor.kernels import cpu_kernels


def layer_matrices(shape) -> list[tuple[int, int]]:
    """(K, N) of one decoder layer's four products."""
    h, d = shape.hidden_size, shape.dim_head
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
    return [(h, qkv), (shape.num_heads * d, h), (h, 2 * shape.intermediate_size), (shape.intermediate_size, h)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--layers", type=int, default=None, help="default: the shape's layer count")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    ops = cpu_kernels()
    dtype = getattr(torch, args.dtype)
    if ops is None or not ops.native_small_gemm(dtype):
        raise SystemExit(f"no native small GEMM for {args.dtype} on this CPU / build")
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    mats = layer_matrices(shape)
    layers = args.layers or shape.num_layers
    weights = [[torch.randn(n, k).to(dtype) for k, n in mats] for _ in range(layers)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights]
    native = [[ops.pack_small_gemm_weight(w) for w in layer] for layer in weights]
    del weights
    print(f"{args.shape}, {args.dtype}, {layers} layers x {len(mats)} products, {args.threads} threads, "
          f"native build {ops.isa()}")
    print("| rows | oneDNN ms | native ms | oneDNN / native |")
    print("|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k).to(dtype) for k, _ in mats]

        def run_onednn():
            for layer in onednn:
                for x, w in zip(xs, layer):
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        def run_native():
            for layer in native:
                for x, w, (_, n) in zip(xs, layer, mats):
                    ops.small_gemm(x, w, n, None)

        times: dict[str, list[float]] = {"onednn": [], "native": []}
        run_onednn(), run_native()  # warm-up
        for _ in range(args.rounds):
            for name, fn in (("onednn", run_onednn), ("native", run_native)):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        a, b = statistics.median(times["onednn"]), statistics.median(times["native"])
        print(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
