"""The decoder's GEMMs at decode row counts: the library kernel vs the native packed small GEMM, side by side.

    python benchmarks/gemm_ab.py --shape smollm2-135m --dtype bfloat16 --rows 1,2,4,8,16,32,64 --threads 2
    python benchmarks/gemm_ab.py --shape smollm2-135m --dtype int8 --rows 1,8,16,32,64,128 --threads 2

float32 / bfloat16: pre-packed oneDNN vs `small_gemm`. int8 (weight-only int8, `--quantization int8`): fbgemm's
dynamic int8 product (`quantized.linear_dynamic`, activations quantized per tensor) vs `small_gemm_int8` (VNNI,
activations quantized per row), both on float32 activations as the int8 engine runs them.

Every layer gets its own random weights (as in a model: each product streams its weight from memory, none is
still in cache from the call before), one set per backend; per row count the backends alternate over
`--rounds` rounds, each timing all the layers' products once (qkv, o, gate_up, down). Reports ms per pass over
the layers (median over rounds) and library / native.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.benchmarks.shapes import SHAPES
from pagedserve.model_executor.kernels import cpu_kernels
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.quantization.int8 import Int8Config


def layer_matrices(shape) -> list[tuple[int, int]]:
    """(K, N) of one decoder layer's four products."""
    h, d = shape.hidden_size, shape.dim_head
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
    return [(h, qkv), (shape.num_heads * d, h), (h, 2 * shape.intermediate_size), (shape.intermediate_size, h)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8"])
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
    library, native = [], []
    for _ in range(layers):
        lib_layer, native_layer = [], []
        for k, n in mats:
            w = torch.randn(n, k)
            if dtype == torch.int8:
                library_linear, native_linear = (Linear(k, n, False, Int8Config(allow_native=allow_native))
                                                 for allow_native in (False, True))
                for linear in (library_linear, native_linear):
                    linear.weight.data.copy_(w)
                    linear.process_weights_after_loading()
                lib_layer.append(library_linear.fbgemm_weight)
                t = native_linear.native_decode_tensors()
                native_layer.append((t.packed_weight, t.int8_scale, t.int8_shift))
            else:
                w = w.to(dtype)
                lib_layer.append(torch.ops.mkldnn._reorder_linear_weight(w, None))
                native_layer.append(ops.pack_small_gemm_weight(w))
        library.append(lib_layer)
        native.append(native_layer)
    lib_name = "fbgemm" if dtype == torch.int8 else "oneDNN"
    print(f"{args.shape}, {args.dtype}, {layers} layers x {len(mats)} products, {args.threads} threads, "
          f"native build {ops.isa()}")
    print(f"| rows | {lib_name} ms | native ms | {lib_name} / native |")
    print("|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k).to(torch.float32 if dtype == torch.int8 else dtype) for k, _ in mats]

        def run_library():
            for layer in library:
                for x, w in zip(xs, layer):
                    if dtype == torch.int8:
                        torch.ops.quantized.linear_dynamic(x, w, True)
                    else:
                        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        def run_native():
            for layer in native:
                for x, w, (_, n) in zip(xs, layer, mats):
                    if dtype == torch.int8:
                        ops.small_gemm_int8(x, *w, n, None)
                    else:
                        ops.small_gemm(x, w, n, None)

        times: dict[str, list[float]] = {"library": [], "native": []}
        run_library(), run_native()  # warm-up
        for _ in range(args.rounds):
            for name, fn in (("library", run_library), ("native", run_native)):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        a, b = statistics.median(times["library"]), statistics.median(times["native"])
        print(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
