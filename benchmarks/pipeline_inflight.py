"""Pipeline parallelism with batches in flight vs without, vs one rank with as many threads (issue 15).

    PYTHONPATH=. python benchmarks/pipeline_inflight.py MODEL_DIR [--num-requests 32] [--prompt-len 32] [--max-tokens 64]
                                                     [--rounds 3]

Four engines on the same checkpoint, all alive in this one process and run round-robin (A/B rounds: the machine
may be shared, so each round sees about the same load for every config), each round a decode-heavy offline
workload (`--num-requests` requests of `--prompt-len` prompt tokens and `--max-tokens` output tokens, greedy,
ignore_eos, all submitted at once):

  * PP=1, 1 thread:                  one rank, one core (the reference for the CPU cost);
  * PP=1, 2 threads:                 one rank, torch's intra-op parallelism over the two cores;
  * PP=2 synchronous, 1 thread/rank: two stages, one batch at a time (the engine's max_batches_in_flight forced
                                     to 1: the stages take turns);
  * PP=2 in flight, 1 thread/rank:   two stages, two batches in flight (the default with pp=2).

Prints output tokens/s (wall clock) per config and round, the medians, the CPU time per output token (this process
and the worker ranks: what the config costs, whatever the machine's load) and the most batches seen in flight.
Build a checkpoint with e.g. `pagedserve bench make-model --shape smollm2-135m --out /tmp/smollm2`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def cpu_seconds(engine) -> float:
    """CPU time used so far by this process (every thread) and the engine's worker processes."""
    ticks = 0
    for pid in getattr(engine.executor, "worker_pids", {}).values():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return time.process_time() + ticks / os.sysconf("SC_CLK_TCK")


def run_workload(engine, tag: str, args) -> tuple[float, float]:
    """Output tokens per second of one workload, from the first add to the last token, and CPU milliseconds per
    output token (all ranks)."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    cpu0 = cpu_seconds(engine)
    t0 = time.perf_counter()
    for i in range(args.num_requests):
        prompt = [10 + (i * 31 + j) % 1000 for j in range(args.prompt_len)]  # distinct: no prefix hits
        engine.add_request(f"{tag}-{i}", prompt, params)
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert num_tokens == args.num_requests * args.max_tokens
    return num_tokens / (time.perf_counter() - t0), (cpu_seconds(engine) - cpu0) * 1e3 / num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from pagedserve import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine

    configs = {"PP=1, 1 thread": dict(num_threads=1),
               "PP=1, 2 threads": dict(num_threads=2),
               "PP=2 synchronous, 1 thread/rank": dict(num_threads=1, pipeline_parallel_size=2),
               "PP=2 in flight, 1 thread/rank": dict(num_threads=1, pipeline_parallel_size=2)}
    engines = {name: LLMEngine(EngineArgs(model=args.model, dtype="float32", max_num_seqs=args.num_requests,
                                          num_kv_blocks=args.num_requests * -(-(args.prompt_len + args.max_tokens)
                                                                              // 16) + 16, **kw))
               for name, kw in configs.items()}
    engines["PP=2 synchronous, 1 thread/rank"].max_batches_in_flight = 1
    print(f"load average {os.getloadavg()} on {os.cpu_count()} cores at the start; {args.num_requests} requests x "
          f"({args.prompt_len} prompt + {args.max_tokens} output) tokens, greedy, float32\n")
    samples: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            torch.set_num_threads(configs[name]["num_threads"])
            engine.max_batches_in_flight_seen = 0
            tok_s, cpu_ms = run_workload(engine, f"r{r}", args)
            samples[name].append(tok_s)
            cpu[name].append(cpu_ms)
            print(f"round {r}: {name}: {tok_s:.1f} tok/s, {cpu_ms:.2f} CPU ms/token (most batches in flight: "
                  f"{engine.max_batches_in_flight_seen or 1}, load {os.getloadavg()[0]:.2f})", flush=True)
    for engine in engines.values():
        engine.shutdown()
    base = statistics.median(samples["PP=1, 2 threads"])
    print("\n| config | output tok/s per round | median tok/s | vs PP=1, 2 threads | CPU ms per token (median) |\n"
          "| --- | --- | ---: | ---: | ---: |")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {median:.1f} | {median / base:.2f}x | "
              f"{statistics.median(cpu[name]):.2f} |")
    print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
