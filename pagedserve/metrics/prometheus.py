"""Prometheus metrics, named like vLLM's (`vllm:` -> `pagedserve:`), same units (seconds) and suffixes.

Each server app owns a `CollectorRegistry` (tests build several apps in one process), so nothing is
registered in prometheus_client's global REGISTRY.  Counters are exposed with the `_total` suffix
(`pagedserve:prompt_tokens_total`), histograms with `_bucket/_sum/_count`; every series carries a
`model_name` label (and `engine="0"`), like vLLM.

| metric | type | meaning |
| --- | --- | --- |
| pagedserve:num_requests_running | gauge | requests in the running batch |
| pagedserve:num_requests_waiting | gauge | requests waiting to be scheduled (incl. preempted) |
| pagedserve:kv_cache_usage_perc | gauge | fraction of KV blocks in use, 0..1 (1 = 100%) |
| pagedserve:prefix_cache_queries_total | counter | prompt tokens looked up in the prefix cache |
| pagedserve:prefix_cache_hits_total | counter | of which were found cached |
| pagedserve:num_preemptions_total | counter | preemptions (requests evicted to free KV blocks) |
| pagedserve:engine_step_failures_total | counter | engine steps in which anything raised (schedule, KV connector, forward, output; their requests failed with a 500, the rest went on) |
| pagedserve:num_requests_rejected_queue_full_total | counter | requests refused with 429 because the waiting queue was full |
| pagedserve:prompt_tokens_total | counter | prefill tokens computed |
| pagedserve:generation_tokens_total | counter | tokens generated |
| pagedserve:request_success_total{finished_reason} | counter | finished sequences by reason (stop, length, abort) |
| pagedserve:time_to_first_token_seconds | histogram | arrival -> first token |
| pagedserve:inter_token_latency_seconds | histogram | time between consecutive token outputs of a request |
| pagedserve:request_time_per_output_token_seconds | histogram | per request: decode time / (output tokens - 1) |
| pagedserve:e2e_request_latency_seconds | histogram | arrival -> finish |
| pagedserve:request_queue_time_seconds | histogram | arrival -> first scheduled |
| pagedserve:request_inference_time_seconds | histogram | first scheduled -> finish |
| pagedserve:request_prefill_time_seconds | histogram | first scheduled -> first token |
| pagedserve:request_decode_time_seconds | histogram | first token -> last token |
| pagedserve:iteration_tokens_total | histogram | tokens (prompt + generation) per engine step |
| pagedserve:request_prompt_tokens | histogram | prompt length per request |
| pagedserve:request_generation_tokens | histogram | generated tokens per request (all n samples) |
| pagedserve:request_params_n | histogram | the n parameter per request |
| pagedserve:request_params_max_tokens | histogram | the max_tokens parameter per request |
| pagedserve:cache_config_info | gauge (info) | block_size, num_gpu_blocks, prefix caching on/off |
| pagedserve:external_prefix_cache_queries_total | counter | prompt tokens looked up in the KV connector's store (past the pool's own hit) |
| pagedserve:external_prefix_cache_hits_total | counter | of which loaded from there instead of computed |
| pagedserve:kv_connector_saved_blocks_total | counter | KV blocks saved to the KV connector's store |
| pagedserve:kv_connector_failures_total | counter | store operations that failed (recomputed / not saved instead) |
| pagedserve:kv_connector_rejected_payloads_total | counter | stored KV blocks that failed their size or integrity check (recomputed instead) |
| pagedserve:spec_decode_num_drafts_total | counter | verifications of a request's drafts (speculative decoding) |
| pagedserve:spec_decode_num_draft_tokens_total | counter | draft tokens verified |
| pagedserve:spec_decode_num_accepted_tokens_total | counter | of which accepted |
| pagedserve:spec_decode_num_accepted_tokens_per_pos_total{position} | counter | accepted drafts at each draft position (0 = first) |
| pagedserve:server_profile_seconds_total{part} | counter | where the server's time went (metrics/server_profile.py; registered by the app) |
| pagedserve:server_profile_events_total{kind} | counter | engine steps, output deliveries, SSE chunks (same) |

Every metric vLLM also has is exported a second time under vLLM's own name (`VLLM_NAMES`: `vllm:` + the same
name, plus vLLM's older names `vllm:gpu_cache_usage_perc` and `vllm:time_per_output_token_seconds`), so that vLLM's
Grafana dashboards and alerts work unchanged: the copies are the same series read at scrape time
(`VllmNames`), not a second set of counters.
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.metrics_core import Metric
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)

from pagedserve.metrics.loggers import StatLoggerBase, StepStats
from pagedserve.core.scheduler import SpecDecodingStats
from pagedserve.metrics.stats import SchedulerStats

# vLLM does the same: `_created` samples double the output and nobody reads them.
disable_created_metrics()

PREFIX = "pagedserve:"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


# pagedserve name (after the prefix) -> vLLM's names for the same measurement.  pagedserve's own additions
# (engine_step_failures, num_requests_rejected_queue_full, kv_connector_*) have no vLLM name.
_SAME = ("num_requests_running", "num_requests_waiting", "prefix_cache_queries", "prefix_cache_hits",
         "num_preemptions", "prompt_tokens", "generation_tokens", "request_success", "time_to_first_token_seconds",
         "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
         "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
         "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens", "request_params_n",
         "request_params_max_tokens", "cache_config_info", "external_prefix_cache_queries",
         "external_prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
         "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    **{name: ("vllm:" + name,) for name in _SAME},
    # vLLM V1 exports the KV usage and the inter-token latency under a current and an older (deprecated) name
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}


class VllmNames:
    """A collector yielding the given metrics' families again under their vLLM names (VLLM_NAMES): the same
    samples at the same scrape, so the two names can never disagree and nothing is counted twice."""

    def __init__(self, metrics: list) -> None:
        self.metrics = metrics

    def collect(self):
        for metric in self.metrics:
            for family in metric.collect():
                for alias in VLLM_NAMES.get(family.name.removeprefix(PREFIX), ()):
                    copy = Metric(alias, family.documentation, family.type, family.unit)
                    copy.samples = [sample._replace(name=alias + sample.name[len(family.name):])
                                    for sample in family.samples]
                    yield copy


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """[1, 2, 5, 10, 20, 50, ...] up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def build_iteration_buckets(max_num_batched_tokens: int) -> list[int]:
    buckets = [1] + [8 * 2**i for i in range(20) if 8 * 2**i < max_num_batched_tokens]
    return buckets + [max_num_batched_tokens] if max_num_batched_tokens > buckets[-1] else buckets


