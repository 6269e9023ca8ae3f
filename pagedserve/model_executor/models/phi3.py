"""Phi-3 / Phi-4 (Phi3ForCausalLM): Llama's layer; the checkpoint fuses q/k/v into qkv_proj and gate/up into
gate_up_proj, split here into the shared loader's names (so tensor-parallel slicing is the shared rule's); partial
rotary (partial_rotary_factor, Phi-4-mini's 0.75: the first channels of each head rotate) and LongRoPE
(layers/rotary.py: the long factors when max_model_len exceeds original_max_position_embeddings, as vLLM chooses;
a shorter --max-model-len serves the short ones).

With partial rotary the native whole-stack decode (full-head rotation) does not run; the Python layers do."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.decoder_lm import DecoderForCausalLM, build_rotary


class Phi3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig, parallel, attn_backend, quant_config) -> None:
        hf = json.loads((cfg.model_dir / "config.json").read_text())
        rope = hf.get("rope_parameters") or {}
        partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        self.original_max_position_embeddings = hf.get("original_max_position_embeddings",
                                                       rope.get("original_max_position_embeddings"))
        self.rotary_dim = int(cfg.head_dim * partial)
        super().__init__(cfg, parallel, attn_backend, quant_config)
        self.supports_fused_decode = self.rotary_dim == cfg.head_dim

    def make_rotary(self, cfg: ModelConfig) -> nn.Module:
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        if scaling is not None and self.original_max_position_embeddings is not None:  # hub configs: top level
            scaling.setdefault("original_max_position_embeddings", self.original_max_position_embeddings)
        return build_rotary(cfg, cfg.rope_theta, scaling, self.rotary_dim)

    def checkpoint_tensors(self, model_dir: Path):
        cfg, d = self.cfg, self.cfg.head_dim
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        for name, tensor in super().checkpoint_tensors(model_dir):
            if name.endswith(".qkv_proj.weight"):
                prefix = name.removesuffix("qkv_proj.weight")
                for part, t in zip(("q_proj", "k_proj", "v_proj"), torch.split(tensor, [q, kv, kv])):
                    yield f"{prefix}{part}.weight", t
            elif name.endswith(".gate_up_proj.weight"):
                prefix = name.removesuffix("gate_up_proj.weight")
                gate, up = tensor.chunk(2)
                yield f"{prefix}gate_proj.weight", gate
                yield f"{prefix}up_proj.weight", up
            else:
                yield name, tensor
