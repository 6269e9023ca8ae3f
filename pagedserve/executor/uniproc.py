"""One process, one model replica: the engine's steps go straight to the ModelRunner."""
from __future__ import annotations

from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.executor.base import Executor
from pagedserve.model_executor.model_runner import ModelRunner, ModelRunnerOutput, TokenMaskSource


class UniProcExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.driver = runner

    def execute_model(self, out: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> ModelRunnerOutput:
        return self.driver.execute_model(out, token_masks)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.driver.kv_bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.driver.allocate_kv_cache(num_blocks)
