"""Cache-aware routing vs round-robin over two replicas, and one instance with both replicas' KV (issue 16).

    python benchmarks/router_hit_rate.py [--model DIR] [--num-systems 8] [--num-requests 64]

Two `pagedserve serve` replicas (each a pool that holds about half of the system prompts) behind `pagedserve
router`, once with `--policy cache_aware`, once with `round_robin` (fresh system prompts per policy, so no run
inherits the other's cache), then one replica with twice the pool, addressed directly (the ceiling). Workload:
requests drawn at random over `num_systems` long system prompts, each with a short distinct question, 4 at a time,
max_tokens=1 (wall time ~ TTFT). Reports the replicas' prefix-cache hit rate over the run (from /metrics) and TTFT.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_server_helpers import ServerProcess, metric_value, start_cli_process  # noqa: E402

WORDS = "the of and to in is that for it as with was on be by at this from or an are which have not".split()


def hits_and_queries(urls: list[str]) -> tuple[float, float]:
    texts = [httpx.get(u + "/metrics").text for u in urls]
    return (sum(metric_value(t, "pagedserve:prefix_cache_hits_total") for t in texts),
            sum(metric_value(t, "pagedserve:prefix_cache_queries_total") for t in texts))


def run(url: str, model: str, workers: list[str], systems: list[str], num_requests: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [rng.choice(systems) + f" Question {i}: " + " ".join(rng.choices(WORDS, k=6)) for i in range(num_requests)]
    before = hits_and_queries(workers)

    def one(prompt: str) -> float:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        return time.perf_counter() - t0

    with ThreadPoolExecutor(4) as pool:
        times = list(pool.map(one, prompts))
    after = hits_and_queries(workers)
    return {"hit_rate": (after[0] - before[0]) / max(after[1] - before[1], 1), "ttft_p50": statistics.median(times),
            "ttft_p90": statistics.quantiles(times, n=10)[-1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded demo model")
    ap.add_argument("--num-systems", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--blocks-per-replica", type=int, default=120)
    args = ap.parse_args()
    from pagedserve.demo_model_path import default_model_path

    model_dir = args.model or str(default_model_path())
    rng = random.Random(0)

    def systems(tag: str) -> list[str]:
        return [f"[{tag} {i}] " + " ".join(rng.choices(WORDS, k=args.system_words)) for i in range(args.num_systems)]

    common = ("--num-threads", "1", "--max-model-len", "1024", "--dtype", "float32")
    replica_args = common + ("--num-kv-blocks", str(args.blocks_per_replica))
    with ThreadPoolExecutor(3) as pool:
        a, b, big = pool.map(lambda extra: ServerProcess(model_dir, extra),
                             (replica_args, replica_args, common + ("--num-kv-blocks", str(2 * args.blocks_per_replica))))
    model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    results = {}
    try:
        for policy in ("cache_aware", "round_robin"):
            router, url = start_cli_process("router", "--worker", a.url, b.url, "--policy", policy)
            try:
                results[policy] = run(url, model, [a.url, b.url], systems(policy), args.num_requests, 1)
            finally:
                router.terminate()
                router.wait(10)
        results["one instance, 2x pool"] = run(big.url, model, [big.url], systems("big"), args.num_requests, 1)
    finally:
        for s in (a, b, big):
            s.stop()
    print(f"# {args.num_systems} system prompts of {args.system_words} words, {args.num_requests} requests, 4 in "
          f"flight, {args.blocks_per_replica} blocks per replica; load average {os.getloadavg()[0]:.2f}")
    print("| routing | prefix-cache hit rate | TTFT p50 (ms) | TTFT p90 (ms) |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in results.items():
        print(f"| {name} | {r['hit_rate']:.1%} | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p90'] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
