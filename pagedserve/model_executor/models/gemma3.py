"""Gemma 3 (text: Gemma3ForCausalLM): Gemma 2's layer (models/gemma2.py) with (1 + w) q/k norms, no soft-capping
by default, five sliding layers to one full one (older configs' sliding_window_pattern), and RoPE per layer type:
sliding layers rotate with rope_local_base_freq (10k), full ones with rope_theta (1M) and the config's scaling
(linear x8 on the 4B-27B models). Reads both config layouts: transformers 5's per-layer-type rope_parameters and
the hub's top-level rope_theta / rope_local_base_freq / rope_scaling."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.layers.decoder import DecoderOptions
from pagedserve.model_executor.layers.rotary import RotaryEmbedding
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.decoder_lm import build_rotary
from pagedserve.model_executor.models.gemma2 import Gemma2ForCausalLM

_LAYER_TYPES = ("sliding_attention", "full_attention")


class PerLayerTypeRotary(nn.Module):
    """One rotary embedding per layer type; cos_sin gives {layer type: (cos, sin)} (GemmaDecoderLayer picks its
    own)."""

    def __init__(self, rotaries: dict[str, RotaryEmbedding]) -> None:
        super().__init__()
        self.rotaries = nn.ModuleDict(rotaries)

    def cos_sin(self, positions: torch.Tensor, meta: AttentionMetadata | None = None) -> dict:
        return {kind: rotary.cos_sin(positions, meta) for kind, rotary in self.rotaries.items()}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    sliding_window_pattern = 6

    def decoder_options(self, cfg: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(cfg.attention_bias), qk_norm=True)

    def make_rotary(self, cfg: ModelConfig) -> nn.Module:
        params = self.hf.get("rope_parameters") or {}
        if not all(kind in params for kind in _LAYER_TYPES):  # the hub's (transformers 4) layout
            legacy_full = dict(self.hf.get("rope_scaling") or {})
            params = {"full_attention": {**legacy_full, "rope_theta": self.hf.get("rope_theta", 1_000_000.0)},
                      "sliding_attention": {"rope_theta": self.hf.get("rope_local_base_freq", 10_000.0)}}
        rotaries = {}
        for kind in _LAYER_TYPES:
            p = params[kind]
            scaling = p if p.get("rope_type", p.get("type", "default")) != "default" else None
            rotaries[kind] = build_rotary(cfg, p["rope_theta"], scaling)
        return PerLayerTypeRotary(rotaries)
