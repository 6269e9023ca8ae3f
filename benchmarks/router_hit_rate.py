"""Cache-aware routing vs round-robin over two replicas, and one instance with both replicas' KV (issue 16).

    python benchmarks/router_hit_rate.py [--model DIR | --shape NAME] [--working-set 1.5] [--num-systems 16]

The case cache-aware routing exists for: a working set of shared prefixes (system prompts) larger than one
replica's KV pool but smaller than two. Each replica's pool holds 1/`--working-set` of the system prompts' blocks
(--working-set 1.5: two thirds of them; both pools together hold all of them with room to spare). Round-robin
sends every prefix to both replicas, so each replica's LRU cycles through the whole working set; cache-aware
routing keeps each prefix on one replica, so each holds about half of it.

Workload: `--num-systems` system prompts of `--system-blocks` full KV blocks (random token ids, so the block count
is exact), `--num-requests` requests drawn uniformly at random over them, each adding its own 8-token question;
`--concurrency` in flight, max_tokens=1 (wall time ~ TTFT). Setups: two `pagedserve serve` replicas behind
`pagedserve router --policy cache_aware`, the same with `round_robin` (fresh system prompts per setup: no setup
inherits another's cache), and one replica with twice the pool addressed directly (the ceiling). Hit rate = the
replicas' prefix_cache_hits / queries over the run (from /metrics); `best possible` is what a cache that never
misses a system prompt after its first visit would get.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from test_server_helpers import ServerProcess, metric_value, start_cli_process  # noqa: E402

BLOCK = 16
QUESTION_TOKENS = 8


def hits_and_queries(urls: list[str]) -> tuple[float, float]:
    texts = [httpx.get(u + "/metrics").text for u in urls]
    return (sum(metric_value(t, "pagedserve:prefix_cache_hits_total") for t in texts),
            sum(metric_value(t, "pagedserve:prefix_cache_queries_total") for t in texts))


def run(url: str, model: str, workers: list[str], systems: list[list[int]], args: argparse.Namespace) -> dict:
    rng = random.Random(1)
    prompts = [rng.choice(systems) + [rng.randrange(100, 8000) for _ in range(QUESTION_TOKENS)]
               for _ in range(args.num_requests)]
    before = hits_and_queries(workers)

    def one(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=600,
                       json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        return time.perf_counter() - t0

    with ThreadPoolExecutor(args.concurrency) as pool:
        times = list(pool.map(one, prompts))
    after = hits_and_queries(workers)
    return {"hit_rate": (after[0] - before[0]) / max(after[1] - before[1], 1), "ttft_p50": statistics.median(times),
            "ttft_p90": statistics.quantiles(times, n=10, method="inclusive")[-1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded demo model (or --shape)")
    ap.add_argument("--shape", default=None, help="a random-weight benchmark shape instead, e.g. smollm2-135m")
    ap.add_argument("--working-set", type=float, default=1.5,
                    help="the system prompts' blocks / one replica's pool (between 1 and 2: the case for routing)")
    ap.add_argument("--num-systems", type=int, default=16)
    ap.add_argument("--system-blocks", type=int, default=20)
    ap.add_argument("--num-requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    if args.shape:
        from pagedserve.benchmarks.shapes import get_shape, make_model

        model_dir = Path(tempfile.gettempdir()) / f"pagedserve-bench-{args.shape}"
        if not (model_dir / "config.json").exists():
            make_model(get_shape(args.shape), str(model_dir), dtype="bfloat16")
    else:
        from pagedserve.demo_model_path import default_model_path

        model_dir = Path(args.model or default_model_path())
    working_set = args.num_systems * args.system_blocks
    pool_blocks = int(working_set / args.working_set)
    rng = random.Random(0)

    def systems() -> list[list[int]]:
        return [[rng.randrange(100, 8000) for _ in range(args.system_blocks * BLOCK)] for _ in range(args.num_systems)]

    common = ("--num-threads", "1", "--max-model-len", "1024", "--dtype", "float32", "--block-size", str(BLOCK),
              "--max-num-seqs", str(args.concurrency))
    replica_args = common + ("--num-kv-blocks", str(pool_blocks))
    with ThreadPoolExecutor(3) as pool:
        a, b, big = pool.map(lambda extra: ServerProcess(model_dir, extra, startup_timeout=600),
                             (replica_args, replica_args, common + ("--num-kv-blocks", str(2 * pool_blocks))))
    model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    results = {}
    load = [os.getloadavg()[0]]
    try:
        for policy in ("cache_aware", "round_robin"):
            router, url = start_cli_process("router", "--worker", a.url, b.url, "--policy", policy)
            try:
                results[policy] = run(url, model, [a.url, b.url], systems(), args)
            finally:
                router.terminate()
                router.wait(10)
            load.append(os.getloadavg()[0])
        results["one instance, 2x pool"] = run(big.url, model, [big.url], systems(), args)
        load.append(os.getloadavg()[0])
    finally:
        for s in (a, b, big):
            s.stop()
    prompt_tokens = args.system_blocks * BLOCK + QUESTION_TOKENS
    best = (args.num_requests - args.num_systems) * args.system_blocks * BLOCK / (args.num_requests * prompt_tokens)
    print(f"# {model_dir.name}: {args.num_systems} system prompts x {args.system_blocks} blocks = {working_set} blocks, "
          f"{pool_blocks} blocks per replica (working set {args.working_set}x one pool), {args.num_requests} requests, "
          f"{args.concurrency} in flight; best possible hit rate {best:.1%}; "
          f"load average {min(load):.1f}-{max(load):.1f}")
    print("| routing | pool per replica | prefix-cache hit rate | TTFT p50 (ms) | TTFT p90 (ms) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        pool = 2 * pool_blocks if name.startswith("one") else pool_blocks
        print(f"| {name} | {pool} | {r['hit_rate']:.1%} | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p90'] * 1e3:.0f} |")
    ca, rr, big = (results[k]["hit_rate"] for k in results)
    print(f"cache-aware / round-robin: {ca / rr:.2f}x; cache-aware / one instance: {ca / big:.1%}")


if __name__ == "__main__":
    main()
