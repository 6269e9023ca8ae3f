"""What the engine asks of a model executor: run a step, size and allocate the KV cache, stay healthy."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.model_executor.model_runner import ModelRunner, ModelRunnerOutput, StartedStep, TokenMaskSource


class ExecutorDeadError(RuntimeError):
    """A rank of the executor is gone (a worker died, or a collective failed): no step can run any more."""


class Executor(ABC):
    """`driver` is rank 0's ModelRunner, in the engine process: it prepares every step's inputs and samples."""

    driver: ModelRunner

    # How many scheduled batches the engine may keep in flight (pipeline parallelism: one per stage). With more
    # than one, the engine calls start_step and finish_step, in the same order, instead of execute_model.
    max_batches_in_flight = 1

    @abstractmethod
    def execute_model(self, out: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> ModelRunnerOutput:
        ...

    def start_step(self, out: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> StartedStep:
        """Inputs and the forward; with batches in flight it returns before the later stages are done."""
        return self.driver.start_step(out, token_masks)

    def finish_step(self, step: StartedStep) -> ModelRunnerOutput:
        return self.driver.finish_step(step)

    @property
    @abstractmethod
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes in the memory that `available_memory` measures (summed over the ranks that
        share it)."""

    def available_memory(self) -> int:
        return self.driver.available_memory()

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None:
        ...

    @property
    def dead_reason(self) -> str | None:
        """Why the executor cannot run steps any more; None while it can."""
        return None

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
