"""Drive LLMEngine.step() ourselves and record everything: per-token times and per-step stats.

Used by `bench latency --batch-sizes`, `bench compare` and `bench chunked-itl`.  Driving the step
loop (instead of LLM.generate) lets us (a) release requests at their arrival times, (b) form static
batches, and (c) read get_stats() after every step for the timeline and KV-waste accounting.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pagedserve.benchmarks.datasets import SampleRequest
from pagedserve.benchmarks.metrics import summarize


@dataclass
class ReqTiming:
    request_id: str
    prompt_len: int
    max_tokens: int
    arrival: float  # seconds after the run started (when the request became available)
    token_times: list[float] = field(default_factory=list)  # seconds after start, one per output token
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def output_len(self) -> int:
        return len(self.token_times)


@dataclass
class StepRecord:
    t_start: float
    t_end: float
    scheduled_tokens: int
    prompt_tokens: int  # prefill (chunk) tokens computed this step
    decode_tokens: int  # scheduled tokens that were not prefill
    num_reqs: int
    budget: int
    running: int
    waiting: int
    used_blocks: int
    num_blocks: int
    stored_tokens: int  # engine accounting: slots holding K/V (shared blocks once)
    allocated_slots: int  # engine accounting: slots in blocks held by running requests
    per_request_tokens: int  # sum of num_computed_tokens over running requests (no sharing)
    exact_reservation: int  # sum of prompt + max_tokens over running requests
    forward_time: float
    step_time: float


@dataclass
class TraceResult:
    name: str
    requests: list[ReqTiming]
    steps: list[StepRecord]
    makespan: float
    max_model_len: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    notes: str = ""

    # ---- derived --------------------------------------------------------------------
    def summary(self, percentiles: Sequence[float] = (50, 99)) -> dict[str, Any]:
        done = [r for r in self.requests if r.token_times]
        out_tokens = sum(r.output_len for r in done)
        in_tokens = sum(r.prompt_len for r in done)
        ttfts = [r.ttft for r in done]
        itls = [x for r in done for x in r.itls]
        tpots = [(r.e2e - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
        e2es = [r.e2e for r in done]
        span = max(self.makespan, 1e-9)
        s: dict[str, Any] = {
            "mode": self.name,
            "completed": len(done),
            "total_input_tokens": in_tokens,
            "total_output_tokens": out_tokens,
            "duration": self.makespan,
            "request_throughput": len(done) / span,
            "output_throughput": out_tokens / span,
            "total_token_throughput": (in_tokens + out_tokens) / span,
            "num_steps": len(self.steps),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_rate": (self.prefix_cache_hits / self.prefix_cache_queries
                                      if self.prefix_cache_queries else 0.0),
            "notes": self.notes,
        }
        for name, vals in (("ttft", ttfts), ("itl", itls), ("tpot", tpots), ("e2el", e2es)):
            for k, v in summarize(vals, percentiles).items():
                s[f"{k}_{name}_ms"] = v
        s.update(self.kv_waste())
        s.update(self.engine_overhead())
        return s

    def engine_overhead(self, min_running: int = 32) -> dict[str, float]:
        """Share of step time outside the model forward (schedule, input prep, sampling, detokenize, outputs),
        over all steps and over steps with at least `min_running` running requests."""
        out = {}
        for key, steps in (("all", self.steps), (f"ge{min_running}", [s for s in self.steps if s.running >= min_running])):
            total = sum(s.step_time for s in steps)
            out[f"engine_overhead_{key}"] = 1 - sum(s.forward_time for s in steps) / total if total else float("nan")
        return out

    def kv_waste(self) -> dict[str, float]:
        """Step-averaged KV waste (slots reserved but not holding K/V, over slots reserved)."""
        steps = [st for st in self.steps if st.running > 0]
        alloc = sum(st.allocated_slots for st in steps)
        stored = sum(st.stored_tokens for st in steps)
        useful = sum(st.per_request_tokens for st in steps)
        reserve_max = sum(st.running * self.max_model_len for st in steps)
        reserve_exact = sum(st.exact_reservation for st in steps)
        blocks = [st.used_blocks / st.num_blocks for st in steps if st.num_blocks]
        return {
            "kv_waste_paged": 1 - stored / alloc if alloc else 0.0,
            "kv_waste_contiguous_max_len": 1 - useful / reserve_max if reserve_max else 0.0,
            "kv_waste_contiguous_exact": 1 - useful / reserve_exact if reserve_exact else 0.0,
            "kv_usage_mean": float(np.mean(blocks)) if blocks else 0.0,
            "kv_usage_max": float(np.max(blocks)) if blocks else 0.0,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "requests": [dict(dataclasses.asdict(r), ttft=r.ttft, e2e=r.e2e) for r in self.requests],
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }


# ---------------------------------------------------------------------------------------
# engine construction


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--model plus every EngineArgs field as a flag (vLLM's names)."""
    from pagedserve.config import EngineArgs

    p.add_argument("--model", default=None, help="checkpoint dir or hub id (see `bench make-model`)")
    EngineArgs.add_cli_args(p)


