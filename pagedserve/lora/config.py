"""LoRAConfig: the resolved --enable-lora settings (plain Python; part of the frozen EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass

# vLLM's supported ranks are powers of two up to 512; any rank <= max_lora_rank loads here (padded to it)
MAX_LORA_RANK_LIMIT = 512


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters in the slots at once: at most this many distinct adapters per step
    max_lora_rank: int = 16  # the slots' rank: smaller adapters are zero-padded
    max_cpu_loras: int = 1  # adapters kept loaded in host memory (LRU), at least max_loras

    @classmethod
    def create(cls, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> "LoRAConfig":
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras!r}.")
        if not isinstance(max_lora_rank, int) or not 1 <= max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK_LIMIT}], got {max_lora_rank!r}.")
        cpu = max_loras if max_cpu_loras is None else max_cpu_loras
        if not isinstance(cpu, int) or cpu < max_loras:
            raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras}).")
        return cls(max_loras, max_lora_rank, cpu)
