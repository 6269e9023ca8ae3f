"""Qwen3: the shared decoder with a per-head RMSNorm on q and k before rotary."""
from pagedserve.model_executor.layers.decoder import DecoderOptions
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.decoder_lm import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    def decoder_options(self, cfg: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(cfg.attention_bias), qk_norm=True)
