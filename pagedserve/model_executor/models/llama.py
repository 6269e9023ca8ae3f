"""One decoder for Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Q, K and V are one fused projection, and so are gate and up: one GEMM each instead of three and two.
The model sees a flat batch of tokens; everything about KV layout is behind `paged_attention`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.model_executor.attention import AttentionMetadata, paged_attention
from pagedserve.model_executor.layers import Linear, RMSNorm, RotaryEmbedding, apply_rotary, silu_and_mul
from pagedserve.model_executor.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :self.q_size + self.kv_size].view(t, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: per-head norms, in place in the QKV output where native (no cat)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            if self.q_norm.forward_inplace(q):
                self.k_norm.forward_inplace(k)  # same tensor, dtype and device: applies too
            else:
                qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = apply_rotary(qk, cos_sin)  # q and k heads rotated together: half the small ops
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, cos_sin, x: torch.Tensor, residual: torch.Tensor | None, kv_cache,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it): each residual add is fused
        into the norm that follows it (the next layer's input norm, or the final norm)."""
        if residual is None:  # first layer: the embeddings are the residual stream
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(cos_sin, h, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm(h, residual)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits for the rows in `logits_indices` only."""
        x, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(cos_sin, x, residual, kv_cache, meta)
        return self.lm_head(self.norm(x[logits_indices], residual[logits_indices])).float()

    def set_linear_backend(self, backend: str) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.set_backend(backend)

    # ------------------------------------------------------------------ weights
    def load_weights(self, model_dir: Path) -> None:
        """Read safetensors shards (single file or index) into the fused parameters."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in _iter_safetensors(model_dir):
            name = name.removeprefix("model.")
            if name.startswith("lm_head.") and self.cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                pname = ".".join(parts[:-2] + [target, parts[-1]])
                param = params[pname]
                sizes = self._shard_sizes(target)
                offset = sum(sizes[:shard])
                param.data[offset:offset + sizes[shard]].copy_(tensor)
                loaded.add(f"{pname}#{shard}")
            elif name in params:
                params[name].data.copy_(tensor)
                loaded.add(name)
            elif "rotary_emb" not in name:
                raise ValueError(f"Unexpected weight {name!r} in checkpoint {model_dir}.")
        expected = set()
        for n in params:
            num_shards = 3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 0
            if num_shards:
                expected.update(f"{n}#{i}" for i in range(num_shards))
            else:
                expected.add(n)
        missing = expected - loaded
        if missing:
            raise ValueError(f"Checkpoint {model_dir} lacks weights: {sorted(missing)[:5]} ...")

    def _shard_sizes(self, target: str) -> list[int]:
        cfg = self.cfg
        if target == "qkv_proj":
            return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        return [cfg.intermediate_size, cfg.intermediate_size]


def _iter_safetensors(model_dir: Path):
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No *.safetensors weights in {model_dir}.")
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
