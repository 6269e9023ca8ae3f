"""The supported architectures: config.json's `architectures[0]` -> the model class, imported only when used.
A new architecture is its file in this package and one line here. Pooling architectures (a family's
*ForSequenceClassification and bare *Model checkpoints) are a causal family behind an adapter (adapters.py); a
causal LM served with the pooling runner gets the embedding adapter. Encoder-only models (BERT, RoBERTa, XLM-RoBERTa:
bidirectional attention) are pooling models of their own (models/bert.py); the engine runs each of their prompts
whole in one step (is_encoder_only)."""
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
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}
_POOLING_MODELS: dict[str, tuple[str, str]] = {  # architecture -> (the causal architecture, adapter)
    "LlamaForSequenceClassification": ("LlamaForCausalLM", "as_seq_cls_model"),
    "MistralForSequenceClassification": ("MistralForCausalLM", "as_seq_cls_model"),
    "Qwen2ForSequenceClassification": ("Qwen2ForCausalLM", "as_seq_cls_model"),
    "Qwen3ForSequenceClassification": ("Qwen3ForCausalLM", "as_seq_cls_model"),
    "LlamaModel": ("LlamaForCausalLM", "as_embedding_model"),
    "MistralModel": ("MistralForCausalLM", "as_embedding_model"),
    "Qwen2Model": ("Qwen2ForCausalLM", "as_embedding_model"),
    "Qwen3Model": ("Qwen3ForCausalLM", "as_embedding_model"),
}
_ENCODER_MODELS: dict[str, tuple[str, str]] = {  # architecture -> (module in models/, class)
    "BertModel": ("bert", "BertEmbeddingModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaModel": ("bert", "RobertaEmbeddingModel"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaModel": ("bert", "RobertaEmbeddingModel"),
    "XLMRobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
}
SUPPORTED_ARCHITECTURES = tuple(_MODELS) + tuple(_POOLING_MODELS) + tuple(_ENCODER_MODELS)


def is_encoder_only(architecture: str) -> bool:
    """Bidirectional attention over the whole prompt: no chunked prefill, no prefix caching, no generation."""
    return architecture in _ENCODER_MODELS


def check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"Model architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}.")


def get_model_class(architecture: str, pooling: bool = False) -> type[nn.Module]:
    """pooling: the engine runs the pooling runner (a causal LM then serves as an embedding model)."""
    check_architecture(architecture)
    if architecture in _ENCODER_MODELS:
        module, name = _ENCODER_MODELS[architecture]
        return getattr(importlib.import_module(f"pagedserve.model_executor.models.{module}"), name)
    adapter = None
    if architecture in _POOLING_MODELS:
        architecture, adapter = _POOLING_MODELS[architecture]
    elif pooling:
        adapter = "as_embedding_model"
    module, name = _MODELS[architecture]
    cls = getattr(importlib.import_module(f"pagedserve.model_executor.models.{module}"), name)
    if adapter is None:
        return cls
    return getattr(importlib.import_module("pagedserve.model_executor.models.adapters"), adapter)(cls)
