"""LoRARequest (vLLM's fields): which adapter a request runs with. Plain Python: the scheduler reads it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the name clients use (the OpenAI `model` field); lora_int_id: a positive id unique per adapter in
    this engine; lora_path: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string (a PEFT adapter directory).")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def cache_key(self) -> str:
        """What enters the first KV block's hash: name and path, so that two adapters never share KV, an adapter
        reloaded from another path does not hit its predecessor's blocks, and instances serving the same adapter
        under the same name share keys in a KV store (int ids are per engine)."""
        return f"lora:{self.lora_name}:{self.lora_path}"
