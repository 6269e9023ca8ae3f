"""The supported architectures: config.json's `architectures[0]` -> the model class, imported only when used.
A new architecture is its file in this package and one line here."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

_MODELS: dict[str, tuple[str, str]] = {  # architecture -> (module in models/, class)
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def check_architecture(architecture: str) -> None:
    if architecture not in _MODELS:
        raise ValueError(f"Model architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}.")


def get_model_class(architecture: str) -> type[nn.Module]:
    check_architecture(architecture)
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"pagedserve.model_executor.models.{module}"), name)
