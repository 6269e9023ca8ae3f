"""The pre-norm decoder layer of the Llama family, configured by each model: attention (fused QKV projection,
optional q/k/v bias, optional per-head q/k RMSNorm, rotary, paged attention through the model's attention
backend, output projection) and a gated SiLU MLP (fused gate/up projection, down projection).

Q, K and V are one fused projection, and so are gate and up: one GEMM each instead of three and two.

Tensor parallel (Megatron-style): QKV and gate/up are split by output rows (heads, intermediate channels), o_proj and
down_proj by input columns and followed by an all-reduce. A rank holds only its heads' KV.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.model_executor.attention.backend import AttentionBackend, KVCache
from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.layers.activation import silu_and_mul
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.layers.norm import RMSNorm
from pagedserve.model_executor.layers.rotary import apply_rotary
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.parallel_state import ParallelState
from pagedserve.model_executor.quantization.base import QuantizationConfig


@dataclass(frozen=True)
class DecoderOptions:
    """What a family sets on the shared decoder layer."""
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                 quant_config: QuantizationConfig, options: DecoderOptions, prefix: str) -> None:
        super().__init__()
        self.parallel = parallel
        self.attn_backend = attn_backend
        self.num_heads = cfg.num_heads // parallel.tp_size
        self.num_kv_heads = parallel.layout.local_kv_heads(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, options.qkv_bias, quant_config,
                               f"{prefix}.qkv_proj")
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, quant_config, f"{prefix}.o_proj")
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, attn_backend) if options.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, attn_backend) if options.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        self.sliding_window = cfg.layer_sliding_window(int(prefix.split(".")[1]))  # prefix: layers.{i}.self_attn
        self.logits_soft_cap: float | None = None  # a family that caps attention scores sets it (Gemma 2)
        self.sinks: torch.Tensor | None = None  # a family with attention sinks sets its per-head logits (gpt-oss)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :self.q_size + self.kv_size].view(t, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per-head norms, in place in the QKV output where fused (no cat)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            if self.q_norm.forward_inplace(q):
                self.k_norm.forward_inplace(k)  # same tensor, dtype and device: applies too
            else:
                qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = apply_rotary(qk, cos_sin, self.attn_backend.fused_ops(qk))  # q and k heads together: half the ops
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        o = self.attend(q, k, v, kv_cache, meta)
        return self.parallel.all_reduce(self.o_proj(o.reshape(t, self.q_size)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               meta: AttentionMetadata) -> torch.Tensor:
        """The step's K/V into the cache and attention over it (a family with another attention overrides it)."""
        return self.attn_backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                         self.logits_soft_cap, self.sinks)


class MLP(nn.Module):
    activation = "silu"  # of the gate (SwiGLU); the native whole-stack decode runs "silu" and "gelu_tanh"

    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                 quant_config: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        self.parallel = parallel
        self.attn_backend = attn_backend  # its fused silu * mul
        intermediate = cfg.intermediate_size // parallel.tp_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * intermediate, False, quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = Linear(intermediate, cfg.hidden_size, False, quant_config, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.parallel.all_reduce(self.down_proj(silu_and_mul(gate_up, self.attn_backend.fused_ops(gate_up))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                 quant_config: QuantizationConfig, options: DecoderOptions, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, attn_backend)
        self.self_attn = Attention(cfg, parallel, attn_backend, quant_config, options, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, attn_backend)
        self.mlp = MLP(cfg, parallel, attn_backend, quant_config, f"{prefix}.mlp")

    def forward(self, cos_sin, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it): each residual add is fused
        into the norm that follows it (the next layer's input norm, or the final norm). rows: only these rows go
        on past attention (a pooling model's last layer: the rows its pooler reads; every K/V is written)."""
        if residual is None:  # first layer: the embeddings are the residual stream
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(cos_sin, h, kv_cache, meta)
        if rows is not None:
            h, residual = h[rows], residual[rows]
        return self.mlp(self.post_attention_layernorm(h, residual)), residual
