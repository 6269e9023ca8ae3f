"""`pagedserve bench make-model | serve | throughput | latency | compare | chunked-itl | roofline`."""
from __future__ import annotations

import argparse


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (see docs/BENCH.md)")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    # make-model ------------------------------------------------------------------------
    from pagedserve.benchmarks.shapes import SHAPES

    p = sub.add_parser("make-model", help="write a random-weight checkpoint in a real model's shape")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", nargs="*", default=None, metavar="FIELD=VALUE",
                   help="change shape fields, e.g. num_layers=4 vocab_size=1024")
    p.set_defaults(func=_run_make_model)

    # serve -----------------------------------------------------------------------------
    from pagedserve.benchmarks.serve import add_serve_args

    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (vllm bench serve's flags)")
    add_serve_args(p)
    p.set_defaults(func=_run_serve)

    # roofline --------------------------------------------------------------------------
    p = sub.add_parser("roofline", help="measure this machine's FLOP/s and bandwidth; bounds for a shape")
    p.add_argument("--shape", default="smollm2-135m", help="a shape name or a checkpoint dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "int8"],
                   help="weight dtype (bytes per parameter) and GEMM dtype")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--sizes", default="1024,2048,3072", help="GEMM sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bw-mib", type=int, default=512, help="tensor size for the bandwidth tests")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=_run_roofline)

    # engine benchmarks (need pagedserve.LLM) --------------------------------------------
    from pagedserve.benchmarks import offline

    offline.add_throughput_parser(sub)
    offline.add_latency_parser(sub)
    from pagedserve.benchmarks import compare

    compare.add_compare_parser(sub)
    compare.add_chunked_itl_parser(sub)


def _run_make_model(args: argparse.Namespace) -> int:
    from pagedserve.benchmarks.shapes import get_shape, make_model, parse_overrides

    make_model(get_shape(args.shape, parse_overrides(args.override)), args.out, dtype=args.dtype, seed=args.seed)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from pagedserve.benchmarks.serve import run_serve

    return run_serve(args)


def _run_roofline(args: argparse.Namespace) -> int:
    import json

    from pagedserve.benchmarks.roofline import format_report, measure_peaks, resolve_shape, roofline_for

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    peaks = measure_peaks(tuple(int(s) for s in args.sizes.split(",")), args.repeats, args.bw_mib, args.threads,
                          device=device, dtype=args.dtype if args.dtype != "int8" else "float32")
    r = roofline_for(resolve_shape(args.shape), peaks, args.dtype)
    print(format_report(r, peaks))
    if args.output_json:
        from dataclasses import asdict

        with open(args.output_json, "w") as f:
            json.dump({"machine": asdict(peaks), "roofline": r.to_dict()}, f, indent=2)
    return 0
