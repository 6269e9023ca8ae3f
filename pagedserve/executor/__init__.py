"""Model executors: how the engine's steps reach the model - in this process (`uni`), in worker processes (`mp`),
or in Ray actors (`ray`) - with tensor and pipeline parallelism across the ranks."""
from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.executor.base import Executor, ExecutorDeadError
from pagedserve.executor.cpu_binding import bind_threads, rank_cpus
from pagedserve.model_executor.model_runner import ModelRunner
from pagedserve.model_executor.parallel_state import SINGLE, ParallelLayout

__all__ = ["Executor", "ExecutorDeadError", "create_executor"]


def create_executor(config: EngineConfig) -> Executor:
    """Validates the parallel layout against the model (a clear ValueError) before anything starts."""
    parallel, model = config.parallel, config.model
    layout = ParallelLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    layout.validate(model.num_heads, model.num_kv_heads, model.intermediate_size, model.num_layers)
    backend = parallel.distributed_executor_backend
    cpus = rank_cpus(parallel.cpu_bind, layout.world_size) if parallel.device == "cpu" else None
    if backend == "uni":
        from pagedserve.executor.uniproc import UniProcExecutor

        if cpus is not None:
            bind_threads(cpus[0], parallel.num_threads or len(cpus[0]))
        return UniProcExecutor(ModelRunner(config, SINGLE))
    if backend == "mp":
        from pagedserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, layout, cpus)
    from pagedserve.executor.ray_executor import RayExecutor

    return RayExecutor(config, layout, cpus)
