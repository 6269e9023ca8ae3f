"""Gemma 2 on the shared attention: GeGLU MLP (gelu tanh), (1 + w) RMSNorms (layers/norm.py GemmaRMSNorm), a norm
before and after both attention and MLP, embeddings scaled by sqrt(hidden_size) (in the embedding dtype, as
transformers does), attention scale query_pre_attn_scalar ** -0.5, attention-logit and final-logit soft-capping,
and sliding/full layers from config.json's layer_types (older configs: every even layer slides).

The attention's soft cap and windows run in every backend's kernels. On CPU the native whole-stack decode
(layers/fused_decode.py) runs this layer too: its norms after attention and MLP, GeGLU, the soft cap per layer.
Gemma 3 (models/gemma3.py) is this layer with q/k norms and per-layer-type RoPE bases.
"""
from __future__ import annotations

import dataclasses
import json

import torch
from torch import nn

from pagedserve.model_executor.attention.backend import AttentionBackend, KVCache
from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.layers.activation import gelu_tanh_and_mul
from pagedserve.model_executor.layers.decoder import MLP, Attention, DecoderOptions
from pagedserve.model_executor.layers.norm import GemmaRMSNorm
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.decoder_lm import DecoderForCausalLM
from pagedserve.model_executor.parallel_state import ParallelState
from pagedserve.model_executor.quantization.base import QuantizationConfig


class GemmaMLP(MLP):
    activation = "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.parallel.all_reduce(self.down_proj(gelu_tanh_and_mul(gate_up,
                                                                         self.attn_backend.fused_ops(gate_up))))


class GemmaDecoderLayer(nn.Module):
    """residual += post_attention_norm(attn(input_norm(x))); residual += post_feedforward_norm(mlp(
    pre_feedforward_norm(residual))). Each residual add is fused into the norm after it, as in layers/decoder.py:
    the layer returns (its post-MLP-norm output, the residual before adding it)."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                 quant_config: QuantizationConfig, options: DecoderOptions, prefix: str, hf: dict) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[int(prefix.split(".")[1])] if cfg.layer_types else "full_attention"
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, attn_backend)
        self.self_attn = Attention(cfg, parallel, attn_backend, quant_config, options, f"{prefix}.self_attn")
        self.self_attn.scale = hf.get("query_pre_attn_scalar", 256) ** -0.5  # transformers' default
        self.self_attn.logits_soft_cap = hf.get("attn_logit_softcapping")
        if options.qk_norm:  # Gemma 3: the per-head norms are (1 + w) too
            self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, eps, attn_backend)
            self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, eps, attn_backend)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, attn_backend)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, attn_backend)
        self.mlp = GemmaMLP(cfg, parallel, attn_backend, quant_config, f"{prefix}.mlp")
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, attn_backend)

    def forward(self, cos_sin, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # first layer: the embeddings are the residual stream
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        if isinstance(cos_sin, dict):  # per layer type (Gemma 3)
            cos_sin = cos_sin[self.layer_type]
        h = self.post_attention_layernorm(self.self_attn(cos_sin, h, kv_cache, meta))
        h = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(DecoderForCausalLM):
    norm_class = GemmaRMSNorm
    sliding_window_pattern = 2  # older configs without layer_types: every this-many-th layer attends to all

    def __init__(self, cfg: ModelConfig, parallel, attn_backend, quant_config) -> None:
        self.hf = json.loads((cfg.model_dir / "config.json").read_text())
        if self.hf.get("use_bidirectional_attention"):
            raise ValueError(f"{cfg.architecture} with use_bidirectional_attention (an embedding model) is not "
                             "supported: pagedserve serves causal language models.")
        if cfg.layer_types is None and cfg.sliding_window:
            pattern = self.hf.get("sliding_window_pattern", self.sliding_window_pattern)
            cfg = dataclasses.replace(cfg, layer_types=tuple(
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg.num_layers)))
        super().__init__(cfg, parallel, attn_backend, quant_config)
        self.final_logit_soft_cap = self.hf.get("final_logit_softcapping")

    def make_layer(self, cfg, parallel, attn_backend, quant_config, options, prefix) -> nn.Module:
        return GemmaDecoderLayer(cfg, parallel, attn_backend, quant_config, options, prefix, self.hf)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)

    def process_weights_after_loading(self) -> None:
        dtype = self.layers[0].input_layernorm.weight.dtype
        for module in self.modules():  # before the native decode stack takes the norms' weights
            if isinstance(module, GemmaRMSNorm):
                module.fold_weight()
        super().process_weights_after_loading()
        self.hidden_dtype = dtype  # the model dtype (the folded norms' weights are float32)
