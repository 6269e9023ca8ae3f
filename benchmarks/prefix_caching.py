"""Prefix caching, measured (seed 004, section 4): TTFT with a long shared prefix, caching on vs off, and the
cost of caching on a workload that shares nothing. One process, one run, engines built side by side.

    python benchmarks/prefix_caching.py --model /tmp/smollm2 --prefix-len 2500 --suffix-len 32 --num-requests 8

Part 1: requests = shared prefix + a distinct suffix, sent one after another (each waits for the previous);
TTFT of the first request and the median of the following ones, caching on vs off.
Part 2: a no-shared-prefix workload (distinct random prompts) through LLM.generate, caching on vs off,
alternated over --repeats rounds; throughput ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from pagedserve import LLM, SamplingParams


def sequential_ttfts(llm: LLM, prompts: list[list[int]]) -> list[float]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttfts = []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"ttft-{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        ttfts.append(time.perf_counter() - t0)
    return ttfts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prefix-len", type=int, default=2500)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--throughput-prompts", type=int, default=32)
    p.add_argument("--throughput-input-len", type=int, default=512)
    p.add_argument("--throughput-output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    rng = np.random.default_rng(0)
    engines = {}
    for caching in (True, False):
        engines[caching] = LLM(args.model, enable_prefix_caching=caching, num_threads=args.num_threads,
                               max_model_len=args.prefix_len + args.suffix_len + 64,
                               num_kv_blocks=(args.prefix_len + args.suffix_len) // 16 * 4 + 256)
    vocab = engines[True].llm_engine.model_config.vocab_size
    high = min(vocab, 30000)
    result: dict = {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len}
    for caching, llm in engines.items():  # warm-up (kernels, allocator) outside the measurement
        sequential_ttfts(llm, [rng.integers(100, high, 64).tolist()])
    for caching, llm in engines.items():
        prefix = rng.integers(100, high, args.prefix_len).tolist()  # fresh prefix per engine: no earlier hits
        prompts = [prefix + rng.integers(100, high, args.suffix_len).tolist() for _ in range(args.num_requests)]
        ttfts = sequential_ttfts(llm, prompts)
        key = "on" if caching else "off"
        result[f"ttft_first_ms_{key}"] = ttfts[0] * 1e3
        result[f"ttft_rest_median_ms_{key}"] = statistics.median(ttfts[1:]) * 1e3
    result["ttft_speedup_rest"] = result["ttft_rest_median_ms_off"] / result["ttft_rest_median_ms_on"]

    params = SamplingParams(temperature=0.0, max_tokens=args.throughput_output_len, ignore_eos=True)
    rates = {True: [], False: []}
    for _ in range(args.repeats):
        for caching, llm in engines.items():
            prompts = [rng.integers(100, high, args.throughput_input_len).tolist() for _ in range(args.throughput_prompts)]
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
            rates[caching].append(tokens / (time.perf_counter() - t0))
    result["no_shared_prefix_tok_s_on"] = statistics.mean(rates[True])
    result["no_shared_prefix_tok_s_off"] = statistics.mean(rates[False])
    result["caching_throughput_cost_pct"] = 100 * (1 - result["no_shared_prefix_tok_s_on"] / result["no_shared_prefix_tok_s_off"])

    print(f"| prefix caching | TTFT first request (ms) | TTFT following, median (ms) |")
    print(f"|---|---|---|")
    for key in ("on", "off"):
        print(f"| {key} | {result[f'ttft_first_ms_{key}']:.0f} | {result[f'ttft_rest_median_ms_{key}']:.0f} |")
    print(f"\nfollowing requests: {result['ttft_speedup_rest']:.1f}x faster to first token with caching on")
    print(f"no shared prefix ({args.throughput_prompts} x {args.throughput_input_len} in / {args.throughput_output_len} out): "
          f"on {result['no_shared_prefix_tok_s_on']:.1f} tok/s, off {result['no_shared_prefix_tok_s_off']:.1f} tok/s, "
          f"cost {result['caching_throughput_cost_pct']:.2f}%")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
