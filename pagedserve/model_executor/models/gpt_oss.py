"""gpt-oss (GptOssForCausalLM) on the shared decoder: biased q/k/v/o projections, attention sinks (one learned logit
per head in each softmax's denominator), sliding and full attention layers alternating (config.layer_types), yarn
RoPE, and in every layer an MoE MLP: a biased router whose top-k logits are softmaxed over the k, and biased experts
with a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate), gate clamped to <= limit and up to [-limit, limit].

Attention with sinks runs on the model's backend like any layer's (the sinks passed with each call): the native CPU
kernels and the Triton ones add each head's sink to the softmax's denominator, the reference an extra score column.

Checkpoint: transformers' layout, experts stacked as gate_up_proj [E, H, 2I] with gate and up interleaved along 2I,
down_proj [E, I, H], and their biases; they are de-interleaved and transposed into FusedMoE's [E, 2I, H] (gate | up)
and [E, H, I] as they load. The hub's MXFP4 checkpoints (`*_blocks` / `*_scales` expert tensors, quant_method
"mxfp4") are dequantized on load into that layout (quantization/mxfp4.py): the experts run in the model dtype, or
int8 with --quantization int8.

Tensor parallel: heads (and their sinks) and every expert's intermediate channels split over the ranks; the
row-parallel o_proj and experts' down biases are added by rank 0 only, since the ranks' outputs are summed.
"""
from __future__ import annotations

import json

import torch
from torch import nn

from pagedserve.model_executor.layers.activation import SwigluOAI
from pagedserve.model_executor.layers.decoder import Attention, DecoderLayer, DecoderOptions
from pagedserve.model_executor.layers.fused_moe import FusedMoE
from pagedserve.model_executor.layers.fused_moe.layer import local_intermediate
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.decoder_lm import DecoderForCausalLM
from pagedserve.model_executor.parallel_state import ParallelState
from pagedserve.model_executor.quantization.base import QuantizationConfig
from pagedserve.model_executor.quantization.mxfp4 import dequantize_mxfp4


class GptOssAttention(Attention):
    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend, quant_config: QuantizationConfig,
                 options: DecoderOptions, prefix: str) -> None:
        super().__init__(cfg, parallel, attn_backend, quant_config, options, prefix)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, True, quant_config, f"{prefix}.o_proj")
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)  # this rank's heads


class GptOssMoeBlock(nn.Module):
    """router.{weight,bias} and experts.* (FusedMoE with biases and the clamped SwiGLU)."""

    def __init__(self, hf: dict, parallel: ParallelState, quant_config: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        self.parallel = parallel
        self.top_k = hf["num_experts_per_tok"]
        hidden, experts = hf["hidden_size"], hf["num_local_experts"]
        self.router = Linear(hidden, experts, True, quant_config.float_config, f"{prefix}.router")  # never quantized
        self.experts = FusedMoE(experts, hidden, local_intermediate(hf["intermediate_size"], parallel,
                                                                    "intermediate_size"),
                                quant_config, f"{prefix}.experts", bias=True,
                                activation=SwigluOAI(hf.get("swiglu_alpha", 1.702), hf.get("swiglu_limit", 7.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)  # over the k chosen experts only
        return self.parallel.all_reduce(self.experts(x, weights, ids))


class GptOssForCausalLM(DecoderForCausalLM):
    supports_fused_decode = False  # the native decode stack has neither sinks nor MoE MLPs

    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend, quant_config) -> None:
        self.hf = json.loads((cfg.model_dir / "config.json").read_text())
        super().__init__(cfg, parallel, attn_backend, quant_config)

    def decoder_options(self, cfg: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)

    def make_layer(self, cfg: ModelConfig, parallel: ParallelState, attn_backend, quant_config: QuantizationConfig,
                   options: DecoderOptions, prefix: str) -> nn.Module:
        layer = DecoderLayer(cfg, parallel, attn_backend, quant_config, options, prefix)
        layer.self_attn = GptOssAttention(cfg, parallel, attn_backend, quant_config, options, f"{prefix}.self_attn")
        layer.mlp = GptOssMoeBlock(self.hf, parallel, quant_config, f"{prefix}.mlp")
        return layer

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.process_weights_after_loading()

    def checkpoint_tensors(self, model_dir):
        """MXFP4 experts (`X_blocks` [E, out, G, 16] with `X_scales`) as transformers' float `X` [E, in, out]."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in super().checkpoint_tensors(model_dir):
            if not name.endswith(("_blocks", "_scales")):
                yield name, tensor
                continue
            base, part = name.rsplit("_", 1)
            pending.setdefault(base, {})[part] = tensor
            if len(pending[base]) == 2:
                parts = pending.pop(base)
                yield base, dequantize_mxfp4(parts["blocks"], parts["scales"]).transpose(1, 2)

    def load_extra_weight(self, name: str, tensor: torch.Tensor, params: dict) -> str | None:
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts"):
            if leaf in ("gate_up_proj", "gate_up_proj_bias"):
                # [E, (H,) 2I] interleaved -> this rank's gate | up channels along the last dim
                gate, up = tensor[..., ::2], tensor[..., 1::2]
                size = gate.shape[-1] // tp
                w = torch.cat((gate[..., rank * size:(rank + 1) * size], up[..., rank * size:(rank + 1) * size]), -1)
                target = f"{prefix}.w13_weight" if leaf == "gate_up_proj" else f"{prefix}.w13_bias"
                params[target].data.copy_(w.transpose(1, 2) if leaf == "gate_up_proj" else w)
            elif leaf == "down_proj":  # [E, I, H]: this rank's I rows, as [E, H, I_local]
                size = tensor.shape[1] // tp
                target = f"{prefix}.w2_weight"
                params[target].data.copy_(tensor[:, rank * size:(rank + 1) * size].transpose(1, 2))
            elif leaf == "down_proj_bias":
                target = f"{prefix}.w2_bias"
                params[target].data.copy_(tensor if rank == 0 else torch.zeros_like(tensor))
            else:
                return None
            return target
        if leaf == "sinks":
            heads = self.cfg.num_heads // tp
            params[name].data.copy_(tensor[rank * heads:(rank + 1) * heads])
            return name
        if name.endswith(".o_proj.bias"):  # row-parallel: summed over the ranks, so added once
            params[name].data.copy_(tensor if rank == 0 else torch.zeros_like(tensor))
            return name
        return None
