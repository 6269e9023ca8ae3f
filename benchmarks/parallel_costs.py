"""What tensor parallelism costs on this machine (issue 15): the collectives alone, then whole decode steps.

    python benchmarks/parallel_costs.py MODEL_DIR [--hidden 1024] [--batches 1 8] [--rounds 5]

Part 1 (two gloo ranks, no model): the all-reduce of a [tokens, hidden] float32 activation (a TP decoder layer
does two), and the driver's per-step broadcast of a decode batch (pack, header + payload broadcast, unpack on the
worker, measured as a round trip closed by a one-element all-reduce, minus that all-reduce alone).

Part 2 (the engine): decode step time of the same checkpoint with TP=1 (1 thread), TP=1 (2 threads) and TP=2
(1 thread per rank), all three engines alive in this one process and measured round-robin, `--rounds` times
`--steps` decode steps each, medians. Build a checkpoint with e.g.
`pagedserve bench make-model --shape qwen3-0.6b --override num_layers=8 vocab_size=32768 --out /tmp/q8`.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch


# ------------------------------------------------------------------------------------------- part 1: collectives
def _ranks(rank: int, port: int, args, queue) -> None:
    from pagedserve.executor.step_broadcast import ControlChannel, pack_step, unpack_step
    from pagedserve.model_executor.parallel_state import (ParallelLayout, connect_store, create_store,
                                                          init_parallel_state)

    torch.set_num_threads(1)
    layout = ParallelLayout(2, 1)
    store = create_store("127.0.0.1", 2, 60) if rank == 0 else connect_store("127.0.0.1", port, 2, 60)
    if rank == 0:
        queue.put(store.port)
    state = init_parallel_state(layout, rank, store, torch.device("cpu"), 60)
    group, channel = state.tp_group, ControlChannel(state.world_group)
    results = {}

    def timed(fn, reps: int) -> float:
        for _ in range(5):
            fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden)
        results[f"allreduce_{tokens}"] = timed(lambda x=x: group.allreduce([x]).wait(), args.reps)
    ack = torch.zeros(1)
    results["ack"] = timed(lambda: state.world_group.allreduce([ack]).wait(), args.reps)
    for batch in args.batches:
        step = _decode_step(batch, args.context, 16)
        results[f"pack_{batch}"] = timed(lambda step=step: pack_step(*step), args.reps)
        payload = pack_step(*step)
        results[f"bytes_{batch}"] = payload.numel() * 8

        def round_trip(step=step) -> None:
            if rank == 0:
                channel.send(1, pack_step(*step))
            else:
                unpack_step(channel.recv()[1], torch.device("cpu"))
            state.world_group.allreduce([ack]).wait()

        results[f"broadcast_{batch}"] = timed(round_trip, args.reps)
    if rank == 0:
        queue.put(results)
    state.shutdown()


def _decode_step(batch: int, context: int, block_size: int):
    from pagedserve.model_executor.attention import AttentionMetadata

    blocks = -(-context // block_size)
    tables = torch.arange(batch * blocks).view(batch, blocks)
    lens = torch.full((batch,), context)
    slots = tables[:, -1] * block_size + (context - 1) % block_size
    meta = AttentionMetadata(slots, batch, tables, lens, block_size, [])
    return torch.arange(batch), lens - 1, meta, torch.arange(batch)


def measure_collectives(args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    driver = ctx.Process(target=_ranks, args=(0, 0, args, queue))
    driver.start()
    port = queue.get(timeout=120)
    worker = ctx.Process(target=_ranks, args=(1, port, args, queue))
    worker.start()
    results = queue.get(timeout=600)
    driver.join()
    worker.join()
    return results


# ------------------------------------------------------------------------------------------- part 2: engine
def measure_decode_steps(args) -> dict[str, dict[int, float]]:
    from pagedserve import EngineArgs, SamplingParams
    from pagedserve.engine.llm_engine import LLMEngine

    configs = {"TP=1, 1 thread": dict(num_threads=1), "TP=1, 2 threads": dict(num_threads=2),
               "TP=2, 1 thread/rank": dict(num_threads=1, tensor_parallel_size=2)}
    engines = {name: LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype="float32", num_kv_blocks=512,
                                                           max_model_len=1024, **kw))
               for name, kw in configs.items()}
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)  # more than the steps taken
    samples = {name: {b: [] for b in args.batches} for name in engines}
    for r in range(args.rounds):
        for batch in args.batches:
            for name, engine in engines.items():
                torch.set_num_threads(configs[name]["num_threads"])
                for i in range(batch):
                    engine.add_request(f"{r}-{batch}-{i}", list(range(10, 10 + args.prompt_len)), params)
                engine.step()
                while engine.last_iteration.num_prompt_tokens:
                    engine.step()  # until every prompt is in and a pure decode step ran
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - t0)
                samples[name][batch].append(statistics.median(times))
                engine.abort_request([f"{r}-{batch}-{i}" for i in range(batch)])
    for engine in engines.values():
        engine.shutdown()
    return {name: {b: statistics.median(v) for b, v in per.items()} for name, per in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="checkpoint for part 2 (omit: collectives only)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=512, help="context length of each decode row (part 1)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; medians; noisy (shared machine)\n")
    comm = measure_collectives(args)
    print(f"gloo all-reduce of [tokens, {args.hidden}] float32 (one; a TP layer does two, plus one for the "
          f"embedding per step):")
    print("| tokens | bytes | all-reduce (us) |\n| ---: | ---: | ---: |")
    for t in args.tokens:
        print(f"| {t} | {t * args.hidden * 4} | {comm[f'allreduce_{t}'] * 1e6:.0f} |")
    print(f"\nper-step broadcast of a decode batch (context {args.context}, block 16); ack all-reduce alone "
          f"{comm['ack'] * 1e6:.0f} us subtracted:")
    print("| batch | message bytes | pack (us) | broadcast + unpack (us) |\n| ---: | ---: | ---: | ---: |")
    for b in args.batches:
        print(f"| {b} | {comm[f'bytes_{b}']} | {comm[f'pack_{b}'] * 1e6:.0f} | "
              f"{(comm[f'broadcast_{b}'] - comm['ack']) * 1e6:.0f} |")
    if args.model:
        steps = measure_decode_steps(args)
        print(f"\ndecode step time (ms), {args.model}:")
        print("| config | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
        print("| --- |" + " ---: |" * len(args.batches))
        for name, per in steps.items():
            print(f"| {name} | " + " | ".join(f"{per[b] * 1e3:.1f}" for b in args.batches) + " |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
