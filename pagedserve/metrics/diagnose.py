"""The scheduler reader (seed 002): from the serving config and the engine's step events, which of the three basic
behaviours bounds the server now, the numbers behind the verdict, and the flags to change.

  kv_memory     paged KV memory: preemptions, admissions held back by free blocks while seats and budget are left
  token_budget  the per-step token budget / chunked prefill: long prefill chunks stall the decodes that share their
                step (ITL spikes), or a full budget keeps requests queued
  batch_size    continuous batching: every seat (--max-num-seqs) taken while requests queue and KV has room
  compute       decode steps at or past the batch where step time grows with the batch (the roofline's B_sat,
                measured here from the steps themselves): a bigger batch no longer helps
  none          nothing bounds: the server keeps up with its traffic

Pure functions over plain event dicts (pagedserve/engine/events.py), so a trace file, a live stream and a test
all go through the same code; a live server's /metrics (pagedserve/metrics/server_metrics.py) adds evidence.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedserve.metrics.server_metrics import ServerMetrics, metrics_evidence

# Thresholds of the verdicts (fractions of steps unless said otherwise).
STALL_RATIO = 2.0  # a mixed prefill+decode step this many times a slow (p90) decode-only step is an ITL spike
MIN_STALL_STEPS = 0.02  # ... and that many of the steps are such spikes
QUEUED = 0.3  # requests waited in this share of the steps
FULL = 0.9  # "full": budget used / seats taken in at least this share of a step's capacity
KV_BLOCKED = 0.2  # admissions held back by KV blocks in this share of the steps with a queue
KV_HIGH = 0.9  # KV usage at or above this is "the pool is full"
MIN_SUGGESTED_CHUNK = 64  # smaller chunks cost more in per-step overhead than they save in ITL


@dataclass
class TraceStats:
    """What the steps of a trace add up to (times in ms)."""
    num_steps: int = 0
    duration_s: float = 0.0
    step_ms_mean: float = 0.0
    decode_only_steps: int = 0
    decode_step_ms_p50: float = 0.0
    decode_step_ms_p90: float = 0.0
    mixed_steps: int = 0  # prefill chunks and decodes in one step
    mixed_step_ms_p90: float = 0.0
    stall_steps: int = 0  # mixed steps longer than STALL_RATIO x the p90 decode-only step, with a long chunk
    max_prefill_tokens_in_mixed_step: int = 0
    itl_ms_p50: float = 0.0
    itl_ms_p99: float = 0.0
    ttft_ms_p50: float = 0.0
    ttft_ms_p99: float = 0.0
    budget: int = 0
    budget_full_frac: float = 0.0
    running_mean: float = 0.0
    running_max: int = 0
    max_num_seqs: int = 0
    seats_full_frac: float = 0.0
    queued_frac: float = 0.0  # steps with requests waiting
    waiting_max: int = 0
    kv_usage_mean: float = 0.0
    kv_usage_max: float = 0.0
    kv_blocked_frac: float = 0.0  # of the queued steps: seats and budget left, nobody admitted
    preemptions: int = 0
    admissions: int = 0
    prefix_hit_tokens: int = 0
    decode_batch_p50: float = 0.0
    decode_ms_per_extra_seq: float | None = None  # slope of decode-only step time over batch size
    decode_ms_fixed: float | None = None  # intercept: the step's cost that does not grow with the batch
    b_sat: float | None = None  # batch where the batch-dependent part equals the fixed part


@dataclass
class Diagnosis:
    bottleneck: str  # kv_memory | token_budget | batch_size | compute | none | no_data
    headline: str
    evidence: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    stats: TraceStats = field(default_factory=TraceStats)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: ServerMetrics | None = None  # from a live server's /metrics; None for a trace file

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares y = a + b x; None unless x takes at least three values."""
    if len(set(xs)) < 3:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def trace_stats(events: list[dict[str, Any]], config: dict[str, Any]) -> TraceStats:
    steps = [e for e in events if e["type"] == "step" and not e.get("failed")]
    st = TraceStats(num_steps=len(steps), max_num_seqs=config["scheduler"]["max_num_seqs"],
                   budget=config["scheduler"]["max_num_batched_tokens"])
    if not steps:
        return st
    st.duration_s = steps[-1]["t"] + steps[-1]["dur"] - steps[0]["t"]
    ms = [e["dur"] * 1e3 for e in steps]
    st.step_ms_mean = statistics.fmean(ms)
    decode_only = [e for e in steps if not e["prefill"]]
    mixed = [e for e in steps if e["prefill"] and e["decode"]]
    st.decode_only_steps, st.mixed_steps = len(decode_only), len(mixed)
    st.decode_step_ms_p50 = _pct([e["dur"] * 1e3 for e in decode_only], 0.5)
    st.decode_step_ms_p90 = _pct([e["dur"] * 1e3 for e in decode_only], 0.9)
    st.mixed_step_ms_p90 = _pct([e["dur"] * 1e3 for e in mixed], 0.9)
    if decode_only:
        # a chunk no longer than the smallest one diagnose would advise cannot be what stalls a step (a slow step
        # with a few prefill tokens is noise: the host, the server's other threads)
        st.stall_steps = sum(1 for e in mixed if e["dur"] * 1e3 > STALL_RATIO * st.decode_step_ms_p90
                             and e["prefill_tokens"] > MIN_SUGGESTED_CHUNK)
    st.max_prefill_tokens_in_mixed_step = max((e["prefill_tokens"] for e in mixed), default=0)
    st.budget_full_frac = sum(1 for e in steps if e["tokens"] >= FULL * e["budget"]) / len(steps)
    running = [e["running"] for e in steps]
    st.running_mean, st.running_max = statistics.fmean(running), max(running)
    st.seats_full_frac = sum(1 for r in running if r >= st.max_num_seqs) / len(steps)
    queued = [e for e in steps if e["waiting"] > 0]
    st.queued_frac = len(queued) / len(steps)
    st.waiting_max = max(e["waiting"] for e in steps)
    usage = [e["kv"]["used"] / max(e["kv"]["total"], 1) for e in steps]  # (an encoder's pool: empty)
    st.kv_usage_mean, st.kv_usage_max = statistics.fmean(usage), max(usage)
    blocked = [e for e in queued if not e["admitted"] and e["running"] < st.max_num_seqs and e["tokens"] < e["budget"]]
    st.kv_blocked_frac = len(blocked) / len(queued) if queued else 0.0
    st.preemptions = sum(len(e["preempted"]) for e in steps)
    st.admissions = sum(len(e["admitted"]) for e in steps)
    st.prefix_hit_tokens = sum(hit for e in steps for _, hit in e["admitted"])
    _latencies(events, st)
    batches = [len(e["decode"]) for e in decode_only]
    st.decode_batch_p50 = _pct(batches, 0.5)
    by_batch: dict[int, list[float]] = {}
    for b, e in zip(batches, decode_only):
        by_batch.setdefault(b, []).append(e["dur"] * 1e3)
    # one point per batch size (its median step): robust to a few slow steps, and sizes weigh alike
    fit = _fit_line(list(by_batch), [statistics.median(v) for v in by_batch.values()])
    if fit is not None and fit[1] > 0:
        st.decode_ms_fixed, st.decode_ms_per_extra_seq = fit
        st.b_sat = max(fit[0], 0.0) / fit[1]
    return st


