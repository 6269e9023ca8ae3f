"""The driver side of a multi-rank executor: rank 0 runs in the engine process, workers are processes (`mp`) or
Ray actors (`ray`); the subclasses only start, watch and stop the workers.

Every step the driver prepares the batch, broadcasts it (step_broadcast.py), runs its own shard and samples from
the logits it gathers or receives. A failure inside the forward leaves the ranks at different points of their
collective sequence, so it is fatal for the whole group: the executor records why (naming the rank that died
when one did), stops the workers and fails every later step at once with ExecutorDeadError, instead of waiting on
a peer that will never answer.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from abc import abstractmethod
from collections import deque

import torch
import torch.distributed as dist

from pagedserve import envs
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.executor.base import Executor, ExecutorDeadError
from pagedserve.executor.cpu_binding import bind_threads
from pagedserve.executor.step_broadcast import Command, ControlChannel, pack_step
from pagedserve.config import EngineConfig
from pagedserve.executor.worker import WorkerSpec
from pagedserve.model_executor.attention import AttentionMetadata
from pagedserve.model_executor.model_runner import ModelRunner, ModelRunnerOutput, StartedStep, TokenMaskSource
from pagedserve.model_executor.parallel_state import ParallelLayout, ParallelState, create_store, init_parallel_state

logger = logging.getLogger("pagedserve")

DEATH_GRACE_S = 2.0  # after a failed collective, how long to look for the worker that died (to name it)


class DriverModelRunner(ModelRunner):
    """Rank 0's runner: broadcasts each forward's inputs before running its own shard, and receives the logits from
    the last pipeline stage when it is not that stage.

    start_step returns once this rank's stage has run, without waiting for the broadcast to be received or for the
    logits, so that with pipeline parallelism the engine can start the next batch while the later stages work on
    this one; finish_step takes the logits (execute_model does both at once). Steps finish in the order they
    started and the last stage sends their logits in that order: one receive is posted at a time (the oldest
    step's), and the next one as soon as it has arrived."""

    channel: ControlChannel
    mid_collective = False  # True from the broadcast until the step's last collective returned

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._broadcasts: deque[list[dist.Work]] = deque()  # per started step, oldest first
        self._logits_rows: deque[int] = deque()  # rows of the started steps that produce logits, oldest first
        self._posted: tuple[dist.Work, torch.Tensor] | None = None  # the receive of the oldest one's logits

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  logits_indices: torch.Tensor) -> torch.Tensor | None:
        self.mid_collective = True
        self._broadcasts.append(self.channel.send(Command.STEP, pack_step(input_ids, positions, meta, logits_indices),
                                                  wait=False))
        logits = super().run_model(input_ids, positions, meta, logits_indices)
        if logits is None and logits_indices.numel():
            self._logits_rows.append(logits_indices.numel())
            self._post_logits_recv()
        self.mid_collective = False
        return logits

    def finish_step(self, step: StartedStep) -> ModelRunnerOutput:
        self.mid_collective = True
        for work in self._broadcasts.popleft():
            work.wait()
        if step.logits is None and step.sampling_items:
            step.logits = self._receive_logits()
        self.mid_collective = False
        result = super().finish_step(step)
        for item in step.sampling_items:  # aborted in flight: its "finished" id went by before this sampling
            if item.request.is_finished:
                self.generators.pop(item.request.request_id, None)
        return result

    def drain(self) -> None:
        """Receive the logits of every step still in flight (before the shutdown message: the last stage must not
        be left waiting to send them)."""
        while self._posted is not None:
            self._receive_logits()
        self._broadcasts.clear()

    def _post_logits_recv(self) -> None:
        if self._posted is None and self._logits_rows:
            parallel: ParallelState = self.model.parallel
            self._posted = parallel.recv_logits_from_last_stage(self._logits_rows.popleft(),
                                                                 self.model_config.vocab_size)

    def _receive_logits(self) -> torch.Tensor:
        work, logits = self._posted
        work.wait()
        self._posted = None
        self._post_logits_recv()  # the next batch's: the last stage may be ready to send it already
        return logits.to(self.device)


