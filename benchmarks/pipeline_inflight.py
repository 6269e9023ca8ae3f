"""Pipeline parallelism with batches in flight vs without, vs one rank with as many threads (issue 15).

    PYTHONPATH=. python benchmarks/pipeline_inflight.py MODEL_DIR [--num-requests 32] [--prompt-len 32] [--max-tokens 64]
                                                     [--rounds 3]

Three engines on the same checkpoint, all alive in this one process and run round-robin (A/B rounds: the machine
may be shared, so each round sees about the same load for every config), each round a decode-heavy offline
workload (`--num-requests` requests of `--prompt-len` prompt tokens and `--max-tokens` output tokens, greedy,
ignore_eos, all submitted at once):

  * PP=1, 1 thread:                  one rank, one core (the reference for the CPU cost);
  * PP=1, 2 threads:                 one rank, torch's intra-op parallelism over the two cores;
  * PP=2 synchronous, 1 thread/rank: two stages, one batch at a time (the engine's max_batches_in_flight set to 1:
                                     the stages take turns);
  * PP=2 in flight, 1 thread/rank:   the same engine with two batches in flight (the default with pp=2), run
                                     right after it.

Prints output tokens/s (wall clock) per config and round, the medians, the CPU time per output token (this process
and the worker ranks: what the config costs, whatever the machine's load), the share of it on rank 0 (how evenly the
two stages are loaded: on idle cores the in-flight pipeline runs at the pace of the busier one) and the most
batches seen in flight.
Build a checkpoint with e.g. `pagedserve bench make-model --shape smollm2-135m --out /tmp/smollm2`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def cpu_seconds(engine) -> tuple[float, float]:
    """CPU time used so far by this process (rank 0, every thread) and by the engine's worker processes."""
    ticks = 0
    for pid in getattr(engine.executor, "worker_pids", {}).values():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return time.process_time(), ticks / os.sysconf("SC_CLK_TCK")


def run_workload(engine, tag: str, args) -> tuple[float, float, float]:
    """Output tokens per second of one workload, from the first add to the last token; CPU milliseconds per output
    token (all ranks), and the share of it spent on rank 0 (the engine process: stage 0, scheduling, sampling)."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    driver0, workers0 = cpu_seconds(engine)
    t0 = time.perf_counter()
    for i in range(args.num_requests):
        prompt = [10 + (i * 31 + j) % 1000 for j in range(args.prompt_len)]  # distinct: no prefix hits
        engine.add_request(f"{tag}-{i}", prompt, params)
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert num_tokens == args.num_requests * args.max_tokens
    wall = time.perf_counter() - t0
    driver1, workers1 = cpu_seconds(engine)
    total = driver1 - driver0 + workers1 - workers0
    return num_tokens / wall, total * 1e3 / num_tokens, (driver1 - driver0) / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pp-only", action="store_true", help="only the two PP=2 arms (skip the PP=1 engines)")
    args = parser.parse_args()

    from pagedserve import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine

    configs = {"PP=2": dict(num_threads=1, pipeline_parallel_size=2)}
    if not args.pp_only:
        configs = {"PP=1, 1 thread": dict(num_threads=1), "PP=1, 2 threads": dict(num_threads=2), **configs}
    num_kv_blocks = args.num_requests * -(-(args.prompt_len + args.max_tokens) // 16) + 16
    engines = {name: LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype="float32",
                                                           max_num_seqs=args.num_requests,
                                                           num_kv_blocks=num_kv_blocks, **kw))
               for name, kw in configs.items()}
    runs = [(name, name, 1) for name in configs if name != "PP=2"] + [
        ("PP=2 synchronous, 1 thread/rank", "PP=2", 1), ("PP=2 in flight, 1 thread/rank", "PP=2", 2)]
    print(f"load average {os.getloadavg()} on {os.cpu_count()} cores at the start; {args.num_requests} requests x "
          f"({args.prompt_len} prompt + {args.max_tokens} output) tokens, greedy, float32\n")
    samples: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    rank0: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for r in range(args.rounds):
        for name, config, depth in runs:
            engine = engines[config]
            torch.set_num_threads(configs[config]["num_threads"])
            engine.max_batches_in_flight = depth
            engine.max_batches_in_flight_seen = 0
            tok_s, cpu_ms, rank0_share = run_workload(engine, f"r{r}", args)
            samples[name].append(tok_s)
            cpu[name].append(cpu_ms)
            rank0[name].append(rank0_share)
            print(f"round {r}: {name}: {tok_s:.1f} tok/s, {cpu_ms:.2f} CPU ms/token, {rank0_share:.0%} on rank 0 "
                  f"(most batches in flight: "
                  f"{engine.max_batches_in_flight_seen or 1}, load {os.getloadavg()[0]:.2f})", flush=True)
    for engine in engines.values():
        engine.shutdown()
    base = statistics.median(samples["PP=2 synchronous, 1 thread/rank"])
    print("\n| config | output tok/s per round | median tok/s | vs PP=2 synchronous | CPU ms per token | "
          "on rank 0 |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {median:.1f} | {median / base:.2f}x | "
              f"{statistics.median(cpu[name]):.2f} | {statistics.median(rank0[name]):.0%} |")
    ratios = [a / b for a, b in zip(samples["PP=2 in flight, 1 thread/rank"], samples["PP=2 synchronous, 1 thread/rank"])]
    print(f"\nPP=2 in flight / synchronous, per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")
    print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
