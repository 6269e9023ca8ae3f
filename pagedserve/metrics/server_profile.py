"""ServerProfile: where a server's time goes, step by step, as running totals (issue 50's measurement).

Always on: a few clock reads per engine step and per streamed chunk (~1 us against the ~100 us a chunk costs). The
engine thread adds each step's wall time, its forward, its output processing (detokenization included) and the
engine thread's own CPU time in it, and the wall time it spends between two steps while requests are in flight;
the event loop adds the time it spends delivering a step's outputs (one callback per step) and how long after the
step those callbacks ran (the event loop's lag), and the serving layer the time it spends turning outputs into SSE
chunks (JSON) and handing them to the HTTP server. `snapshot()` adds the CPU time of the engine thread, of the
event-loop thread and of the whole process (the rest: OpenMP workers, tokenizer threads). GET /metrics exposes the
totals (`pagedserve:server_profile_*`); a benchmark takes two scrapes' difference and divides by the steps
(benchmarks/server_overhead.py). The in-process engine driver fills the same totals, so the two compare part by part.

The engine thread's step time minus its CPU time in the step is time it could not run: OpenMP barriers, the
GIL (held by the event loop while the forward's Python parts want it), or a core taken by another thread.
"""
from __future__ import annotations

import threading
import time
from typing import Iterator

# the totals snapshot() reports, in seconds (the rest are counts)
SECONDS = ("step", "forward", "output", "step_cpu", "between_steps", "deliver", "deliver_lag", "encode", "send",
           "engine_thread_cpu", "loop_thread_cpu", "process_cpu")
COUNTS = ("steps", "deliveries", "chunks")


def _thread_cpu(ident: int | None) -> float:
    """CPU seconds of the thread `ident` (a threading.get_ident() value); 0.0 if unknown or gone."""
    if ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, AttributeError):
        return 0.0


class ServerProfile:
    """Running totals; each field has one writer thread (the engine thread or the event loop), so no lock: a reader
    may see one step's fields half added, which a difference over thousands of steps does not notice."""

    def __init__(self) -> None:
        for name in SECONDS[:-3]:
            setattr(self, name, 0.0)
        for name in COUNTS:
            setattr(self, name, 0)
        self.engine_thread: int | None = None
        self.loop_thread: int | None = None
        self._last_step_end: float | None = None  # perf_counter at the end of the previous busy step

    # ------------------------------------------------------------------ engine thread
    def record_step(self, wall: float, cpu: float, forward: float, output: float, end: float) -> None:
        """One step: wall seconds (perf_counter), the engine thread's CPU seconds in it, its forward and output
        processing seconds; `end` is perf_counter when it ended."""
        self.engine_thread = threading.get_ident()
        self.steps += 1
        self.step += wall
        self.step_cpu += cpu
        self.forward += forward
        self.output += output
        if self._last_step_end is not None:
            self.between_steps += max(0.0, end - wall - self._last_step_end)
        self._last_step_end = end

    def idle(self) -> None:
        """The engine thread is about to sleep (nothing in flight): the wait is not time between steps."""
        self._last_step_end = None

    # ------------------------------------------------------------------ event loop
    def record_delivery(self, posted: float, started: float, ended: float) -> None:
        """One hand-off of a step's outputs: posted by the engine thread, run by the event loop (perf_counter)."""
        self.loop_thread = threading.get_ident()
        self.deliveries += 1
        self.deliver_lag += max(0.0, started - posted)
        self.deliver += ended - started

    def record_chunk(self, encode: float) -> None:
        """One SSE chunk built: `encode` seconds from the output to the `data: {...}` string."""
        self.chunks += 1
        self.encode += encode

    def record_send(self, seconds: float) -> None:
        """One chunk handed to the HTTP server (its framing and the socket write)."""
        self.send += seconds

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {name: getattr(self, name) for name in (*SECONDS[:-3], *COUNTS)}
        out["engine_thread_cpu"] = _thread_cpu(self.engine_thread)
        out["loop_thread_cpu"] = _thread_cpu(self.loop_thread)
        out["process_cpu"] = time.process_time()
        return out


class ServerProfileCollector:
    """A prometheus_client collector: the profile's totals as counters, read at scrape time."""

    def __init__(self, profile: ServerProfile, model_name: str) -> None:
        self.profile = profile
        self.model_name = model_name

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        snap = self.profile.snapshot()
        seconds = CounterMetricFamily("pagedserve:server_profile_seconds", "where the server's time went (see "
                                      "pagedserve/metrics/server_profile.py)", labels=["model_name", "part"])
        for name in SECONDS:
            seconds.add_metric([self.model_name, name], snap[name])
        yield seconds
        counts = CounterMetricFamily("pagedserve:server_profile_events", "engine steps, output deliveries to the "
                                     "event loop, SSE chunks", labels=["model_name", "kind"])
        for name in COUNTS:
            counts.add_metric([self.model_name, name], snap[name])
        yield counts


def profile_from_metrics(text: str) -> dict[str, float]:
    """The totals back from a /metrics page (summed over models)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys((*SECONDS, *COUNTS), 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in ("pagedserve:server_profile_seconds", "pagedserve:server_profile_events"):
            for s in family.samples:
                key = s.labels.get("part") or s.labels.get("kind")
                if key in out:
                    out[key] += s.value
    return out
