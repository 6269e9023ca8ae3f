"""Mixture-of-experts families on the shared decoder: Mixtral, Qwen2-MoE (shared expert with its sigmoid gate) and
Qwen3-MoE (norm_topk_prob, mlp_only_layers, decoder_sparse_step). Attention is the shared layer's; a sparse layer's
MLP is layers/fused_moe's SparseMoeBlock. Checkpoint names (hub layout: one tensor per expert and projection) are
stacked into the block's [E, 2I, H] / [E, H, I] parameters as they are read.

Tensor parallel: each expert's intermediate channels are split over the ranks like the dense MLP's (the loader's
gate/up row and down column slices apply to every expert's tensors); pipeline stages work as for the dense families.
The native whole-stack decode is dense-only, so these models run the Python layers (the experts' GEMMs are native:
layers/fused_moe/experts.py).
"""
from __future__ import annotations

import json
import re

import torch

from pagedserve.model_executor.layers.decoder import DecoderOptions
from pagedserve.model_executor.layers.fused_moe import FusedMoE, SparseMoeBlock
from pagedserve.model_executor.layers.fused_moe.layer import local_intermediate
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.decoder_lm import DecoderForCausalLM, load_shard

_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
# a GGUF file's experts kept in blocks (quantization/gguf.py: GGUFExpertsMethod), one stacked tensor per projection
_EXPERT_BLOCKS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.qweight$")
_SHARED = re.compile(r"^(layers\.\d+\.mlp\.shared_expert)\.(gate_proj|up_proj)\.(\w+)$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class _MoeForCausalLM(DecoderForCausalLM):
    supports_fused_decode = False  # the native decode stack runs dense MLPs only

    def __init__(self, cfg: ModelConfig, parallel, attn_backend, quant_config) -> None:
        super().__init__(cfg, parallel, attn_backend, quant_config)
        hf = json.loads((cfg.model_dir / "config.json").read_text())
        # this rank's expert width: the checkpoint's expert tensors arrive sliced by the loader's TP rules
        self.moe_intermediate = local_intermediate(self.moe_intermediate_size(hf), parallel, "moe_intermediate_size")
        for local, i in enumerate(self.layer_range):
            if self.is_sparse_layer(hf, i):
                self.layers[local].mlp = SparseMoeBlock(
                    cfg.hidden_size, self.num_experts(hf), hf["num_experts_per_tok"], self.moe_intermediate_size(hf),
                    self.renormalize(hf), hf.get("shared_expert_intermediate_size") or 0, parallel, quant_config,
                    f"layers.{i}.mlp")

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.process_weights_after_loading()

    # what each family reads from its config.json
    def num_experts(self, hf: dict) -> int:
        return hf.get("num_experts") or hf["num_local_experts"]  # transformers 5 writes the latter

    def moe_intermediate_size(self, hf: dict) -> int:
        return hf["moe_intermediate_size"]

    def renormalize(self, hf: dict) -> bool:
        return bool(hf.get("norm_topk_prob", False))

    def is_sparse_layer(self, hf: dict, i: int) -> bool:
        """Qwen's rule: layers not in mlp_only_layers, every decoder_sparse_step-th (1-based)."""
        step = hf.get("decoder_sparse_step", 1)
        return i not in (hf.get("mlp_only_layers") or []) and self.num_experts(hf) > 0 and (i + 1) % step == 0

    def load_extra_weight(self, name: str, tensor: torch.Tensor, params: dict) -> str | None:
        m = _EXPERT.match(name)
        key = None if m is None else f"{m[1]}.experts.checkpoint_experts.{m[2]}.{m[3]}.{m[4]}"  # a format's, as stored
        if key in params:
            params[key].data.copy_(tensor)
            return key
        if m is not None and m[4] == "weight" and f"{m[1]}.experts.w13_weight" in params:
            prefix, e, proj = m[1], int(m[2]), m[3]
            if proj == "down_proj":
                params[f"{prefix}.experts.w2_weight"].data[e].copy_(tensor)
                return f"{prefix}.experts.w2_weight"
            size = self.moe_intermediate
            offset = 0 if proj == "gate_proj" else size
            params[f"{prefix}.experts.w13_weight"].data[e, offset:offset + size].copy_(tensor)
            return f"{prefix}.experts.w13_weight"
        m = _EXPERT_BLOCKS.match(name)
        if m is not None:
            params[f"{m[1]}.{m[2]}_qweight"].data.copy_(tensor)
            return f"{m[1]}.{m[2]}_qweight"
        m = _SHARED.match(name)
        if m is not None:  # its float weight, or a quantized format's tensors (their output features where they say)
            param = params[f"{m[1]}.gate_up_proj.{m[3]}"]
            dim = getattr(param, "output_dim", 0)
            size = 0 if dim is None else param.shape[dim] * getattr(param, "packed_factor", 1) // 2
            shard = int(m[2] == "up_proj")
            load_shard(param, tensor, shard * size, size, False)
            return f"{m[1]}.gate_up_proj.{m[3]}#{shard}"  # the shared rule's shard keys
        return None


class Qwen2MoeForCausalLM(_MoeForCausalLM):
    def decoder_options(self, cfg: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=cfg.attention_bias is not False)  # as Qwen2: q/k/v biases always on


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    def decoder_options(self, cfg: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(cfg.attention_bias), qk_norm=True)


class MixtralForCausalLM(_MoeForCausalLM):
    """Every layer sparse, always renormalised; hub names block_sparse_moe.experts.j.w1/w3/w2."""

    def moe_intermediate_size(self, hf: dict) -> int:
        return hf["intermediate_size"]

    def renormalize(self, hf: dict) -> bool:
        return True

    def is_sparse_layer(self, hf: dict, i: int) -> bool:
        return True

    def checkpoint_tensors(self, model_dir):
        """Qwen's names (mlp.experts.j.gate_proj/up_proj/down_proj) before the loader's TP slicing reads them."""
        for name, tensor in super().checkpoint_tensors(model_dir):
            name = name.replace(".block_sparse_moe.", ".mlp.")
            m = re.match(r"^(.*\.experts\.\d+)\.(w[123])\.weight$", name)
            yield (name if m is None else f"{m[1]}.{_MIXTRAL_NAMES[m[2]]}.weight"), tensor
