"""What a server's Prometheus /metrics said over a window (for `pagedserve diagnose --url`): counters and
histograms as their change between two scrapes, gauges as read at the end. The engine's step events say what each
step did; /metrics adds the server's own account (preemptions, prefix-cache hits, latency histograms) as a
cross-check over the same window."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

P = "pagedserve:"

Samples = dict[tuple[str, str], float]  # (sample name, `le` bound or "") -> value summed over the other labels


def parse_metrics(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(P):
                key = (s.name, s.labels.get("le", ""))
                samples[key] = samples.get(key, 0.0) + s.value
    return samples


@dataclass
class ServerMetrics:
    """Times in ms; None where the window held no such sample."""
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_running: int  # gauges at the end of the window
    requests_waiting: int
    kv_cache_usage: float
    ttft_ms_mean: float | None
    ttft_ms_p99_bound: float | None  # the histogram bucket bound that holds the 99th percentile
    itl_ms_mean: float | None
    itl_ms_p99_bound: float | None


def _histogram(before: Samples, after: Samples, name: str) -> tuple[float | None, float | None]:
    """Mean and p99 bucket bound (ms) of the observations made in the window."""
    count = after.get((P + name + "_count", ""), 0.0) - before.get((P + name + "_count", ""), 0.0)
    if count <= 0:
        return None, None
    mean = (after[(P + name + "_sum", "")] - before.get((P + name + "_sum", ""), 0.0)) / count
    buckets = sorted((float(le), v - before.get((n, le), 0.0)) for (n, le), v in after.items()
                     if n == P + name + "_bucket")
    p99 = next(le for le, cumulative in buckets if cumulative >= 0.99 * count)  # +Inf holds them all
    return mean * 1e3, p99 * 1e3


def metrics_window(before_text: str, after_text: str) -> ServerMetrics:
    before, after = parse_metrics(before_text), parse_metrics(after_text)

    def delta(name: str) -> int:
        return round(after.get((P + name, ""), 0.0) - before.get((P + name, ""), 0.0))

    ttft, itl = _histogram(before, after, "time_to_first_token_seconds"), _histogram(before, after,
                                                                                     "inter_token_latency_seconds")
    return ServerMetrics(
        preemptions=delta("num_preemptions_total"), prompt_tokens=delta("prompt_tokens_total"),
        generation_tokens=delta("generation_tokens_total"),
        prefix_cache_queries=delta("prefix_cache_queries_total"), prefix_cache_hits=delta("prefix_cache_hits_total"),
        requests_running=round(after.get((P + "num_requests_running", ""), 0.0)),
        requests_waiting=round(after.get((P + "num_requests_waiting", ""), 0.0)),
        kv_cache_usage=after.get((P + "kv_cache_usage_perc", ""), 0.0),
        ttft_ms_mean=ttft[0], ttft_ms_p99_bound=ttft[1], itl_ms_mean=itl[0], itl_ms_p99_bound=itl[1])


def metrics_evidence(m: ServerMetrics) -> list[str]:
    """The report's lines for the window."""
    hit = f"{m.prefix_cache_hits / m.prefix_cache_queries:.0%}" if m.prefix_cache_queries else "n/a"
    lines = [f"/metrics over the window: {m.preemptions} preemptions, {m.prompt_tokens} prompt and "
             f"{m.generation_tokens} generated tokens, prefix cache hit rate {hit}; at the end {m.requests_running} "
             f"running, {m.requests_waiting} waiting, KV cache usage {m.kv_cache_usage:.0%}"]
    if m.itl_ms_mean is not None:
        lines.append(f"/metrics inter-token latency mean {m.itl_ms_mean:.1f} ms, p99 <= {m.itl_ms_p99_bound:g} ms")
    if m.ttft_ms_mean is not None:
        lines.append(f"/metrics time to first token mean {m.ttft_ms_mean:.0f} ms, p99 <= {m.ttft_ms_p99_bound:g} ms")
    return lines
