"""Pure benchmark arithmetic: per-request timings -> the numbers `vllm bench serve` reports.

Definitions (seed 000's table, vLLM's code):

* TTFT  - request sent -> first streamed chunk that carries a choice.
* ITL   - gap between two consecutive streamed chunks of one request (per chunk, so a server
          that bundles tokens shows fewer, longer gaps - the same as vLLM's client).
* TPOT  - per request (E2E - TTFT) / (output_tokens - 1); requests with one output token are
          left out of the TPOT statistics (and count as TPOT 0 for goodput, as in vLLM).
* E2EL  - request sent -> last chunk.
* goodput - completed requests per second that met *every* given SLO (ms): ``ttft:500 tpot:50``.

Percentiles use numpy's default (linear interpolation), as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutcome:
    """What the client saw for one request (vLLM's RequestFuncOutput)."""
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between chunks
    latency: float = 0.0  # E2E seconds
    start_time: float = 0.0  # perf_counter at send
    generated_text: str = ""
    error: str = ""


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    # metric -> {"mean":, "median":, "std":, "p99": ...} in ms
    stats: dict[str, dict[str, float]]
    output_lens: list[int]
    max_concurrent_requests: int = 0


def percentile(values: Sequence[float], p: float) -> float:
    return float(np.percentile(values, p)) if len(values) else 0.0


def summarize(values: Sequence[float], percentiles: Iterable[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/median/std/pNN of values (seconds) in ms; all 0 for an empty list (vLLM's `or 0`)."""
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * scale
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = float(np.percentile(arr, p))
    return out


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def tpot(latency: float, ttft: float, output_tokens: int) -> float | None:
    """(E2E - TTFT) / (n - 1); None when there is no second token."""
    if output_tokens <= 1:
        return None
    return (latency - ttft) / (output_tokens - 1)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        for pair in item.replace(",", " ").split():
            name, sep, value = pair.partition(":")
            if not sep:
                raise ValueError(f"goodput SLOs are KEY:MS pairs, got {pair!r}")
            name = name.strip().lower()
            if name not in GOODPUT_METRICS:
                raise ValueError(f"goodput metric must be one of {GOODPUT_METRICS}, got {name!r}")
            v = float(value)
            if v < 0:
                raise ValueError(f"goodput SLO must be non-negative, got {pair!r}")
            out[name] = v
    return out


def meets_slos(ttft: float, tpot_s: float | None, e2el: float, slos_ms: dict[str, float]) -> bool:
    got = {"ttft": ttft, "tpot": tpot_s or 0.0, "e2el": e2el}
    return all(got[k] <= v / 1000.0 for k, v in slos_ms.items())


def max_concurrency_of(outcomes: Iterable[RequestOutcome]) -> int:
    events = []
    for o in outcomes:
        if o.success:
            events.append((o.start_time, 1))
            events.append((o.start_time + o.latency, -1))
    events.sort()
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def calculate_metrics(outcomes: Sequence[RequestOutcome], duration: float, percentiles: Sequence[float] = (99,),
                      goodput_slos: dict[str, float] | None = None) -> BenchmarkMetrics:
    ttfts, tpots, itls, e2els, output_lens = [], [], [], [], []
    total_input = completed = good = 0
    for o in outcomes:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens
        output_lens.append(n)
        total_input += o.prompt_len
        completed += 1
        t = tpot(o.latency, o.ttft, n)
        if t is not None:
            tpots.append(t)
        itls.extend(o.itl)
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        if goodput_slos and meets_slos(o.ttft, t, o.latency, goodput_slos):
            good += 1
    total_output = sum(output_lens)
    dur = max(duration, 1e-9)
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outcomes) - completed,
        total_input=total_input,
        total_output=total_output,
        duration=duration,
        request_throughput=completed / dur,
        request_goodput=(good / dur) if goodput_slos else None,
        output_throughput=total_output / dur,
        total_token_throughput=(total_input + total_output) / dur,
        stats={
            "ttft": summarize(ttfts, percentiles),
            "tpot": summarize(tpots, percentiles),
            "itl": summarize(itls, percentiles),
            "e2el": summarize(e2els, percentiles),
        },
        output_lens=output_lens,
        max_concurrent_requests=max_concurrency_of(outcomes),
    )


def result_dict(m: BenchmarkMetrics, outcomes: Sequence[RequestOutcome]) -> dict[str, Any]:
    """The JSON `vllm bench serve --save-result` writes (same keys; stats for all four metrics,
    whatever --percentile-metrics selected for printing)."""
    r: dict[str, Any] = {
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "input_lens": [o.prompt_len for o in outcomes],
        "output_lens": list(m.output_lens),
        "ttfts": [o.ttft for o in outcomes],
        "itls": [list(o.itl) for o in outcomes],
        "latencies": [o.latency for o in outcomes],
        "start_times": [o.start_time for o in outcomes],
        "generated_texts": [o.generated_text for o in outcomes],
        "errors": [o.error for o in outcomes],
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in ("ttft", "tpot", "itl", "e2el"):
        for k, v in m.stats[name].items():
            r[f"{k}_{name}_ms"] = v
    return r


def format_result(m: BenchmarkMetrics, selected_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                  max_concurrency: int | None = None, request_rate: float = float("inf"),
                  title: str = " Serving Benchmark Result ") -> str:
    """The labelled block `vllm bench serve` prints, line for line."""
    lines = ["{s:{c}^{n}}".format(s=title, n=50, c="=")]
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format
    lines.append(row("Successful requests:", m.completed))
    lines.append(row("Failed requests:", m.failed))
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(rowf("Request rate configured (RPS):", request_rate))
    lines.append(rowf("Benchmark duration (s):", m.duration))
    lines.append(row("Total input tokens:", m.total_input))
    lines.append(row("Total generated tokens:", m.total_output))
    lines.append(rowf("Request throughput (req/s):", m.request_throughput))
    if m.request_goodput is not None:
        lines.append(rowf("Request goodput (req/s):", m.request_goodput))
    lines.append(rowf("Output token throughput (tok/s):", m.output_throughput))
    lines.append(rowf("Peak concurrent requests:", m.max_concurrent_requests))
    lines.append(rowf("Total Token throughput (tok/s):", m.total_token_throughput))
    for name in ("ttft", "tpot", "itl", "e2el"):
        if name not in selected_metrics:
            continue
        label, header = METRIC_HEADERS[name]
        s = m.stats[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(rowf(f"Mean {label} (ms):", s["mean"]))
        lines.append(rowf(f"Median {label} (ms):", s["median"]))
        for k, v in s.items():
            if k.startswith("p"):
                lines.append(rowf(f"P{k[1:]} {label} (ms):", v))
    lines.append("=" * 50)
    return "\n".join(lines)


def cdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and their empirical CDF (for plots)."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    y = np.arange(1, len(x) + 1) / max(len(x), 1)
    return x, y
