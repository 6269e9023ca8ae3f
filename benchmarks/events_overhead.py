"""What the engine events cost (issue 17): the same workload with nobody listening, with a listener (what an open
dashboard or `diagnose --url` turns on: every step recorded and serialized into the ring), and with a listener
plus a --trace-file, in alternating rounds in one process; medians of the mean step time, in CPU time of the
engine thread (steadier than wall time on a loaded machine) and wall time. Besides the A/B, the recorder's own
methods are timed directly (their share of the step time is the overhead, with no noise of the rest of the step;
the block pool's observer calls are inside the pool and not in it).

    python benchmarks/events_overhead.py                   # the embedded demo model
    python benchmarks/events_overhead.py --model DIR --rounds 7 --requests 32 --prompt-len 128 --output-len 64

The listener's SSE side (the server's event loop polling the ring every 100 ms and writing the serialized lines)
runs off the engine thread and is not in these numbers; the serialization is.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve import SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine

MODES = ("off", "listening", "listening+trace")


class RecorderTimer:
    """Wraps the recorder's engine-thread methods with a clock."""

    def __init__(self, recorder) -> None:
        self.seconds = 0.0
        for name in ("begin_step", "on_arrival", "on_scheduled", "end_step"):
            setattr(recorder, name, self._timed(getattr(recorder, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def run_round(engine: LLMEngine, mode: str, requests: int, prompt_len: int, output_len: int, trace: Path,
              timer: RecorderTimer) -> tuple[float, float, float]:
    """Mean step CPU time, mean step wall time and the recorder's mean time per step (ms) over one workload."""
    events = engine.events
    if mode != "off":
        events.subscribe()
    if mode == "listening+trace":
        events.open_trace(trace)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"{mode}-{time.perf_counter_ns()}-{i}", [3 + (i * 7 + j) % 500 for j in range(prompt_len)],
                           params)
    timer.seconds = 0.0
    steps, t0, c0 = 0, time.perf_counter(), time.thread_time()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    cpu, elapsed = time.thread_time() - c0, time.perf_counter() - t0
    recorder = timer.seconds
    if mode != "off":
        events.unsubscribe()
    events.close()
    engine.step()  # the recorder notices nobody listens (detaches the pool observer) before the next round
    return 1e3 * cpu / steps, 1e3 * elapsed / steps, 1e3 * recorder / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded demo model)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args()
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, num_threads=args.num_threads, num_kv_blocks=1024,
                                                   max_num_seqs=args.requests, enable_prefix_caching=False))
    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    timer = RecorderTimer(engine.events)
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:  # rotate the order every round
            results[mode].append(run_round(engine, mode, args.requests, args.prompt_len, args.output_len, trace,
                                           timer))
    med = {m: [statistics.median(x[i] for x in results[m]) for i in range(3)] for m in MODES}
    print(f"{args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, "
          f"{args.rounds} rounds; trace size {trace.stat().st_size / 1e6:.2f} MB per round")
    print("| mode | step CPU ms | vs off | step wall ms | vs off | recorder ms per step | recorder share of step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        cpu, wall, rec = med[mode]
        print(f"| {mode} | {cpu:.3f} | {100 * (cpu / med['off'][0] - 1):+.1f}% | {wall:.3f} | "
              f"{100 * (wall / med['off'][1] - 1):+.1f}% | {rec:.4f} | {100 * rec / wall:.2f}% |")


if __name__ == "__main__":
    main()
