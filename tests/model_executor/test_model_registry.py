"""The model registry: architectures[0] -> class, the supported list everywhere derived from it, a clear error for
any other architecture, and each family's options on the shared decoder."""
import json

import pytest
import torch

from pagedserve.model_executor.attention.selector import get_attention_backend
from pagedserve.model_executor.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedserve.model_executor.models.registry import get_model_class, is_encoder_only
from pagedserve.model_executor.parallel_state import SINGLE
from pagedserve.model_executor.quantization.unquantized import UnquantizedConfig


CAUSAL = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
          "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
          "GptOssForCausalLM")
POOLING = ("LlamaForSequenceClassification", "MistralForSequenceClassification", "Qwen2ForSequenceClassification",
           "Qwen3ForSequenceClassification", "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
ENCODERS = ("BertModel", "BertForSequenceClassification", "RobertaModel", "RobertaForSequenceClassification",
            "XLMRobertaModel", "XLMRobertaForSequenceClassification")


def test_supported_architectures_come_from_the_registry():
    assert SUPPORTED_ARCHITECTURES == CAUSAL + POOLING + ENCODERS
    for arch in CAUSAL:
        assert get_model_class(arch).__name__ == arch
        # the pooling runner serves a causal LM as an embedding model (no LM head)
        assert get_model_class(arch, pooling=True).__name__ == arch.replace("ForCausalLM", "ForEmbedding")
    for arch in POOLING:  # a family behind an adapter
        name = get_model_class(arch).__name__
        assert name == (arch if arch.endswith("Classification") else arch.replace("Model", "ForEmbedding"))
        assert get_model_class(arch).is_pooling_model and not get_model_class(arch).has_lm_head
    for arch in ENCODERS:  # pooling models of their own, whatever the runner
        assert get_model_class(arch, pooling=True).is_pooling_model and is_encoder_only(arch)
        assert get_model_class(arch).__name__.endswith("ForSequenceClassification" if "Classification" in arch
                                                       else "EmbeddingModel")
    assert not any(is_encoder_only(arch) for arch in CAUSAL + POOLING)


def test_unsupported_architecture_lists_the_supported_ones(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="'GemmaForCausalLM' is not supported; supported: LlamaForCausalLM, "
                                         "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
                                         "Qwen2MoeForCausalLM, Qwen3MoeForCausalLM"):
        get_model_class("GemmaForCausalLM")
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, architectures=["GemmaForCausalLM"])))
    with pytest.raises(ValueError, match="not supported; supported: LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("arch, qkv_bias, qk_norm", [("llama", False, False), ("mistral", False, False),
                                                     ("qwen2", True, False), ("qwen3", False, True)])
def test_each_family_configures_the_shared_decoder(arch, qkv_bias, qk_norm, tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir(arch))
    model = get_model_class(cfg.architecture)(cfg, SINGLE, get_attention_backend("torch", torch.device("cpu")),
                                              UnquantizedConfig("torch"))
    attn = model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == qkv_bias
    assert (attn.q_norm is not None) == qk_norm