class DistributedExecutor(Executor):
    backend = ""
    health_check_interval_s = 0.0  # how often a step first asks whether every worker still runs

    def __init__(self, config: EngineConfig, layout: ParallelLayout, cpus: list[list[int]] | None) -> None:
        self.layout = layout
        self.config = config
        self._dead_reason: str | None = None
        self._stopped = False
        self._next_health_check = 0.0
        world = layout.world_size
        timeout_s = envs.PAGEDSERVE_DIST_TIMEOUT_S
        threads = [config.parallel.num_threads or (len(cpus[r]) if cpus else max(1, (os.cpu_count() or 1) // world))
                   for r in range(world)]
        host = self._rendezvous_host = self._store_host()
        store = create_store(host, world, timeout_s)
        self._launch([WorkerSpec(rank, layout, host, store.port, timeout_s, config,
                                 cpus[rank] if cpus else None, threads[rank]) for rank in range(1, world)])
        try:
            bind_threads(cpus[0] if cpus else None, threads[0])
            parallel = self._join(store, timeout_s)
            self.driver = DriverModelRunner(config, parallel)
            self.driver.channel = ControlChannel(parallel.world_group)
        except BaseException:
            self._stop_workers(graceful=False)
            raise
        logger.info("%s executor: %d ranks (tensor parallel %d x pipeline parallel %d), %s threads per rank%s",
                    self.backend, world, layout.tp_size, layout.pp_size, threads,
                    f", cores {cpus}" if cpus else "")

    # ------------------------------------------------------------------ worker management (per backend)
    @abstractmethod
    def _store_host(self) -> str:
        """The address workers reach the driver's rendezvous store at."""

    @abstractmethod
    def _launch(self, specs: list[WorkerSpec]) -> None:
        ...

    @abstractmethod
    def _dead_workers(self) -> list[str]:
        """One line per worker that is gone (rank, pid or actor, exit status); empty while all run."""

    @abstractmethod
    def _stop_workers(self, graceful: bool) -> None:
        """Make sure no worker survives: after the shutdown message (`graceful`) give them time to exit, after a
        failure stop them at once (they may be waiting inside a collective that will never complete)."""

    # ------------------------------------------------------------------ start-up
    def _join(self, store, timeout_s: float) -> ParallelState:
        """The rendezvous blocks until every rank arrives: wait for it while watching for workers that die first."""
        result: dict = {}

        def join() -> None:
            try:
                device = torch.device(self.config.parallel.device)
                result["state"] = init_parallel_state(self.layout, 0, store, device, timeout_s, self._rendezvous_host)
            except Exception as exc:  # handed to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=join, name="pagedserve-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            dead = self._dead_workers()
            if dead:
                raise ExecutorDeadError(f"{self.backend} executor: a worker died during start-up: {'; '.join(dead)}")
        if "error" in result:
            raise result["error"]
        return result["state"]

    # ------------------------------------------------------------------ the engine's calls
    @property
    def max_batches_in_flight(self) -> int:
        """One batch per pipeline stage keeps every stage busy (vLLM's virtual engines). Speculative decoding
        stays synchronous: the drafter proposes from the tokens just sampled."""
        return self.layout.pp_size if self.config.speculative is None else 1

    def execute_model(self, out: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> ModelRunnerOutput:
        return self._guarded(self.driver.execute_model, out, token_masks)

    def start_step(self, out: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> StartedStep:
        return self._guarded(self.driver.start_step, out, token_masks)

    def finish_step(self, step: StartedStep) -> ModelRunnerOutput:
        return self._guarded(self.driver.finish_step, step)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        def allocate() -> None:
            self.driver.mid_collective = True
            self.driver.channel.send(Command.ALLOCATE_KV_CACHE, torch.tensor([num_blocks]))
            self.driver.mid_collective = False
            self.driver.allocate_kv_cache(num_blocks)

        self._guarded(allocate)

    def _guarded(self, fn, *args):
        now = time.monotonic()
        if self._dead_reason is None and now >= self._next_health_check:
            self._next_health_check = now + self.health_check_interval_s
            dead = self._dead_workers()
            if dead:
                self._mark_dead(f"{self.backend} executor: worker {'; '.join(dead)}")
        if self._dead_reason is not None:
            raise ExecutorDeadError(self._dead_reason)
        try:
            return fn(*args)
        except Exception as exc:
            if not self.driver.mid_collective:
                raise  # input preparation or sampling, on the driver alone: only this step fails
            self._mark_dead(self._explain(exc))
            raise ExecutorDeadError(self._dead_reason) from exc

    def _explain(self, exc: Exception) -> str:
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            dead = self._dead_workers()
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        cause = f"worker {'; '.join(dead)}" if dead else f"the forward failed ({type(exc).__name__}: {exc})"
        return f"{self.backend} executor: {cause}; the tensor/pipeline-parallel group cannot continue"

    def _mark_dead(self, reason: str) -> None:
        self._dead_reason = reason
        logger.error("%s; failing every request from now on", reason)
        self.shutdown()

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def kv_bytes_per_block(self) -> int:
        """Per rank: its layers x its KV heads (the driver's also a draft model's). Ranks on one host share its
        memory (sum); GPUs have their own (max)."""
        layout, cfg, kv_dtype = self.layout, self.config.model, self.driver.kv_dtype
        per_rank = [self.driver.kv_bytes_per_block] + [
            2 * len(layout.layer_range(cfg.num_layers, layout.coords(rank)[0])) * self.config.cache.block_size
            * layout.local_kv_heads(cfg.num_kv_heads) * cfg.head_dim * kv_dtype.itemsize
            for rank in range(1, layout.world_size)]
        return sum(per_rank) if self.config.parallel.device == "cpu" else max(per_rank)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._dead_reason is None:
            try:
                self.driver.drain()
                self.driver.channel.send(Command.SHUTDOWN)
            except Exception:  # a worker is already gone: stopping the rest below is all that is left
                logger.warning("%s executor: shutdown message failed", self.backend, exc_info=True)
        self._stop_workers(graceful=self._dead_reason is None)
        self.driver.model.parallel.shutdown()
