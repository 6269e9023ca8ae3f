"""One MoE layer's experts at decode batch sizes: the per-expert F.linear path (the layer before the native experts)
vs the experts packed for the native small GEMM (bfloat16 / float32, and int8 as `--quantization int8` packs them),
side by side; "dispatch" is the grouped loop with a no-op expert (the Python cost of routing and grouping).

    python benchmarks/moe_layer_ab.py --dtype bfloat16 --tokens 1,16,32 --threads 2

Default shape: Qwen3-30B-A3B's layer (hidden 2048, 128 experts, top-8, expert width 768), random weights and routes.
Per token count the paths alternate over `--rounds` rounds; reports the best ms per layer call and torch / path.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedserve.model_executor.layers.fused_moe import FusedMoE, grouped_experts, select_experts
from pagedserve.model_executor.quantization.int8 import Int8Config
from pagedserve.model_executor.quantization.unquantized import UnquantizedConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", default="1,16,32")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype, e, h, i = getattr(torch, args.dtype), args.experts, args.hidden, args.width
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, generator=gen, dtype=dtype).mul_(h ** -0.5)  # no float32 copy: memory
    w2 = torch.randn(e, h, i, generator=gen, dtype=dtype).mul_(i ** -0.5)

    def make(config) -> FusedMoE:
        m = FusedMoE(e, h, i, config, "layers.0.mlp.experts")
        m.w13_weight.data, m.w2_weight.data = w13, w2  # shared: the torch path keeps them, the others pack them
        m.process_weights_after_loading()
        return m

    layers = {"torch": make(UnquantizedConfig("torch")), "native": make(UnquantizedConfig("native")),
              "native-int8": make(Int8Config())}
    for t in (int(n) for n in args.tokens.split(",")):
        x = torch.randn(t, h, generator=gen).to(dtype)
        # a fresh route per call: a layer's experts are not in cache from the call before (in a model, the other
        # layers' experts run in between)
        routes = [select_experts(torch.randn(t, e, generator=gen), args.top_k, True) for _ in range(16)]
        calls = {n: (lambda r, m=m: m(x, *r)) for n, m in layers.items()}
        calls["dispatch"] = lambda r: grouped_experts(x, *r, e, lambda _, rows: rows)
        best = {n: float("inf") for n in calls}
        for rnd in range(args.rounds):
            for j, (n, call) in enumerate(calls.items()):
                call(routes[(2 * rnd * len(calls) + 2 * j) % len(routes)])
                t0 = time.perf_counter()
                call(routes[(2 * rnd * len(calls) + 2 * j + 1) % len(routes)])
                best[n] = min(best[n], time.perf_counter() - t0)
        print(f"{args.dtype} tokens={t:3d} " + "  ".join(
            f"{n} {v * 1e3:8.2f} ms ({best['torch'] / v:5.2f}x)" for n, v in best.items()), flush=True)


if __name__ == "__main__":
    main()
