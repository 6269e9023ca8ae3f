"""Qwen2 (and Qwen2.5): the shared decoder with q/k/v biases (its config.json does not list them: always on)."""
from pagedserve.model_executor.layers.decoder import DecoderOptions
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.decoder_lm import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    def decoder_options(self, cfg: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=cfg.attention_bias is not False)