def _latencies(events: list[dict[str, Any]], st: TraceStats) -> None:
    """TTFT (arrival -> first token) and ITL (between tokens) of each request, from when its tokens came out."""
    arrival: dict[str, float] = {}
    tokens: dict[str, list[float]] = {}
    for e in events:
        for rid, _, _, _, _, t in e.get("requests", ()) if e["type"] == "snapshot" else ():
            arrival.setdefault(rid, t)
        if e["type"] != "step":
            continue
        for rid, _, t in e["arrived"]:
            arrival[rid] = t
        end = e["t"] + e["dur"]
        for rid, n, before, total in e["prefill"]:
            if before + n == total:
                tokens.setdefault(rid, []).append(end)
        for rid in e["decode"]:
            tokens.setdefault(rid, []).append(end)
    ttfts = [(times[0] - arrival[rid]) * 1e3 for rid, times in tokens.items() if rid in arrival]
    itls = [(b - a) * 1e3 for times in tokens.values() for a, b in zip(times, times[1:])]
    st.ttft_ms_p50, st.ttft_ms_p99 = _pct(ttfts, 0.5), _pct(ttfts, 0.99)
    st.itl_ms_p50, st.itl_ms_p99 = _pct(itls, 0.5), _pct(itls, 0.99)


def diagnose(events: list[dict[str, Any]], config: dict[str, Any] | None = None,
             metrics: ServerMetrics | None = None) -> Diagnosis:
    """The verdict on a run. `config` defaults to the one in the events' snapshot; `metrics` (a live server's
    /metrics over the same window) adds its numbers to the evidence."""
    if config is None:
        config = next((e["config"] for e in events if e["type"] == "snapshot" and "config" in e), None)
        if config is None:
            raise ValueError("no config: the events hold no snapshot (read them from the start of a trace or stream).")
    result = _verdict(trace_stats(events, config), config)
    if metrics is not None:
        result.metrics = metrics
        result.evidence += metrics_evidence(metrics)
    return result


