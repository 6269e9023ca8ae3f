"""Multi-LoRA serving (vLLM's interface): LoRARequest, PEFT adapter loading, the batched LoRA layers."""
from pagedserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
