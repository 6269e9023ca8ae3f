"""LLMEngine: add_request / step / abort_request. Ties the input processor, the scheduler, the model runner and
the output processor; one frozen EngineConfig describes what it resolved at start-up."""
from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial

from pagedserve.config import EngineArgs, EngineConfig, KVCacheConfig
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.engine.events import EngineEventRecorder
from pagedserve.engine.fault_injection import FaultInjector
from pagedserve.engine.input_processor import InputProcessor, ProcessedRequest
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.startup import StartupStages
from pagedserve.engine.structured_output import StructuredOutputManager
from pagedserve.errors import InvalidRequestError
from pagedserve.executor import create_executor
from pagedserve.kv_transfer.block_io import read_kv_blocks
from pagedserve.kv_transfer.connector import KVConnector
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics.loggers import StepStats
from pagedserve.metrics.stats import EngineStats, IterationStats, SchedulerStats
from pagedserve.model_executor.model_loader import kv_bytes_per_block
from pagedserve.model_executor.model_runner import ModelRunnerOutput, StartedStep
from pagedserve.model_executor.platform import configure_threads, leaves_a_core_free
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams

# what a pooling request carries as its sampling params: the scheduler reads them (no prompt logprobs), nothing samples
_POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, detokenize=False)

logger = logging.getLogger("pagedserve")


