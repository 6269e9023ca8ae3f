"""What the engine asks of a model executor: run a step, size and allocate the KV cache, stay healthy."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.model_executor.model_runner import ModelRunner, ModelRunnerOutput, TokenMaskSource


class ExecutorDeadError(RuntimeError):
    """A rank of the executor is gone (a worker died, or a collective failed): no step can run any more."""


class Executor(ABC):
    """`driver` is rank 0's ModelRunner, in the engine process: it prepares every step's inputs and samples."""

    driver: ModelRunner

    @abstractmethod
    def execute_model(self, out: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> ModelRunnerOutput:
        ...

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
