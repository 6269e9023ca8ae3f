"""A decode step with the runner's head-major KV blocks vs token-major ones, alternated in one engine; and the
decode attention kernel alone on either layout.

    python benchmarks/kv_layout_ab.py --model /work/peers/models/qwen3-0.6b --cases float32:16:496
    python benchmarks/kv_layout_ab.py --kernel-cases float32:16:496:16:8:128:8 bfloat16:32:300:9:3:64:30

Each case is PRECISION:BATCH:CONTEXT (float32, bfloat16 or int8: float32 activations, int8 weights). Per case one
engine, holding both caches: its own (model_loader.allocate_kv_cache: [block, K/V, KV head, token, dim]) and a
token-major one ([block, K/V, token, KV head, dim]: each token's KV heads one row, the layout before). Then
`--rounds` rounds alternating which goes first: the runner is handed one cache, BATCH requests of CONTEXT random
prompt tokens are prefilled into it, and the median of `--steps` pure-decode steps is taken
(decode_loop_ab.median_decode_step). The kernels read either layout (tests/model_executor/test_kernels.py runs both), so only the
time differs. Reported: every round's median step per layout, and the ratio of the means.

A kernel case is DTYPE:BATCH:CONTEXT:HEADS:KV_HEADS:HEAD_DIM:LAYERS: `paged_decode_attention` over LAYERS caches
(random K/V in the dtype, blocks of 16 in random order, both layouts holding the same values; enough layers that
the step does not fit in the L3, as in a model), the layouts alternated for `--rounds` rounds (default 12 there).
Reported: the median pass over all layers per layout, the bandwidth it reads, the ratio, and that both outputs
are equal.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from decode_loop_ab import engine_for_case, median_decode_step


def token_major_caches(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, K and V as the halves of one [blocks, 2, token, KV head, dim] tensor, shaped like `caches`."""
    joint = [torch.zeros((k.shape[0], 2, *k.shape[1:]), dtype=k.dtype) for k, _ in caches]
    return [(kv[:, 0], kv[:, 1]) for kv in joint]


def kernel_case(case: str, rounds: int) -> None:
    from pagedserve.model_executor.kernels import cpu_kernels

    kernels, block_size = cpu_kernels(), 16
    dtype, *sizes = case.split(":")
    batch, context, heads, kv_heads, head_dim, layers = (int(x) for x in sizes)
    blocks_per_seq = -(-context // block_size)
    token_major = [torch.randn(batch * blocks_per_seq, 2, block_size, kv_heads, head_dim).to(getattr(torch, dtype))
                   for _ in range(layers)]
    head_major = [c.transpose(2, 3).contiguous() for c in token_major]
    caches = {"token-major": [(c[:, 0], c[:, 1]) for c in token_major],
              "head-major": [(c[:, 0].transpose(1, 2), c[:, 1].transpose(1, 2)) for c in head_major]}
    blocks = list(range(batch * blocks_per_seq))
    random.Random(0).shuffle(blocks)
    tables = torch.tensor(blocks).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, heads, head_dim).to(getattr(torch, dtype))
    times: dict[str, list[float]] = {name: [] for name in caches}
    for r in range(rounds):
        for name in (caches if r % 2 == 0 else reversed(caches)):
            t = time.perf_counter()
            for k, v in caches[name]:
                kernels.paged_decode_attention(q, k, v, tables, lens, head_dim ** -0.5)
            times[name].append(time.perf_counter() - t)
    outs = [kernels.paged_decode_attention(q, *caches[name][0], tables, lens, head_dim ** -0.5) for name in caches]
    nbytes = layers * batch * context * kv_heads * head_dim * 2 * token_major[0].element_size()
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"{case}: " + ", ".join(f"{name} {t:.2f} ms ({nbytes / t / 1e6:.1f} GB/s)" for name, t in ms.items())
          + f", ratio {ms['token-major'] / ms['head-major']:.3f}, outputs equal: {torch.equal(*outs)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--cases", nargs="+", default=["float32:16:496", "bfloat16:16:496"])
    p.add_argument("--kernel-cases", nargs="+", default=[])
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args()
    if args.kernel_cases:
        torch.set_num_threads(args.num_threads)
        for case in args.kernel_cases:
            kernel_case(case, args.rounds or 12)
        return
    if not args.model:
        p.error("--model is needed for engine cases")

    for case in args.cases:
        llm, batch, context = engine_for_case(case, args)
        runner = llm.llm_engine.runner
        assert runner.kv_caches[0][0].stride(1) == runner.kv_caches[0][0].shape[-1], "expected head-major blocks"
        caches = {"head-major": runner.kv_caches, "token-major": token_major_caches(runner.kv_caches)}
        times: dict[str, list[float]] = {name: [] for name in caches}
        for r in range(args.rounds or 4):
            for name in (caches if r % 2 == 0 else reversed(caches)):
                runner.kv_caches = caches[name]
                times[name].append(median_decode_step(llm.llm_engine, batch, context, args.steps, seed=r))
        runner.kv_caches = caches["head-major"]
        ratio = statistics.mean(times["token-major"]) / statistics.mean(times["head-major"])
        print(f"{case}: " + ", ".join(f"{name} {' / '.join(f'{x:.2f}' for x in t)} ms" for name, t in times.items())
              + f", ratio {ratio:.3f}", flush=True)
        del llm


if __name__ == "__main__":
    main()