class LLMEngine:
    def __init__(self, config: EngineConfig, *, warm_up: bool = True, startup: StartupStages | None = None) -> None:
        """`config`: EngineArgs.create_engine_config(). Loads the model, sizes and allocates the KV cache
        (`kv_cache_config`), builds the scheduler and the processors, and warms up. `startup` gets each stage's
        duration (the server logs them with its own)."""
        from transformers import AutoTokenizer

        t_start = time.perf_counter()
        self.startup = startup if startup is not None else StartupStages()
        configure_threads(config.parallel.num_threads)
        self.config = config
        self.model_config = config.model
        with self.startup.stage("tokenizer"):
            self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer)
        with self.startup.stage("model load"):
            self.executor = create_executor(config)
        self.runner = self.executor.driver  # rank 0's runner, in this process
        with self.startup.stage("KV cache allocation"):
            self.kv_cache_config = self._size_kv_cache()
            self.executor.allocate_kv_cache(self.kv_cache_config.num_blocks)
        self.kv_cache_manager = KVCacheManager(self.kv_cache_config.num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching,
                                               config.cache.prefix_caching_hash_algo,
                                               [g.sliding_window for g in self.runner.model.kv_cache_groups])
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.structured_output = StructuredOutputManager(self.tokenizer, config.model.vocab_size,
                                                         overlap_masks=leaves_a_core_free(self.runner.device))
        self.input_processor = InputProcessor(config, self.kv_cache_config, self.tokenizer, self.structured_output)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.fault_injector = FaultInjector.from_env(self.runner.model)
        self.num_step_failures = 0
        self.last_iteration = IterationStats()
        self.events = EngineEventRecorder(config, self.kv_cache_config, self.scheduler, self.kv_cache_manager)
        # pipeline parallelism: batches started and not finished yet, oldest first (see _pipelined_step)
        self.max_batches_in_flight = self.executor.max_batches_in_flight
        self._in_flight: deque[tuple[SchedulerOutput, StartedStep]] = deque()
        self.max_batches_in_flight_seen = 0  # most batches ever in flight at once (a statistic)
        if warm_up:
            self.warm_up()
        self.kv_connector = None
        if config.kv_transfer is not None:
            with self.startup.stage("KV connector"):
                self.kv_connector = self._connect_kv_store()
        if config.trace_file is not None:  # after the warm-up: the trace holds real traffic only
            self.events.open_trace(config.trace_file)
        logger.info("Engine ready in %.1f s", time.perf_counter() - t_start)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, warm_up: bool = True) -> "LLMEngine":
        startup = StartupStages()
        with startup.stage("config"):
            config = args.create_engine_config()
        return cls(config, warm_up=warm_up, startup=startup)

    def shutdown(self) -> None:
        """Stop the executor's workers (a no-op for one process)."""
        self.executor.shutdown()

    @property
    def dead_reason(self) -> str | None:
        """Why no step can run any more (a worker rank died); None while the engine can serve."""
        return self.executor.dead_reason

    def _size_kv_cache(self) -> KVCacheConfig:
        """How many blocks: as asked, or as many as the byte budget holds, or a share of the memory left after
        loading the model (never more than max_num_seqs full-length requests can use). A hybrid model's block holds
        one KV cache group's layers (core/kv_cache_groups.py): num_kv_blocks counts blocks of every layer, each
        worth one block per group."""
        cache, max_len = self.config.cache, self.config.model.max_model_len
        num_groups = len(self.runner.model.kv_cache_groups)
        if not num_groups:  # an encoder: its K/V live only through the step's forward, no block is ever allocated
            logger.info("No KV cache: the model keeps no K/V between steps (an encoder).")
            return KVCacheConfig(0, cache.block_size, 0, 0)
        per_block = self.executor.kv_bytes_per_block
        if cache.num_kv_blocks is not None:
            num_blocks = cache.num_kv_blocks * num_groups
        elif cache.kv_cache_memory_bytes is not None:
            num_blocks = cache.kv_cache_memory_bytes // per_block
        else:
            useful = cdiv(self.config.scheduler.max_num_seqs * max_len, cache.block_size) * num_groups
            budget = int(self.executor.available_memory() * cache.kv_cache_memory_fraction)
            num_blocks = min(budget // per_block, useful)
        if num_blocks < 1:
            raise ValueError(f"The KV cache budget holds no block of {per_block} bytes.")
        kv = KVCacheConfig(num_blocks, cache.block_size, per_block, num_groups)
        logger.info("KV cache size: %d tokens (%d blocks of %d, %.2f GiB); maximum concurrency for %d tokens "
                    "per request: %.2fx", kv.num_tokens, num_blocks, cache.block_size, num_blocks * per_block / 2**30,
                    max_len, kv.num_tokens / max_len)
        return kv

    def _connect_kv_store(self) -> KVConnector:
        """After warm-up, so that no warm-up block reaches the store."""
        c, cache, kv_transfer = self.model_config, self.config.cache, self.config.kv_transfer
        if self.kv_cache_manager.num_groups == 0:
            raise ValueError("kv_transfer_config: this model keeps no KV cache (an encoder); nothing to transfer.")
        if self.kv_cache_manager.num_groups > 1:  # the connector moves one block table's blocks
            raise ValueError("kv_transfer_config: the KV connector does not support a model with sliding-window and "
                             "full-attention layers (several KV cache groups).")
        # what besides the weights makes a block's values and layout
        compute = [f"kv:{cache.kv_cache_dtype}", f"dtype:{c.dtype}", f"quantization:{self.config.load.quantization}",
                   f"block:{cache.block_size}", f"layout:{c.num_layers},{c.num_kv_heads},{c.head_dim}"]
        connector = KVConnector.create(kv_transfer, c.model_dir,
                                       kv_bytes_per_block(self.runner.model, cache.block_size, self.runner.kv_dtype),
                                       compute)
        self.scheduler.external_kv = connector
        self.kv_cache_manager.set_save_policy(kv_transfer.save_policy)
        logger.info("KV connector %s (%s, saves on %s), key namespace %s", kv_transfer.kv_connector,
                    kv_transfer.kv_role, kv_transfer.save_policy, connector.namespace)
        return connector

    def _save_kv(self, blocks: list) -> None:
        if blocks and self.kv_connector is not None:
            self.kv_connector.save(blocks, partial(read_kv_blocks, self.runner.kv_caches))

    # ------------------------------------------------------------------ start-up
    def warm_up(self) -> None:
        """Everything slow before the first request: the native kernels are built or loaded, and requests go
        once through every path a real one can take (prefill, a prefill chunk over cached context, decode,
        greedy and random sampling with penalties and logprobs). Then every trace of them is dropped."""
        t0 = time.perf_counter()
        if self.runner.device.type == "cpu":
            from pagedserve.model_executor.kernels import cpu_kernels

            with self.startup.stage("native kernels"):
                cpu_kernels()
        t_requests = time.perf_counter()
        cfg = self.config
        room = min(cfg.model.max_model_len, self.kv_cache_config.num_tokens)
        num_prompt = max(1, min(2 * cfg.cache.block_size + 3, room - 2))
        prompt = [1 + i % (cfg.model.vocab_size - 1) for i in range(num_prompt)]
        max_tokens = max(1, min(2, room - num_prompt))
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
        sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.01, seed=0, presence_penalty=0.1,
                                 repetition_penalty=1.1, max_tokens=max_tokens, ignore_eos=True)
        if cfg.pooler is not None:  # a pooling engine runs pooling requests only
            greedy = sampled = PoolingParams()
        # the second batch hits the first's prefix; the third fills one step as large as the token budget
        batches = ([("__warmup_0", prompt, greedy)], [("__warmup_1", prompt, sampled)], self._full_budget_batch(room))
        for batch in batches:
            for request_id, tokens, params in batch:
                self.add_request(request_id, tokens, params)
            while self.has_unfinished_requests():
                self.step()
        kv = self.kv_cache_manager
        kv.block_pool.reset_prefix_cache()
        kv.prefix_cache_queries = kv.prefix_cache_hits = kv.block_pool.num_evictions = 0
        self.scheduler.num_preemptions = 0
        self.max_batches_in_flight_seen = 0
        self.output_processor.take_stats()
        self.last_iteration = IterationStats()
        self.startup.add("warm-up", time.perf_counter() - t_requests)
        logger.info("Warm-up (kernels, prefill, cached-prefix prefill, decode, sampler, a full-budget step) "
                    "took %.2f s", time.perf_counter() - t0)

    def _full_budget_batch(self, room: int) -> list[tuple[str, list[int], SamplingParams | PoolingParams]]:
        """Prompts that fill one step as large as the token budget (as vLLM's profile run): its activations are the
        largest any step allocates, so the host heap grows to them in warm-up (kept for reuse: host_allocator.py)
        and the GEMM libraries set up their large-M kernels, instead of in the first real step. Without it the first
        2048-token prefill of SmolLM2 in float32 took 1.4-1.5 s against 1.05 s for the next. Each fits `room`; small
        ids, as above (test hooks key on others), each prompt its own start: no prefix shared with any."""
        cfg = self.config
        remaining = min(cfg.scheduler.max_num_batched_tokens, self.kv_cache_config.num_tokens - cfg.cache.block_size)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True) if cfg.pooler is None else PoolingParams()
        batch = []
        while remaining > 0 and room > 1:
            length = min(remaining, room - 1)
            remaining -= length
            i = len(batch)
            batch.append((f"__warmup_full_{i}",
                          [1 + (i + 1 + t) % min(32, cfg.model.vocab_size - 1) for t in range(length)], params))
        return batch

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return self.input_processor.default_max_tokens(num_prompt_tokens)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate (InvalidRequestError, a ValueError, names the parameter) and queue a request."""
        self.add_processed_request(self.input_processor.process(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority, cache_salt=cache_salt,
            lora_request=lora_request))

    # ------------------------------------------------------------------ LoRA adapters (vLLM's names)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read the adapter's weights into the host cache (ValueError if they do not fit the model)."""
        self.input_processor.check_lora(lora_request)
        self.runner.lora_manager.add_adapter(lora_request)
        return True

    def _check_lora_id(self, lora: LoRARequest) -> None:
        """An id names one adapter while requests of it are in the engine (the scheduler gives slots by id)."""
        for request in self.scheduler.requests.values():
            other = request.lora_request
            if other is not None and other.lora_int_id == lora.lora_int_id and other != lora:
                raise InvalidRequestError(f"lora_int_id {lora.lora_int_id} is in use by another adapter "
                                          f"({other.lora_name!r} at {other.lora_path!r}); give each adapter its own "
                                          f"id.", param="lora_request")

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter no request uses any more (its slot and host copy are dropped); ValueError while
        requests of it are queued or running."""
        if self.scheduler.lora_slots is None:
            return False
        users = [r for r in self.scheduler.requests.values()
                 if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {len(users)} request(s).")
        self.scheduler.lora_slots.remove(lora_int_id)
        self.runner.lora_manager.remove_adapter(lora_int_id)
        return True

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        """Queue a request the input processor already validated (the async engine validates off-thread)."""
        if processed.request_id in self.output_processor.requests:
            raise ValueError(f"request id {processed.request_id!r} is already in use.")
        params = processed.params
        if processed.lora_request is not None:  # its weights, read now: a bad file fails this request alone
            self._check_lora_id(processed.lora_request)
            try:
                self.runner.lora_manager.add_adapter(processed.lora_request)
            except (OSError, ValueError) as exc:
                raise InvalidRequestError(f"LoRA adapter {processed.lora_request.lora_name!r}: {exc}",
                                          param="lora_request") from exc
        if isinstance(params, PoolingParams):
            sequences = [Request(processed.request_id, processed.prompt_token_ids, _POOLING_SAMPLING_PARAMS, 0,
                                 frozenset(), processed.arrival_time, processed.priority, processed.cache_salt,
                                 pooling_params=params)]
        else:
            sequences = [Request(processed.request_id if params.n == 1 else f"{processed.request_id}#{i}",
                                 processed.prompt_token_ids, params, processed.max_tokens,
                                 self.model_config.eos_token_ids, processed.arrival_time, processed.priority,
                                 processed.cache_salt, sample_index=i, lora_request=processed.lora_request)
                         for i in range(params.n)]
        self.output_processor.add_request(processed, sequences)
        for seq in sequences:
            if processed.grammar is not None:
                self.structured_output.add(seq.request_id, processed.grammar,
                                           params.structured_outputs.start_after_token_ids)
            self.scheduler.add_request(seq)
            if self.events.active:
                self.events.on_arrival(seq)

    def abort_request(self, request_id: str | list[str]) -> None:
        now = time.time()
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            aborted = self.scheduler.finish_requests(self.output_processor.sequence_ids(rid),
                                                     RequestStatus.FINISHED_ABORTED)
            if self.events.active and aborted:
                self.events.on_aborted(aborted)
            self.output_processor.abort(rid, now)
        self.structured_output.retain(self.scheduler.requests)

    def has_unfinished_requests(self) -> bool:
        """(A batch in flight whose requests were all aborted still has to come back: steps finish it.)"""
        return self.output_processor.has_unfinished_requests() or bool(self._in_flight)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One step. Everything it does (scheduling, the KV connector's loads and saves, the forward, the output) is
        one failure boundary: whatever raises fails the step's requests (_fail_step) and the engine goes on."""
        if self.max_batches_in_flight > 1:
            return self._pipelined_step()
        t0 = time.perf_counter()
        sched_out: SchedulerOutput | None = None
        try:
            self.events.begin_step()
            sched_out = self.scheduler.schedule()
            if sched_out.is_empty:
                self.last_iteration = IterationStats()
                return []
            if self.events.active:
                self.events.on_scheduled(sched_out)
            self._before_forward(sched_out)
            runner_out = self.executor.execute_model(sched_out, self._token_masks())
            return self._apply_output(sched_out, runner_out, t0)
        except Exception as exc:
            return self._fail_step(sched_out, exc)

    def _pipelined_step(self) -> list[RequestOutput]:
        """Pipeline parallelism (vLLM's batch queue): start a new batch while fewer than max_batches_in_flight run,
        so every stage has one to work on; once they are all started (or nothing else can be scheduled), finish the
        oldest. The scheduler leaves the requests of batches in flight out of the next ones. Structured-output
        requests run one batch at a time: their grammars advance only with the tokens that came back. One failure
        boundary, as step(): the batch being started or finished when something raised is the one that fails."""
        t0 = time.perf_counter()
        sched_out: SchedulerOutput | None = None
        try:
            self.events.begin_step()
            depth = 1 if self.structured_output.active else self.max_batches_in_flight
            if len(self._in_flight) < depth:
                sched_out = self.scheduler.schedule(depth)
                if not sched_out.is_empty:
                    self.scheduler.hold_in_flight(sched_out)
                    self._before_forward(sched_out)
                    started = self.executor.start_step(sched_out, self._token_masks())
                    self._in_flight.append((sched_out, started))
                    self.max_batches_in_flight_seen = max(self.max_batches_in_flight_seen, len(self._in_flight))
                    if len(self._in_flight) < depth:
                        self.last_iteration = IterationStats()
                        return []
            if not self._in_flight:
                self.last_iteration = IterationStats()
                return []
            sched_out, started = self._in_flight.popleft()
            if self.events.active:  # the batch's requests have not advanced since it was scheduled
                self.events.on_scheduled(sched_out)
            runner_out = self.executor.finish_step(started)
            return self._apply_output(sched_out, runner_out, t0)
        except Exception as exc:
            return self._fail_step(sched_out, exc)

    def _token_masks(self) -> StructuredOutputManager | None:
        return self.structured_output if self.structured_output.active else None

    def _before_forward(self, sched_out: SchedulerOutput) -> None:
        self._save_kv(sched_out.kv_saves)  # evicted blocks, before this forward overwrites them
        if self.fault_injector is not None:
            self.fault_injector.arm(sched_out)

    def _apply_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput,
                      t0: float) -> list[RequestOutput]:
        """The step's tokens to the scheduler, the requests and the caller."""
        grammars = self.structured_output
        num_decode_tokens = sum(s.num_new_tokens for s in sched_out.scheduled
                                if s.request.num_computed_tokens >= s.request.num_prompt_tokens)
        progressed = self.scheduler.update_from_output(sched_out, runner_out.sampled, runner_out.spec_token_ids)
        self._save_kv(self.kv_cache_manager.take_blocks_to_save())  # write-through: the blocks written just now
        now, t_out = time.time(), time.perf_counter()
        if runner_out.prompt_logprobs:
            self.output_processor.process_prompt_logprobs(runner_out.prompt_logprobs)
        to_stop, failed = self.output_processor.process_tokens(progressed, runner_out.logprobs, now)
        if runner_out.pooled:  # pooled requests are done: finished like a stop, their KV blocks freed at once
            to_stop += self.output_processor.process_pooled(runner_out.pooled, now)
        if grammars.active:  # a completed grammar ends its sequence ("stop"), like EOS (no drafts: one token)
            to_stop += grammars.accept([(r.request_id, r.all_token_ids[-1]) for r, _ in progressed if not r.is_finished])
        if to_stop:
            self.scheduler.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        outputs = self._fail_requests(failed, now) if failed else []
        outputs += self.output_processor.make_outputs(now)
        output_time = time.perf_counter() - t_out
        if grammars.active:
            grammars.retain(self.scheduler.requests)
        self.last_iteration = IterationStats(
            num_scheduled_tokens=sched_out.num_scheduled_tokens,
            num_prompt_tokens=sched_out.num_scheduled_tokens - num_decode_tokens,
            num_generation_tokens=sum(n for _, n in progressed),
            num_scheduled_reqs=len(sched_out.scheduled),
            forward_time=runner_out.forward_time,
            output_time=output_time,
            step_time=time.perf_counter() - t0,
        )
        if self.events.active:
            self.events.end_step(sched_out, runner_out.forward_time)
        return outputs

    def _fail_step(self, sched_out: SchedulerOutput | None, exc: Exception) -> list[RequestOutput]:
        """Something in the step raised: fail the requests of this step, keep everyone else. Their blocks go back to
        the pool; none of this step's blocks was registered in the prefix cache before its forward succeeded
        (hashes are registered only after it), so nothing unwritten can ever be hit. If the scheduler itself raised
        (sched_out None), which requests the step held is unknown: the running ones and the waiting one it was
        admitting are failed, so that neither a half-scheduled request nor one that makes it raise stays behind."""
        self.num_step_failures += 1
        if sched_out is not None:
            # finished ones too: a failure after update_from_output may have finished them without an output
            seq_ids = [s.request.request_id for s in sched_out.scheduled]
        else:
            seq_ids = [r.request_id for r in self.scheduler.running]
            if self.scheduler.num_waiting:
                seq_ids.append(self.scheduler.waiting.peek().request_id)
        user_ids = self.output_processor.user_request_ids(seq_ids)
        logger.error("Engine step failed (%s: %s); failing the %d request(s) it scheduled: %s",
                     type(exc).__name__, exc, len(user_ids), user_ids, exc_info=exc)
        self.last_iteration = IterationStats()
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        outputs = self._fail_requests(dict.fromkeys(user_ids, message), time.time())
        self.structured_output.retain(self.scheduler.requests)
        if self.events.active:
            if sched_out is None:
                sched_out = SchedulerOutput()
                self.events.on_scheduled(sched_out)
            self.events.end_step(sched_out, 0.0, failed=True)
        return outputs

    def _fail_requests(self, failed: dict[str, str], now: float) -> list[RequestOutput]:
        outputs = []
        for rid, message in failed.items():
            self.scheduler.finish_requests(self.output_processor.sequence_ids(rid), RequestStatus.FINISHED_ERROR)
            outputs += self.output_processor.fail([rid], message, now)
        return outputs

    # ------------------------------------------------------------------ stats
    def get_stats(self, kv_detail: bool = True) -> EngineStats:
        """kv_detail: also count the token slots the running requests' blocks hold (a walk over every block they
        hold: ~1-4 ms on a 2-core CPU with 32 requests of ~600 tokens, so the per-step stats leave it out)."""
        kv = self.kv_cache_manager
        stored, allocated = kv.stored_and_allocated(self.scheduler.running) if kv_detail else (0, 0)
        scheduler = SchedulerStats(
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
            num_step_failures=self.num_step_failures,
            spec_decoding=self.scheduler.spec_stats.snapshot() if self.config.speculative else None,
        )
        if self.kv_connector is not None:
            scheduler.external_prefix_cache_queries = self.scheduler.external_queried_tokens
            scheduler.external_prefix_cache_hits = self.scheduler.external_hit_tokens
            scheduler.kv_connector_saved_blocks = self.kv_connector.stats.num_saved_blocks
            scheduler.kv_connector_failures = self.kv_connector.store.num_failures
            scheduler.kv_connector_rejected_payloads = self.kv_connector.stats.num_rejected_payloads
        return EngineStats(scheduler, self.last_iteration)

    def take_step_stats(self) -> StepStats:
        """Engine stats plus the per-request latencies observed since the last call (for the metrics)."""
        stats = self.get_stats(kv_detail=False)  # after every step of the server: nothing there reads the slots
        requests = self.output_processor.take_stats()
        return StepStats(scheduler=stats.scheduler, iteration=stats.iteration, ttfts=requests.ttfts,
                         itls=requests.itls, finished=requests.finished)
