"""Engine-wide statistics, one snapshot per step (plain data: the metrics layer turns it into Prometheus)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.scheduler import SpecDecodingStats


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use (ref count > 0), 0..1
    num_kv_blocks: int = 0
    num_used_blocks: int = 0
    num_stored_tokens: int = 0  # tokens whose K/V sit in blocks held by running requests (get_stats() only)
    num_allocated_slots: int = 0  # block slots held by running requests (>= stored tokens; get_stats() only)
    # cumulative counters since start
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found cached
    prefix_cache_evictions: int = 0  # cached blocks whose hash was dropped to reuse the block
    num_preemptions: int = 0
    num_step_failures: int = 0  # engine steps whose forward raised (their requests failed, the rest went on)
    spec_decoding: SpecDecodingStats | None = None  # speculative decoding's counters, when it is on
    # KV connector (vLLM's external prefix cache): tokens looked up outside the pool, of which loaded from there
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_connector_saved_blocks: int = 0
    kv_connector_failures: int = 0  # store operations that failed (their blocks were recomputed / not saved)
    kv_connector_rejected_payloads: int = 0  # stored blocks that failed their size or integrity check (recomputed)


@dataclass
class IterationStats:
    """What one engine step did."""
    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0  # prefill tokens computed this step (prompt or recompute)
    num_generation_tokens: int = 0  # tokens sampled this step
    num_scheduled_reqs: int = 0
    forward_time: float = 0.0  # seconds in the model forward alone (input prep and sampling are overhead)
    output_time: float = 0.0  # seconds turning the sampled tokens into outputs (stop checks, detokenization)
    step_time: float = 0.0  # seconds for the whole step (schedule + forward + update + detokenize)


@dataclass
class EngineStats:
    """`LLMEngine.get_stats()`: the scheduler's state now and what the last step did."""
    scheduler: SchedulerStats
    iteration: IterationStats
