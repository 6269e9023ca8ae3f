"""Stat loggers: what the engine loop records after every step, and the periodic log line.

`LLMEngine.take_step_stats()` gives one `StepStats` per engine step (SchedulerStats / IterationStats plus the
per-request latencies its output processor measured); `AsyncLLM` hands it to a `StatLoggerManager`, which fans it out to
the loggers: `LoggingStatLogger` (the vLLM-style line every ~10 s while there is activity) and
`PrometheusStatLogger` (pagedserve/metrics/prometheus.py).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from pagedserve.core.scheduler import SpecDecodingStats
from pagedserve.metrics.stats import IterationStats, SchedulerStats

logger = logging.getLogger("pagedserve.metrics")


@dataclass
class FinishedRequestStats:
    """One finished engine request (n>1 samples live in one request)."""

    finish_reasons: list[str]  # one per completion (sample)
    e2e_latency: float  # seconds, arrival at the server -> last output
    num_prompt_tokens: int
    num_generation_tokens: int  # summed over the n completions
    queue_time: float | None = None  # arrival -> first scheduled (engine clock)
    prefill_time: float | None = None  # first scheduled -> first token
    decode_time: float | None = None  # first token -> last token
    inference_time: float | None = None  # first scheduled -> last token
    mean_time_per_output_token: float | None = None  # decode_time / (tokens per sample - 1)
    num_cached_tokens: int = 0
    n: int = 1
    max_tokens: int | None = None


@dataclass
class StepStats:
    scheduler: SchedulerStats | None = None
    iteration: IterationStats | None = None
    ttfts: list[float] = field(default_factory=list)  # seconds, per request whose first token came this step
    itls: list[float] = field(default_factory=list)  # seconds, per request that got more tokens this step
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # Fallbacks when the engine gives no IterationStats: counted from the outputs themselves.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.iteration.num_prompt_tokens if self.iteration is not None else self.num_prompt_tokens

    @property
    def generation_tokens(self) -> int:
        return self.iteration.num_generation_tokens if self.iteration is not None else self.num_generation_tokens


class StatLoggerBase:
    def record(self, stats: StepStats) -> None:  # called from the engine thread after each step
        raise NotImplementedError

    def update_scheduler_stats(self, scheduler: SchedulerStats | None) -> None:
        """A fresh snapshot without a step (e.g. right after the engine went idle)."""

    def record_rejected(self) -> None:
        """A request was refused because the waiting queue was full."""

    def log(self, now: float) -> None:  # periodic
        pass

    def has_pending_activity(self) -> bool:
        return False


class LoggingStatLogger(StatLoggerBase):
    """vLLM's periodic line: throughput over the interval, queue sizes, KV usage, prefix-cache hit rate."""

    def __init__(self, interval_s: float = 10.0, engine_index: int = 0) -> None:
        self.interval_s = interval_s
        self.engine_index = engine_index
        self._lock = threading.Lock()
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._scheduler: SchedulerStats | None = None
        self._last_queries = 0
        self._last_hits = 0
        self._last_hit_rate = 0.0
        self._last_line_idle = True
        self._last_spec = SpecDecodingStats()
        self.last_line: str | None = None

    def record(self, stats: StepStats) -> None:
        with self._lock:
            if self._last_line_idle and not (self._prompt_tokens or self._generation_tokens):
                # Activity after an idle period: measure throughput from now, not from the last line.
                self._last_log = time.monotonic()
            self._prompt_tokens += stats.prompt_tokens
            self._generation_tokens += stats.generation_tokens
            if stats.scheduler is not None:
                self._scheduler = stats.scheduler

    def update_scheduler_stats(self, scheduler: SchedulerStats | None) -> None:
        if scheduler is not None:
            with self._lock:
                self._scheduler = scheduler

    def has_pending_activity(self) -> bool:
        with self._lock:
            sched = self._scheduler
            busy = sched is not None and (sched.num_running_reqs or sched.num_waiting_reqs)
            return bool(self._prompt_tokens or self._generation_tokens or busy or not self._last_line_idle)

    def due_in(self, now: float) -> float:
        return max(0.0, self._last_log + self.interval_s - now)

    def log(self, now: float) -> None:
        with self._lock:
            elapsed = max(now - self._last_log, 1e-9)
            sched = self._scheduler or SchedulerStats()
            idle = not (self._prompt_tokens or self._generation_tokens or sched.num_running_reqs
                        or sched.num_waiting_reqs)
            if idle and self._last_line_idle:
                self._last_log = now  # nothing happened and we already said so
                return
            queries = sched.prefix_cache_queries - self._last_queries
            hits = sched.prefix_cache_hits - self._last_hits
            if queries > 0:
                self._last_hit_rate = hits / queries
            self._last_queries, self._last_hits = sched.prefix_cache_queries, sched.prefix_cache_hits
            line = (
                f"Engine {self.engine_index:03d}: "
                f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {sched.num_running_reqs} reqs, Waiting: {sched.num_waiting_reqs} reqs, "
                f"KV cache usage: {sched.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {self._last_hit_rate * 100:.1f}%"
            )
            if sched.spec_decoding is not None:
                line += self._spec_decoding_summary(sched.spec_decoding)
            self._prompt_tokens = self._generation_tokens = 0
            self._last_log = now
            self._last_line_idle = idle
            self.last_line = line
        logger.info(line)

    def _spec_decoding_summary(self, spec: SpecDecodingStats) -> str:
        """vLLM's SpecDecoding line over the interval: mean acceptance length (accepted + 1 per draft), the draft
        acceptance rate and the acceptance rate at each draft position."""
        last = self._last_spec
        self._last_spec = spec
        drafts = spec.num_drafts - last.num_drafts
        if drafts <= 0:
            return ", SpecDecoding: no drafts"
        drafted = spec.num_draft_tokens - last.num_draft_tokens
        accepted = spec.num_accepted_tokens - last.num_accepted_tokens
        per_pos = [n - (last.num_accepted_tokens_per_pos[i] if i < len(last.num_accepted_tokens_per_pos) else 0)
                   for i, n in enumerate(spec.num_accepted_tokens_per_pos)]
        return (f", SpecDecoding: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{n / drafts:.3f}' for n in per_pos)}")


