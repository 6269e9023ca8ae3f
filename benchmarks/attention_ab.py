"""Attention kernels A/B inside a real engine run: every attention call done twice, by the kernel before and after.

    mkdir -p /tmp/k0 && for f in paged_attention.cpp layer_ops.cpp vec.h; do
        git show 119190e:pagedserve/model_executor/kernels/$f > /tmp/k0/$f; done
    python benchmarks/attention_ab.py --model /tmp/smollm2 --dtype bfloat16 --baseline-kernels /tmp/k0

On a shared machine whole-run timings drift by more than these kernels change, so each decode call runs both the
baseline build's decode kernel (`--baseline-kernels`: the sources of an earlier commit) and the current one, and each
prefill chunk both a baseline (`--prefill-baseline`: PyTorch's SDPA, what the CPU backend used before the native prefill
kernel, or `kernels`, the baseline build's prefill kernel) and the current native prefill kernel, on the same inputs,
alternating which goes first; the engine continues with the current kernels' output. The mixed workload (`bench
--dataset mixed`, exact output lengths, greedy, all requests submitted at once, 2048-token budget, prefix caching
off) runs for `--max-steps` steps. Prints each side's summed time.
"""
from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.benchmarks.datasets import TokenSpace, sample_mixed
from pagedserve.entrypoints.llm import LLM
from pagedserve.model_executor import kernels as K
from pagedserve.sampling_params import SamplingParams


def sdpa_prefill(q, k_cache, v_cache, block_ids, first, scale):
    """The CPU backend's prefill path before the native kernel: SDPA over the gathered context."""
    n, kvh, d = q.shape[0], k_cache.shape[2], q.shape[2]
    ctx = first + n
    keys = k_cache[block_ids].reshape(-1, kvh, d)[:ctx].to(q.dtype)
    values = v_cache[block_ids].reshape(-1, kvh, d)[:ctx].to(q.dtype)
    mask = torch.arange(ctx)[None, :] <= torch.arange(first, ctx)[:, None] if first else None
    return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                          values.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                          is_causal=mask is None, scale=scale, enable_gqa=True)


class BothKernels:
    """What the CPU attention backend sees as its kernels: runs each attention call with both sides and times them."""

    def __init__(self, current, baseline, prefill_baseline: str) -> None:
        self.current, self.baseline, self.prefill_baseline = current, baseline, prefill_baseline
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls = 0

    def _both(self, first, second) -> None:
        pair = (first, second) if self.calls % 2 else (second, first)
        for name, fn in pair:
            t0 = time.perf_counter()
            fn()
            self.seconds[name] += time.perf_counter() - t0
        self.calls += 1

    def paged_decode_attention(self, q, k_cache, v_cache, tables, lens, scale, out):
        scratch = torch.empty_like(out)
        self._both(("decode before", lambda: self.baseline.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                                                  scale, scratch)),
                   ("decode after", lambda: self.current.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                                                scale, out)))
        return out

    def native_prefill(self, head_dim: int) -> bool:
        return self.current.native_prefill(head_dim)

    def paged_prefill_attention(self, q, k_cache, v_cache, block_ids, first, scale, out):
        if self.prefill_baseline == "sdpa":
            def before():
                sdpa_prefill(q, k_cache, v_cache, block_ids, first, scale)
        else:
            scratch = torch.empty_like(out)

            def before():
                self.baseline.paged_prefill_attention(q, k_cache, v_cache, block_ids, first, scale, scratch)
        self._both(("prefill before", before),
                   ("prefill native", lambda: self.current.paged_prefill_attention(q, k_cache, v_cache, block_ids,
                                                                                   first, scale, out)))

    def __getattr__(self, name):
        return getattr(self.current, name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--baseline-kernels", required=True, help="a directory with the earlier kernel sources")
    p.add_argument("--prefill-baseline", choices=("sdpa", "kernels"), default="sdpa",
                   help="what the native prefill kernel is compared with: SDPA or the baseline build's kernel")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    current = K.cpu_kernels()
    if current is None:
        raise SystemExit("the native CPU kernels did not build: nothing to compare")
    isa = current.isa()
    sources = tuple(Path(args.baseline_kernels) / n for n in K.UNITS + K.SOURCES + K.HEADERS)
    baseline = K.build_extension(K.extension_name(isa, sources), list(sources[:len(K.UNITS)]), K.build_flags(isa))
    llm = LLM(args.model, num_threads=args.threads, dtype=args.dtype, max_num_batched_tokens=2048,
              max_num_seqs=args.num_prompts, enable_prefix_caching=False)
    both = BothKernels(current, baseline, args.prefill_baseline)
    llm.llm_engine.runner.attn_backend.kernels = both
    engine = llm.llm_engine
    for i, r in enumerate(sample_mixed(TokenSpace(engine.model_config.vocab_size), args.num_prompts, seed=0)):
        engine.add_request(str(i), r.prompt, SamplingParams(max_tokens=r.expected_output_len, ignore_eos=True,
                                                            temperature=0.0))
    steps = 0
    while engine.has_unfinished_requests() and steps < args.max_steps:
        engine.step()
        steps += 1
    s = both.seconds
    print(f"{Path(args.model).name} {args.dtype}, {isa}, {args.threads} thread(s), {args.num_prompts} mixed requests, "
          f"{steps} steps: decode {s['decode before']:.2f} s -> {s['decode after']:.2f} s "
          f"({s['decode before'] / max(s['decode after'], 1e-9):.2f}x); prefill ({args.prefill_baseline}) "
          f"{s['prefill before']:.2f} s -> "
          f"{s['prefill native']:.2f} s ({s['prefill before'] / max(s['prefill native'], 1e-9):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