def engine_args_from(args: argparse.Namespace, **overrides):
    from pagedserve.config import EngineArgs

    ea = EngineArgs.from_cli_args(args)
    return dataclasses.replace(ea, **overrides) if overrides else ea


def build_engine(engine_args):
    from pagedserve.engine.llm_engine import LLMEngine

    logger = logging.getLogger("pagedserve")
    level = logger.level
    logger.setLevel(logging.WARNING)  # one engine per mode: keep the start-up lines out of the results
    try:
        return LLMEngine.from_engine_args(engine_args)
    finally:
        logger.setLevel(level)


def release() -> None:
    """Call after dropping the last reference to an engine (`engine = None`): frees its KV cache and weights
    before the next engine is built."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def warm_up(engine, vocab: int, prompt_len: int = 16, max_tokens: int = 4) -> None:
    """One short request so lazy initialisation does not land in the first measured step."""
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams

    rng = np.random.default_rng(12345)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("__warmup__", rng.integers(3, vocab, prompt_len).tolist(), params)
    while engine.has_unfinished_requests():
        engine.step()


def vocab_of(engine) -> int:
    return int(engine.model_config.vocab_size)


def _budget(engine) -> int:
    return engine.config.scheduler.max_num_batched_tokens


def _running_requests(engine) -> list:
    try:
        return list(engine.scheduler.running)
    except AttributeError:
        return []


# ---------------------------------------------------------------------------------------
# the loop


def run_trace(engine, samples: Sequence[SampleRequest], name: str, arrivals: Sequence[float | None] | None = None,
              static_batch: int | None = None, temperature: float = 0.0, record_steps: bool = True,
              on_step=None, max_idle_steps: int = 1000, pbar=None, pad_static: bool = False) -> TraceResult:
    """Run `samples` through `engine`.

    arrivals: seconds after start at which each request becomes available (None: all at 0). An entry of
        None holds that request back until on_step releases it.
    static_batch: None = continuous (add requests to the engine as they arrive, the engine schedules
        every step); B = static batching: take up to B available requests, run them until *all* of them
        finish, only then form the next batch (the slots of early finishers stay empty).
    pad_static: static batches compute like classic padded batching: every prompt left-padded to the
        batch's longest, every request decoding for the batch's longest output.
    on_step(engine, step_index, elapsed, timings) -> indices to release now (continuous mode): optional hook
        called before each step; timings maps request id -> ReqTiming so far.
    """
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams

    arrivals = list(arrivals) if arrivals is not None else [0.0] * len(samples)
    held = {i for i, a in enumerate(arrivals) if a is None}
    order = sorted((i for i in range(len(samples)) if i not in held), key=lambda i: arrivals[i])
    pending = deque(order)
    timings: dict[str, ReqTiming] = {}
    steps: list[StepRecord] = []
    budget = _budget(engine)
    max_len = int(engine.model_config.max_model_len)
    s0 = engine.get_stats().scheduler
    q0, h0, p0 = s0.prefix_cache_queries, s0.prefix_cache_hits, s0.num_preemptions
    in_batch: set[str] = set()
    idle_steps = 0
    t0 = time.perf_counter()

    def add(i: int, pad_to: tuple[int, int] | None = None) -> None:
        """pad_to = (prompt length, output length) of a padded static batch: the request computes that much
        (left pad tokens, decoding past its own end) but only its own tokens are timed and counted."""
        s = samples[i]
        rid = s.request_id or f"req-{i}"
        if rid in timings:
            rid = f"{rid}-{i}"
        prompt, max_tokens = list(s.prompt), s.expected_output_len
        if pad_to is not None:
            prompt = [prompt[0]] * (pad_to[0] - len(prompt)) + prompt
            max_tokens = pad_to[1]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(rid, prompt, params)
        timings[rid] = ReqTiming(rid, s.prompt_len, s.expected_output_len, arrivals[i])
        in_batch.add(rid)

    step_index = 0
    while pending or held or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        if static_batch is None:
            while pending and arrivals[pending[0]] <= now:
                add(pending.popleft())
        elif not engine.has_unfinished_requests():
            in_batch.clear()
            batch = []
            while pending and arrivals[pending[0]] <= now and len(batch) < static_batch:
                batch.append(pending.popleft())
            pad_to = None
            if pad_static and len(batch) > 1:
                pad_to = (max(samples[i].prompt_len for i in batch), max(samples[i].expected_output_len for i in batch))
            for i in batch:
                add(i, pad_to)
        if on_step is not None:
            for i in on_step(engine, step_index, now, timings) or ():
                if i in held:
                    held.discard(i)
                    arrivals[i] = now
                    add(i)
        if not engine.has_unfinished_requests():
            if pending:  # idle until the next arrival
                time.sleep(max(0.0, arrivals[pending[0]] - (time.perf_counter() - t0)))
            elif held:
                raise RuntimeError(f"{name}: requests held back but nothing left to run")
            continue
        ts = time.perf_counter()
        outputs = engine.step()
        te = time.perf_counter()
        rel = te - t0
        for o in outputs:
            t = timings.get(o.request_id)
            if t is None:
                continue
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            n = min(n, t.max_tokens - len(t.token_times))  # a padded request's extra tokens are not its output
            t.token_times.extend([rel] * n)
            if o.finished:
                t.num_cached_tokens = int(getattr(o, "num_cached_tokens", 0) or 0)
                if pbar is not None:
                    pbar.update(1)
        stats = engine.get_stats()
        sched, it = stats.scheduler, stats.iteration
        if it.num_scheduled_tokens == 0:
            idle_steps += 1
            if idle_steps > max_idle_steps:
                raise RuntimeError(f"{name}: the engine made no progress for {max_idle_steps} steps")
        else:
            idle_steps = 0
        if record_steps:
            running = _running_requests(engine)
            steps.append(StepRecord(
                t_start=ts - t0, t_end=rel, scheduled_tokens=it.num_scheduled_tokens,
                prompt_tokens=it.num_prompt_tokens,
                decode_tokens=max(0, it.num_scheduled_tokens - it.num_prompt_tokens),
                num_reqs=it.num_scheduled_reqs, budget=budget, running=sched.num_running_reqs,
                waiting=sched.num_waiting_reqs, used_blocks=sched.num_used_blocks, num_blocks=sched.num_kv_blocks,
                stored_tokens=sched.num_stored_tokens, allocated_slots=sched.num_allocated_slots,
                per_request_tokens=sum(r.num_computed_tokens for r in running) if running else sched.num_stored_tokens,
                exact_reservation=sum(r.num_prompt_tokens + r.max_tokens for r in running),
                forward_time=it.forward_time, step_time=it.step_time or (te - ts)))
        step_index += 1
    makespan = time.perf_counter() - t0
    s1 = engine.get_stats().scheduler
    ordered = [timings[k] for k in timings]
    return TraceResult(name, ordered, steps, makespan, max_len, s1.prefix_cache_queries - q0,
                       s1.prefix_cache_hits - h0, s1.num_preemptions - p0)
