"""LLMEngine: add_request / step / abort_request. Ties the scheduler, the model runner and detokenization."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import dataclass, field

from pagedserve.config import EngineArgs
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.metrics.stats import IterationStats, SchedulerStats
from pagedserve.model_executor.model_config import ModelConfig, resolve_model_dir
from pagedserve.model_executor.model_runner import ModelRunner, configure_threads, resolve_device, resolve_dtype
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedserve")


@dataclass
class _Sample:
    """Output state of one of the n sequences of a user request."""
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0  # for DELTA outputs
    num_sent_logprobs: int = 0


@dataclass
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    progressed: set[int] = field(default_factory=set)  # sample indices with news this step


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        from transformers import AutoTokenizer

        from pagedserve.demo_model_path import default_model_path

        configure_threads(args.num_threads)
        self.args = args
        model_dir = Path(default_model_path()) if args.model is None else resolve_model_dir(args.model, args.revision)
        cfg = ModelConfig.from_dir(model_dir)
        cfg.max_model_len = args.max_model_len or cfg.max_position_embeddings
        if cfg.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({cfg.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings}).")
        cfg.served_model_name = args.served_model_name or (args.model or "pagedserve-demo")
        self.model_config = cfg
        self.is_default_model = args.model is None
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        kv_dtype = dtype if args.kv_cache_dtype == "auto" else resolve_dtype(args.kv_cache_dtype, device)
        self.runner = ModelRunner(cfg, device, dtype, args.block_size, args.seed, args.linear_backend,
                                  args.quantization, kv_dtype)
        num_blocks = self._num_kv_blocks(args)
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching,
                                               args.prefix_caching_hash_algo)
        budget = args.max_num_batched_tokens
        if not args.enable_chunked_prefill and budget < cfg.max_model_len:
            logger.warning("Without chunked prefill a whole prompt must fit one step: raising "
                           "max_num_batched_tokens from %d to max_model_len=%d.", budget, cfg.max_model_len)
            budget = cfg.max_model_len
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget, max_model_len=cfg.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold, policy=args.scheduling_policy,
        ), self.kv_cache_manager)
        self.requests: dict[str, _UserRequest] = {}
        self._children: dict[str, tuple[_UserRequest, _Sample]] = {}  # sequence id -> its user request
        self.last_iteration = IterationStats()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def _num_kv_blocks(self, args: EngineArgs) -> int:
        per_block = self.runner.kv_bytes_per_block
        useful = cdiv(args.max_num_seqs * self.model_config.max_model_len, args.block_size)
        if args.num_kv_blocks is not None:
            num_blocks = args.num_kv_blocks
        elif args.kv_cache_memory_bytes is not None:
            num_blocks = args.kv_cache_memory_bytes // per_block
        else:  # a share of free memory, but never more than max_num_seqs full-length requests can use
            num_blocks = min(int(self.runner.available_memory() * args.kv_cache_memory_fraction) // per_block, useful)
        if num_blocks < 1:
            raise ValueError(f"The KV cache budget holds no block of {per_block} bytes.")
        tokens = num_blocks * args.block_size
        logger.info("KV cache size: %d tokens (%d blocks of %d, %.2f GiB); maximum concurrency for %d tokens "
                    "per request: %.2fx", tokens, num_blocks, args.block_size, num_blocks * per_block / 2**30,
                    self.model_config.max_model_len, tokens / self.model_config.max_model_len)
        return num_blocks

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty.")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids.")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}.")
        return list(prompt)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens when a request gives none: what max_model_len leaves, capped by what the whole KV pool
        holds, so that the default never makes a request that could never run."""
        pool_tokens = self.kv_cache_manager.num_blocks * self.args.block_size
        return max(min(self.model_config.max_model_len, pool_tokens) - num_prompt_tokens, 1)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        if priority != 0 and self.args.scheduling_policy != "priority":
            raise ValueError("priority is only supported with scheduling_policy='priority'.")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty.")
        max_len = self.model_config.max_model_len
        room = max_len - len(token_ids)
        if room < 1:
            raise ValueError(f"The prompt has {len(token_ids)} tokens; max_model_len is {max_len}, which leaves no "
                             f"room to generate.")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.default_max_tokens(len(token_ids))
        if max_tokens > room:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = "
                             f"{len(token_ids) + max_tokens} exceeds max_model_len ({max_len}).")
        need = cdiv(len(token_ids) + max_tokens, self.args.block_size)
        if need > self.kv_cache_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {need} KV blocks but the whole pool has "
                             f"{self.kv_cache_manager.num_blocks}; the request could never run.")
        arrival_time = time.time() if arrival_time is None else arrival_time
        samples = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(child_id, token_ids, params, max_tokens, self.model_config.eos_token_ids,
                              arrival_time, priority, cache_salt, sample_index=i)
            samples.append(_Sample(request, IncrementalDetokenizer(self.tokenizer, token_ids, params),
                                   [] if params.logprobs is not None else None))
        user = _UserRequest(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, samples,
                            RequestMetrics(arrival_time, num_prompt_tokens=len(token_ids)))
        self.requests[request_id] = user
        for sample in samples:
            self._children[sample.request.request_id] = (user, sample)
            self.scheduler.add_request(sample.request)

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            user = self.requests.pop(rid, None)
            if user is None:
                continue
            ids = [s.request.request_id for s in user.samples]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for child_id in ids:
                self._children.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            self.last_iteration = IterationStats()
            return []
        num_decode_tokens = sum(1 for s in sched_out.scheduled
                                if s.num_new_tokens == 1 and s.request.num_computed_tokens >= s.request.num_prompt_tokens)
        runner_out = self.runner.execute_model(sched_out)
        progressed = self.scheduler.update_from_output(sched_out, runner_out.sampled)
        now = time.time()
        touched: dict[str, _UserRequest] = {}
        for request in progressed:
            user, sample = self._children[request.request_id]
            token = request.all_token_ids[-1]
            self._record_token(user, sample, token, runner_out.logprobs.get(request.request_id), now)
            touched[user.request_id] = user
        outputs = [self._make_output(user, now) for user in touched.values()]
        outputs = [o for o in outputs if o is not None]
        self.last_iteration = IterationStats(
            num_scheduled_tokens=sched_out.num_scheduled_tokens,
            num_prompt_tokens=sched_out.num_scheduled_tokens - num_decode_tokens,
            num_generation_tokens=len(runner_out.sampled),
            num_scheduled_reqs=len(sched_out.scheduled),
            forward_time=runner_out.forward_time,
            step_time=time.perf_counter() - t0,
        )
        return outputs

    def _record_token(self, user: _UserRequest, sample: _Sample, token: int, logprobs: dict[int, Logprob] | None,
                      now: float) -> None:
        request = sample.request
        m = user.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            m.first_scheduled_time = request.first_scheduled_time
            m.num_cached_tokens = max(request.num_cached_tokens, 0)
        m.last_token_time = now
        m.num_generation_tokens += 1
        if logprobs is not None and sample.logprobs is not None:
            for tid, lp in logprobs.items():
                lp.decoded_token = self.tokenizer.decode([tid])
            sample.logprobs.append(logprobs)
            sample.cumulative_logprob += logprobs[token].logprob
        # A stop token's text is not part of the output (as in vLLM), unless asked for.
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None \
            or isinstance(request.stop_reason, int)
        if stopped_by_token and not user.params.include_stop_str_in_output:
            stop = None
        else:
            stop = sample.detokenizer.update([token])
        if stop is not None and not request.is_finished:
            request.stop_reason = stop
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)
        user.progressed.add(request.sample_index)

    def _make_output(self, user: _UserRequest, now: float) -> RequestOutput | None:
        kind = user.params.output_kind
        finished = all(s.request.is_finished for s in user.samples)
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            user.progressed.clear()
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = []
        for sample in user.samples:
            if delta and sample.request.sample_index not in user.progressed:
                continue
            completions.append(self._completion(sample, delta))
        user.progressed.clear()
        if finished:
            user.metrics.finished_time = now
            del self.requests[user.request_id]
            for sample in user.samples:
                self._children.pop(sample.request.request_id, None)
        return RequestOutput(user.request_id, user.prompt, user.prompt_token_ids, completions, finished,
                             user.metrics, user.metrics.num_cached_tokens)

    @staticmethod
    def _completion(sample: _Sample, delta: bool) -> CompletionOutput:
        r = sample.request
        done = r.is_finished
        text = sample.detokenizer.get_next_output_text(done, delta)
        output_ids = r.output_token_ids
        logprobs = sample.logprobs
        if delta:
            output_ids = output_ids[sample.num_sent_tokens:]
            if logprobs is not None:
                logprobs = logprobs[sample.num_sent_logprobs:]
        sample.num_sent_tokens = r.num_output_tokens
        sample.num_sent_logprobs = len(sample.logprobs or ())
        return CompletionOutput(
            index=r.sample_index, text=text, token_ids=output_ids,
            cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
            logprobs=logprobs, finish_reason=r.status.finish_reason, stop_reason=r.stop_reason)

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> tuple[SchedulerStats, IterationStats]:
        kv = self.kv_cache_manager
        stored, allocated = kv.stored_and_allocated(self.scheduler.running)
        stats = SchedulerStats(
            num_running_reqs=self.scheduler.num_running,
            num_waiting_reqs=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_kv_blocks=kv.num_blocks,
            num_used_blocks=kv.block_pool.num_used_blocks,
            num_stored_tokens=stored,
            num_allocated_slots=allocated,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_evictions=kv.block_pool.num_evictions,
            num_preemptions=self.scheduler.num_preemptions,
        )
        return stats, self.last_iteration