class StatLoggerManager:
    """Fans step stats out to several loggers; tells the engine loop when the next log line is due."""

    def __init__(self, loggers: list[StatLoggerBase], log_interval_s: float | None = 10.0) -> None:
        self.loggers = list(loggers)
        self.log_interval_s = log_interval_s
        self._periodic = [lg for lg in self.loggers if isinstance(lg, LoggingStatLogger)]

    def record(self, stats: StepStats) -> None:
        for lg in self.loggers:
            try:
                lg.record(stats)
            except Exception:  # a metrics bug must never take the engine loop down
                logger.exception("stat logger %s failed", type(lg).__name__)

    def update_scheduler_stats(self, scheduler: SchedulerStats | None) -> None:
        for lg in self.loggers:
            try:
                lg.update_scheduler_stats(scheduler)
            except Exception:
                logger.exception("stat logger %s failed", type(lg).__name__)

    def record_rejected(self) -> None:
        for lg in self.loggers:
            try:
                lg.record_rejected()
            except Exception:
                logger.exception("stat logger %s failed", type(lg).__name__)

    def maybe_log(self, now: float) -> None:
        for lg in self._periodic:
            if lg.due_in(now) <= 0.0:
                try:
                    lg.log(now)
                except Exception:
                    logger.exception("stat logger %s failed", type(lg).__name__)

    def next_log_in(self, now: float) -> float | None:
        """Seconds until a periodic line is due, or None when there is nothing to report (sleep freely)."""
        waits = [lg.due_in(now) for lg in self._periodic if lg.has_pending_activity()]
        return min(waits) if waits else None