class PrometheusStatLogger(StatLoggerBase):
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int = 2048,
                 max_num_batched_tokens: int = 2048, engine_index: int = 0,
                 cache_config: dict[str, object] | None = None) -> None:
        self.registry = registry
        labels = ["model_name", "engine"]
        self._lv = {"model_name": model_name, "engine": str(engine_index)}
        p = PREFIX
        made: list = []  # every metric, for their vLLM-named copies

        def gauge(name: str, doc: str) -> Gauge:
            made.append(Gauge(p + name, doc, labels, registry=registry, multiprocess_mode="mostrecent"))
            return made[-1]

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            made.append(Counter(p + name, doc, labels + (extra or []), registry=registry))
            return made[-1]

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            made.append(Histogram(p + name, doc, labels, buckets=buckets, registry=registry))
            return made[-1]

        self.g_running = gauge("num_requests_running", "Number of requests in model execution batches.").labels(**self._lv)
        self.g_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.").labels(**self._lv)
        self.g_kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(**self._lv)
        self.c_prefix_queries = counter("prefix_cache_queries",
                                        "Prefix cache queries, in terms of number of queried tokens.").labels(**self._lv)
        self.c_prefix_hits = counter("prefix_cache_hits",
                                     "Prefix cache hits, in terms of number of cached tokens.").labels(**self._lv)
        self.c_preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.").labels(**self._lv)
        self.c_step_failures = counter("engine_step_failures",
                                       "Engine steps that raised; their requests failed, the rest went on.").labels(**self._lv)
        self.c_queue_full = counter("num_requests_rejected_queue_full",
                                    "Requests refused (429) because the waiting queue was full.").labels(**self._lv)
        self.c_prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(**self._lv)
        self.c_generation_tokens = counter("generation_tokens", "Number of generation tokens processed.").labels(**self._lv)
        self._c_success = counter("request_success", "Count of successfully processed requests.", ["finished_reason"])
        self.c_success = {r: self._c_success.labels(**self._lv, finished_reason=r) for r in ("stop", "length", "abort")}

        self.h_ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           TTFT_BUCKETS).labels(**self._lv)
        self.h_itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          ITL_BUCKETS).labels(**self._lv)
        self.h_tpot = hist("request_time_per_output_token_seconds",
                           "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS).labels(**self._lv)
        self.h_e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                          REQUEST_LATENCY_BUCKETS).labels(**self._lv)
        self.h_queue = hist("request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.",
                            REQUEST_LATENCY_BUCKETS).labels(**self._lv)
        self.h_inference = hist("request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.",
                                REQUEST_LATENCY_BUCKETS).labels(**self._lv)
        self.h_prefill = hist("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                              REQUEST_LATENCY_BUCKETS).labels(**self._lv)
        self.h_decode = hist("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                             REQUEST_LATENCY_BUCKETS).labels(**self._lv)
        self.h_iteration_tokens = hist("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                       build_iteration_buckets(max_num_batched_tokens)).labels(**self._lv)
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.h_prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.",
                                    token_buckets).labels(**self._lv)
        self.h_generation_tokens = hist("request_generation_tokens", "Number of generation tokens processed.",
                                        token_buckets).labels(**self._lv)
        self.h_params_n = hist("request_params_n", "Histogram of the n request parameter.",
                               [1, 2, 5, 10, 20, 50, 100]).labels(**self._lv)
        self.h_params_max_tokens = hist("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                        token_buckets).labels(**self._lv)
        if cache_config:
            info = Gauge(p + "cache_config_info", "Information of the LLMEngine CacheConfig",
                         [str(k) for k in cache_config], registry=registry, multiprocess_mode="mostrecent")
            info.labels(**{str(k): str(v) for k, v in cache_config.items()}).set(1)
            made.append(info)

        self.c_external_queries = counter("external_prefix_cache_queries",
                                          "External prefix cache queries from KV connector cross-instance cache "
                                          "sharing, in terms of number of queried tokens.").labels(**self._lv)
        self.c_external_hits = counter("external_prefix_cache_hits",
                                       "External prefix cache hits from KV connector cross-instance cache sharing, "
                                       "in terms of number of cached tokens.").labels(**self._lv)
        self.c_kv_saved = counter("kv_connector_saved_blocks", "KV blocks saved to the KV connector's store."
                                  ).labels(**self._lv)
        self.c_kv_failures = counter("kv_connector_failures", "KV store operations that failed."
                                     ).labels(**self._lv)
        self.c_kv_rejected = counter("kv_connector_rejected_payloads", "Stored KV blocks that failed their size or "
                                     "integrity check (recomputed instead).").labels(**self._lv)
        self._last_external = SchedulerStats()
        self.c_spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.").labels(**self._lv)
        self.c_spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                           "Number of draft tokens.").labels(**self._lv)
        self.c_spec_accepted = counter("spec_decode_num_accepted_tokens",
                                       "Number of accepted tokens.").labels(**self._lv)
        self._c_spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted tokens per draft position.", ["position"])
        self._last_spec = SpecDecodingStats()
        registry.register(VllmNames(made))

        # The scheduler reports cumulative counters; Prometheus counters take increments.
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0
        self._last_step_failures = 0

    def update_scheduler_stats(self, s: SchedulerStats | None) -> None:
        if s is None:
            return
        self.g_running.set(s.num_running_reqs)
        self.g_waiting.set(s.num_waiting_reqs)
        self.g_kv_usage.set(s.kv_cache_usage)
        self._last_queries = self._inc(self.c_prefix_queries, s.prefix_cache_queries, self._last_queries)
        self._last_hits = self._inc(self.c_prefix_hits, s.prefix_cache_hits, self._last_hits)
        self._last_preemptions = self._inc(self.c_preemptions, s.num_preemptions, self._last_preemptions)
        self._last_step_failures = self._inc(self.c_step_failures, s.num_step_failures, self._last_step_failures)
        last = self._last_external
        self._inc(self.c_external_queries, s.external_prefix_cache_queries, last.external_prefix_cache_queries)
        self._inc(self.c_external_hits, s.external_prefix_cache_hits, last.external_prefix_cache_hits)
        self._inc(self.c_kv_saved, s.kv_connector_saved_blocks, last.kv_connector_saved_blocks)
        self._inc(self.c_kv_failures, s.kv_connector_failures, last.kv_connector_failures)
        self._inc(self.c_kv_rejected, s.kv_connector_rejected_payloads, last.kv_connector_rejected_payloads)
        self._last_external = s
        if s.spec_decoding is not None:
            self._update_spec_decoding(s.spec_decoding)

    def _update_spec_decoding(self, spec: SpecDecodingStats) -> None:
        last = self._last_spec
        self._inc(self.c_spec_drafts, spec.num_drafts, last.num_drafts)
        self._inc(self.c_spec_draft_tokens, spec.num_draft_tokens, last.num_draft_tokens)
        self._inc(self.c_spec_accepted, spec.num_accepted_tokens, last.num_accepted_tokens)
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            before = last.num_accepted_tokens_per_pos[pos] if pos < len(last.num_accepted_tokens_per_pos) else 0
            self._inc(self._c_spec_per_pos.labels(**self._lv, position=str(pos)), count, before)
        self._last_spec = spec

    def record_rejected(self) -> None:
        """A request refused because the waiting queue was full (event-loop thread)."""
        self.c_queue_full.inc()

    @staticmethod
    def _inc(counter, cumulative: int, last: int) -> int:
        if cumulative > last:
            counter.inc(cumulative - last)
        return cumulative

    def record(self, stats: StepStats) -> None:
        self.update_scheduler_stats(stats.scheduler)
        prompt, gen = stats.prompt_tokens, stats.generation_tokens
        if prompt:
            self.c_prompt_tokens.inc(prompt)
        if gen:
            self.c_generation_tokens.inc(gen)
        if stats.iteration is not None:
            self.h_iteration_tokens.observe(stats.iteration.num_prompt_tokens + stats.iteration.num_generation_tokens)
        elif prompt or gen:
            self.h_iteration_tokens.observe(prompt + gen)
        for t in stats.ttfts:
            self.h_ttft.observe(t)
        for t in stats.itls:
            self.h_itl.observe(t)
        for f in stats.finished:
            for reason in f.finish_reasons:
                cnt = self.c_success.get(reason)
                if cnt is None:
                    cnt = self.c_success[reason] = self._c_success.labels(**self._lv, finished_reason=reason)
                cnt.inc()
            self.h_e2e.observe(f.e2e_latency)
            if f.queue_time is not None:
                self.h_queue.observe(f.queue_time)
            if f.inference_time is not None:
                self.h_inference.observe(f.inference_time)
            if f.prefill_time is not None:
                self.h_prefill.observe(f.prefill_time)
            if f.decode_time is not None:
                self.h_decode.observe(f.decode_time)
            if f.mean_time_per_output_token is not None:
                self.h_tpot.observe(f.mean_time_per_output_token)
            self.h_prompt_tokens.observe(f.num_prompt_tokens)
            self.h_generation_tokens.observe(f.num_generation_tokens)
            self.h_params_n.observe(f.n)
            if f.max_tokens is not None:
                self.h_params_max_tokens.observe(f.max_tokens)


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
