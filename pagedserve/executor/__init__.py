"""Model executors: how the engine's steps reach the model - in this process (`uni`), in worker processes (`mp`),
or in Ray actors (`ray`) - with tensor and pipeline parallelism across the ranks."""
from __future__ import annotations

import torch

from pagedserve.config import EngineArgs
from pagedserve.executor.base import Executor, ExecutorDeadError
from pagedserve.executor.cpu_binding import bind_threads, rank_cpus
from pagedserve.executor.worker import RunnerArgs
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.parallel_state import SINGLE, ParallelLayout

__all__ = ["Executor", "ExecutorDeadError", "create_executor"]


def create_executor(args: EngineArgs, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                    kv_dtype: torch.dtype) -> Executor:
    """Validates the parallel layout against the model (a clear ValueError) before anything starts."""
    layout = ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size)
    layout.validate(model_config.num_heads, model_config.num_kv_heads, model_config.intermediate_size,
                    model_config.num_layers)
    backend = args.resolved_executor_backend
    cpus = rank_cpus(args.cpu_bind, layout.world_size) if device.type == "cpu" else None
    runner_args = RunnerArgs(model_config, device, dtype, args.block_size, args.seed, args.linear_backend,
                             args.quantization, kv_dtype, args.speculative, args.enforce_eager)
    if backend == "uni":
        from pagedserve.executor.uniproc import UniProcExecutor

        if cpus is not None:
            bind_threads(cpus[0], args.num_threads or len(cpus[0]))
        return UniProcExecutor(runner_args.build(SINGLE))
    if backend == "mp":
        from pagedserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(runner_args, layout, cpus, args.num_threads)
    from pagedserve.executor.ray_executor import RayExecutor

    return RayExecutor(runner_args, layout, cpus, args.num_threads)
