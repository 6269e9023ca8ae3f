"""A worker rank (1 .. world_size-1): joins the process groups, loads its shard of the model, then runs whatever the
driver broadcasts until told to stop. The same loop runs in a multiprocessing child and in a Ray actor."""
from __future__ import annotations

import ctypes
import logging
import signal
from dataclasses import dataclass

import torch

from pagedserve.config import EngineConfig
from pagedserve.executor.cpu_binding import bind_threads
from pagedserve.executor.step_broadcast import Command, ControlChannel, unpack_step
from pagedserve.model_executor.model_runner import ModelRunner
from pagedserve.model_executor.parallel_state import ParallelLayout, connect_store, init_parallel_state

logger = logging.getLogger("pagedserve")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank needs (picklable: it travels to the worker process or actor)."""
    rank: int
    layout: ParallelLayout
    store_host: str
    store_port: int
    timeout_s: float
    config: EngineConfig  # the rank builds its ModelRunner from it, as the driver does
    cpus: list[int] | None
    num_threads: int


def name_process_and_die_with_parent(rank: int) -> None:
    """`ps` shows the worker as pagedserve-rN, and it must not outlive its engine (Linux: SIGKILL when the parent
    exits)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc: the closed sockets still end the loop
        return
    libc.prctl(15, f"pagedserve-r{rank}".encode())  # PR_SET_NAME
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@torch.inference_mode()
def run_worker(spec: WorkerSpec) -> None:
    bind_threads(spec.cpus, spec.num_threads)
    store = connect_store(spec.store_host, spec.store_port, spec.layout.world_size, spec.timeout_s)
    parallel = init_parallel_state(spec.layout, spec.rank, store, torch.device(spec.config.parallel.device),
                                   spec.timeout_s, spec.store_host)
    runner = ModelRunner(spec.config, parallel)
    channel = ControlChannel(parallel.world_group)
    sends_logits = parallel.rank == parallel.logits_rank
    logger.info("Worker rank %d (pp %d, tp %d) ready", parallel.rank, parallel.pp_rank, parallel.tp_rank)
    while True:
        command, payload = channel.recv()
        if command is Command.SHUTDOWN:
            break
        if command is Command.ALLOCATE_KV_CACHE:
            runner.allocate_kv_cache(int(payload[0]))
            continue
        logits = runner.run_model(*unpack_step(payload, runner.device))
        if sends_logits and logits is not None and logits.shape[0]:
            parallel.send_logits_to_driver(logits)
    parallel.shutdown()


def multiproc_worker_main(spec: WorkerSpec) -> None:
    """Entry point of a `mp` worker process."""
    name_process_and_die_with_parent(spec.rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(levelname)s %(message)s")
    run_worker(spec)
