"""Where an MoE model's decode step goes: per-part wall time of pure-decode steps in one engine.

    python benchmarks/moe_step_profile.py --model /work/peers/models/qwen3-30b-a3b-2l --precisions int8,bfloat16 \
        --batches 1,16

One engine per precision (float32, bfloat16 or int8: `--quantization int8`, float32 activations, as
benchmarks/cpu_peers.py runs it; "as-stored": the checkpoint's own format, e.g. a GGUF file as --model, float32
activations); per batch size B, B requests of `--context` random prompt tokens are prefilled,
then `--steps` decode steps are timed (after `--warmup`): the whole step, and inside it (forward hooks, timed with
perf_counter: the CPU runs the ops synchronously) the attention block's projections (qkv_proj, o_proj) and the rest of attention (norms, rotary,
the paged kernel), the router (its linear and top-k), the experts (the sort by expert and, timed apart, the native
call: gather, expert GEMMs, weighted sum per token), dense MLPs if any, and the LM head. "other" is the step less the parts: embedding, norms,
sampling, the scheduler and the runner's input preparation. Means per step in ms and the share of the step.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class StepTimer:
    """Accumulates wall time per part; nested parts subtract from their parents' own time by being listed apart."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.enabled = False

    @contextmanager
    def part(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.enabled:
                self.total[name] += time.perf_counter() - t

    def hook(self, module: torch.nn.Module, name: str) -> None:
        def pre(_m, _args):
            _m._t0 = time.perf_counter()

        def post(_m, _args, _out):
            if self.enabled:
                self.total[name] += time.perf_counter() - _m._t0
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def instrument(model: torch.nn.Module, timer: StepTimer) -> None:
    from pagedserve.model_executor.layers import fused_moe
    from pagedserve.model_executor.layers.decoder import MLP, Attention
    from pagedserve.model_executor.layers.fused_moe import experts as experts_mod
    from pagedserve.model_executor.layers.fused_moe import layer as layer_mod

    for module in model.modules():
        if isinstance(module, Attention):
            timer.hook(module, "attention (all)")
            timer.hook(module.qkv_proj, "attention: qkv_proj")
            timer.hook(module.o_proj, "attention: o_proj")
        elif isinstance(module, fused_moe.SparseMoeBlock):
            timer.hook(module, "moe block (all)")
            timer.hook(module.gate, "router linear")
            timer.hook(module.experts, "experts (all)")
        elif isinstance(module, MLP):
            timer.hook(module, "dense mlp")
    timer.hook(model.lm_head, "lm head")
    select = layer_mod.select_experts

    def timed_select(*a, **k):
        with timer.part("router top-k"):
            return select(*a, **k)
    layer_mod.select_experts = timed_select
    for name in ("_native_experts", "_expert"):
        method = getattr(experts_mod.FusedMoE, name)

        def timed(self, *a, _method=method, **k):
            with timer.part("experts: GEMMs"):
                return _method(self, *a, **k)
        setattr(experts_mod.FusedMoE, name, timed)


def load(args, precision: str):
    from pagedserve import LLM

    quantization = "int8" if precision == "int8" else None
    dtype = "float32" if quantization or precision == "as-stored" else precision
    batch = max(args.batches)
    t = time.perf_counter()
    llm = LLM(args.model, dtype=dtype, quantization=quantization, num_threads=args.num_threads,
              num_kv_blocks=batch * (args.context + args.steps + args.warmup + 64) // 16 + 64, max_num_seqs=batch,
              max_model_len=args.context + args.steps + args.warmup + 64, enable_prefix_caching=False)
    print(f"{precision}: loaded in {time.perf_counter() - t:.1f} s", flush=True)
    return llm


def profile_batch(args, engine, timer: StepTimer, case: str, batch: int) -> None:
    from pagedserve.sampling_params import SamplingParams

    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=args.steps + args.warmup + 4, ignore_eos=True,
                            detokenize=False)
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", [rng.randrange(1000, 20000) for _ in range(args.context)], params)
    while not (len(engine.scheduler.running) == batch
               and all(r.num_computed_tokens >= args.context for r in engine.scheduler.running)):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    timer.total.clear()
    timer.enabled = True
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    timer.enabled = False
    while engine.has_unfinished_requests():
        engine.step()
    step = sum(steps) / len(steps) * 1e3
    parts = {k: v / len(steps) * 1e3 for k, v in timer.total.items()}
    attn_rest = (parts.get("attention (all)", 0) - parts.get("attention: qkv_proj", 0)
                 - parts.get("attention: o_proj", 0))
    experts_rest = parts.get("experts (all)", 0) - parts.get("experts: GEMMs", 0)
    rows = [("attention: qkv_proj", parts.get("attention: qkv_proj", 0)),
            ("attention: o_proj", parts.get("attention: o_proj", 0)),
            ("attention: kernel, norms, rotary", attn_rest),
            ("router linear", parts.get("router linear", 0)),
            ("router top-k", parts.get("router top-k", 0)),
            ("experts: native call (gather, GEMMs, sum)", parts.get("experts: GEMMs", 0)),
            ("experts: sort by expert", experts_rest),
            ("dense mlp", parts.get("dense mlp", 0)),
            ("lm head", parts.get("lm head", 0))]
    rows.append(("other (embed, norms, sampler, scheduler)", step - sum(v for _, v in rows)))
    print(f"\n{case}:{batch}: {args.steps} decode steps, mean step {step:.1f} ms ({batch / step * 1e3:.1f} tok/s), "
          f"median {sorted(steps)[len(steps) // 2] * 1e3:.1f} ms")
    for name, ms in rows:
        print(f"  {name:42s} {ms:8.2f} ms  {100 * ms / step:5.1f}%")
    print(flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--precisions", default="int8,bfloat16")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    for precision in args.precisions.split(","):
        llm = load(args, precision)
        timer = StepTimer()
        instrument(llm.llm_engine.runner.model, timer)
        for batch in args.batches:
            profile_batch(args, llm.llm_engine, timer, precision, batch)
        del llm


if __name__ == "__main__":
    main()