def _verdict(st: TraceStats, config: dict[str, Any]) -> Diagnosis:
    sched, cache = config["scheduler"], config["cache"]
    if st.num_steps == 0:
        return Diagnosis("no_data", "No engine step was recorded: send traffic while diagnose listens.",
                         stats=st, config=config)
    kv_pct = f"KV usage mean {st.kv_usage_mean:.0%}, max {st.kv_usage_max:.0%} of {cache['num_blocks']} blocks"
    if st.preemptions or (st.queued_frac >= QUEUED and st.kv_blocked_frac >= KV_BLOCKED and st.kv_usage_max >= KV_HIGH):
        return Diagnosis(
            "kv_memory", "KV memory bounds the server: the block pool is full, so requests are preempted or wait "
                         "for blocks while seats and token budget are left.",
            [f"{st.preemptions} preemptions in {st.num_steps} steps ({st.admissions} admissions)",
             kv_pct,
             f"requests waited in {st.queued_frac:.0%} of the steps; in {st.kv_blocked_frac:.0%} of those nobody "
             f"was admitted although seats (running mean {st.running_mean:.1f} of {st.max_num_seqs}) and budget "
             f"were left",
             f"running batch mean {st.running_mean:.1f}, max {st.running_max}"],
            ["give the KV cache more memory: --kv-cache-memory (or --num-kv-blocks) "
             f"above {cache['num_blocks']} blocks",
             f"or admit fewer sequences at once: --max-num-seqs below {max(st.running_max, 2)} (each preemption "
             "recomputes the victim's whole context)",
             "keep --enable-prefix-caching on: shared prefixes take one set of blocks"
             + ("" if cache["enable_prefix_caching"] else " (it is off now)"),
             f"a smaller --block-size (now {cache['block_size']}) wastes less of each request's last block"],
            st, config)
    if st.decode_only_steps and st.stall_steps >= max(1, MIN_STALL_STEPS * st.num_steps):
        ratio = st.mixed_step_ms_p90 / st.decode_step_ms_p50 if st.decode_step_ms_p50 else float("inf")
        # prefill cost per token, from the stalls: the chunk that keeps a mixed step within STALL_RATIO decode steps
        ms_per_token = max(st.mixed_step_ms_p90 - st.decode_step_ms_p50, 1e-6) / st.max_prefill_tokens_in_mixed_step
        fits = (STALL_RATIO - 1) * st.decode_step_ms_p50 / ms_per_token
        suggested = max(MIN_SUGGESTED_CHUNK, int(fits) // 16 * 16)
        return Diagnosis(
            "token_budget", "The token budget bounds inter-token latency: long prefill chunks share steps with "
                            "running decodes, and those steps take several decode steps' time (ITL spikes).",
            [f"decode-only step p50 {st.decode_step_ms_p50:.1f} ms; steps mixing prefill and decodes p90 "
             f"{st.mixed_step_ms_p90:.1f} ms ({ratio:.1f}x)",
             f"{st.stall_steps} of {st.num_steps} steps are such stalls; up to "
             f"{st.max_prefill_tokens_in_mixed_step} prefill tokens shared a step with decodes "
             f"(--max-num-batched-tokens {sched['max_num_batched_tokens']}, --long-prefill-token-threshold "
             f"{sched['long_prefill_token_threshold'] or 'off'})",
             f"ITL p50 {st.itl_ms_p50:.1f} ms, p99 {st.itl_ms_p99:.1f} ms"],
            [f"lower --max-num-batched-tokens to about {suggested} so a chunk costs at most ~{STALL_RATIO:.0f} "
             f"decode steps (prefill measured at {ms_per_token:.3f} ms per token; long prompts then take more "
             "steps to their first token)",
             f"or cap each prompt's chunk: --long-prefill-token-threshold {suggested}",
             "keep chunked prefill on (--enable-chunked-prefill): without it a whole prompt shares one step"],
            st, config)
    if st.queued_frac >= QUEUED and st.seats_full_frac >= FULL * st.queued_frac and st.kv_usage_max < KV_HIGH:
        compute = st.b_sat is not None and st.decode_batch_p50 >= st.b_sat
        if compute:
            return Diagnosis(
                "compute", "Compute bounds the server: decode batches are past the point where step time grows "
                           "with the batch, so more seats would not raise throughput.",
                [f"decode-only step = {st.decode_ms_fixed:.2f} ms + {st.decode_ms_per_extra_seq:.3f} ms per "
                 f"sequence: B_sat ~ {st.b_sat:.0f}, decode batch p50 {st.decode_batch_p50:.0f}",
                 f"all {st.max_num_seqs} seats taken in {st.seats_full_frac:.0%} of the steps, requests waiting in "
                 f"{st.queued_frac:.0%}", kv_pct],
                ["this hardware is at its roofline for this model: a faster or second machine, a smaller dtype "
                 "(--dtype bfloat16, --quantization int8), or speculative decoding to get more tokens per step",
                 f"--max-num-seqs above {st.max_num_seqs} would lengthen every step without more tokens/s"],
                st, config)
        return Diagnosis(
            "batch_size", "The batch size bounds throughput: every seat is taken while requests queue, and the KV "
                          "cache has room for more.",
            [f"all {st.max_num_seqs} seats (--max-num-seqs) taken in {st.seats_full_frac:.0%} of the steps; "
             f"requests waiting in {st.queued_frac:.0%} (up to {st.waiting_max})",
             kv_pct,
             f"decode batch p50 {st.decode_batch_p50:.0f}"
             + (f", below B_sat ~ {st.b_sat:.0f} (step = {st.decode_ms_fixed:.2f} ms + "
                f"{st.decode_ms_per_extra_seq:.3f} ms per sequence)" if st.b_sat is not None else "")],
            [f"raise --max-num-seqs above {st.max_num_seqs}: the KV pool was at most {st.kv_usage_max:.0%} used, so "
             f"about {max(int(st.max_num_seqs / max(st.kv_usage_max, 1e-3)), st.max_num_seqs + 1)} sequences fit",
             "bigger decode batches cost little extra per step until B_sat"],
            st, config)
    if st.queued_frac >= QUEUED and st.budget_full_frac >= FULL * st.queued_frac:
        return Diagnosis(
            "token_budget", "The token budget bounds admission: every step spends its whole budget while requests "
                            "queue (time to first token grows in the queue).",
            [f"budget ({sched['max_num_batched_tokens']} tokens) used up in {st.budget_full_frac:.0%} of the steps; "
             f"requests waiting in {st.queued_frac:.0%} (up to {st.waiting_max})",
             f"TTFT p50 {st.ttft_ms_p50:.0f} ms, p99 {st.ttft_ms_p99:.0f} ms", kv_pct],
            [f"raise --max-num-batched-tokens above {sched['max_num_batched_tokens']} (watch ITL: steps get longer)"],
            st, config)
    return Diagnosis(
        "none", "Nothing bounds the server now: it keeps up with the traffic (queue mostly empty, no preemption).",
        [f"requests waiting in {st.queued_frac:.0%} of the steps; running batch mean {st.running_mean:.1f} of "
         f"{st.max_num_seqs} seats", kv_pct,
         f"ITL p50 {st.itl_ms_p50:.1f} ms, p99 {st.itl_ms_p99:.1f} ms; TTFT p50 {st.ttft_ms_p50:.0f} ms"],
        ["more concurrent traffic would raise throughput; nothing to change for this load"],
        st, config)


def format_report(d: Diagnosis) -> str:
    lines = [f"bottleneck: {d.bottleneck}", d.headline, "", "evidence:"]
    lines += [f"  - {e}" for e in d.evidence]
    lines += ["", "try:"] + [f"  - {a}" for a in d.advice]
    s = d.stats
    lines += ["", f"({s.num_steps} steps over {s.duration_s:.1f} s, step mean {s.step_ms_mean:.1f} ms)"]
    return "\n".join(lines)
