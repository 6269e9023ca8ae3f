"""The model registry: architectures[0] -> class, the supported list everywhere derived from it, a clear error for
any other architecture, and each family's options on the shared decoder."""
import json

import pytest
import torch

from pagedserve.model_executor.attention.selector import get_attention_backend
from pagedserve.model_executor.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedserve.model_executor.models.registry import get_model_class
from pagedserve.model_executor.parallel_state import SINGLE
from pagedserve.model_executor.quantization.unquantized import UnquantizedConfig


def test_supported_architectures_come_from_the_registry():
    assert SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                       "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                       "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                                       "Phi3ForCausalLM")
    for arch in SUPPORTED_ARCHITECTURES:
        assert get_model_class(arch).__name__ == arch


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
