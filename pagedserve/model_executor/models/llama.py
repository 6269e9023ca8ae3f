"""One decoder for Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Q, K and V are one fused projection, and so are gate and up: one GEMM each instead of three and two.
The model sees a flat batch of tokens; everything about KV layout is behind `paged_attention`.

Tensor parallel (Megatron-style): QKV and gate/up are split by output rows (heads, intermediate channels), o_proj and
down_proj by input columns and followed by an all-reduce; embedding and LM head are split by vocabulary rows. A
rank holds only its heads' KV. Pipeline parallel: a stage builds only its layers (the embedding on the first, the
final norm and LM head on the last) and hands (hidden, residual) to the next. Checkpoint tensors are sliced as they
are read, so no rank ever holds the whole model.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.model_executor.attention import AttentionMetadata, paged_attention, uses_triton
from pagedserve.model_executor.layers import (Linear, RMSNorm, RotaryEmbedding, VocabParallelEmbedding, apply_rotary,
                                              native_ops, silu_and_mul)
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.parallel_state import SINGLE, ParallelState


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_heads = cfg.num_heads // parallel.tp_size
        self.num_kv_heads = parallel.layout.local_kv_heads(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
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
        return self.parallel.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        intermediate = cfg.intermediate_size // parallel.tp_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * intermediate)
        self.down_proj = Linear(intermediate, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, parallel)

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
    def __init__(self, cfg: ModelConfig, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        layout = parallel.layout
        self.num_local_kv_heads = layout.local_kv_heads(cfg.num_kv_heads)
        self.layer_range = layout.layer_range(cfg.num_layers, parallel.pp_rank)
        vocab_rows = layout.vocab_rows(cfg.vocab_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(vocab_rows, cfg.hidden_size, parallel) \
            if parallel.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, parallel) for _ in self.layer_range)
        self.norm = self.lm_head = None
        if parallel.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = Linear(cfg.hidden_size, vocab_rows)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        self._decode_weights: tuple[list[torch.Tensor], list[int], int] | None = None  # see _native_decode

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor | None:
        """Returns float32 logits over the whole vocabulary for the rows in `logits_indices` only, on the rank that
        holds them (the last stage's tp rank 0; None on the other ranks)."""
        ps = self.parallel
        if self.embed_tokens is not None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = ps.recv_hidden(input_ids.shape[0], self.cfg.hidden_size,
                                         self.layers[0].input_layernorm.weight.dtype, input_ids.device)
        cos_sin = self.rotary.cos_sin(positions)
        native = self._native_decode(x, residual, cos_sin, kv_caches, meta)
        if native is not None:
            x, residual = native
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(cos_sin, x, residual, kv_cache, meta)
        if self.lm_head is None:
            ps.send_hidden(x, residual)
            return None
        if logits_indices.numel() == 0:  # no row samples this step (every rank knows it): no collective
            return torch.empty((0, self.cfg.vocab_size), device=x.device)
        # in the model dtype: the sampler converts to float32 where it needs to (greedy rows take the argmax as is)
        logits = self.lm_head(self.norm(x[logits_indices], residual[logits_indices]))
        return ps.gather_vocab(logits, self.cfg.vocab_size)

    def set_linear_backend(self, backend: str) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.set_backend(backend)
        self._decode_weights = None

    def _native_decode(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, kv_caches,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All decoder layers in one native call (kernels/decode_layers.cpp: the layers' ops in their order, without
        the ~35 us of Python per layer) when every row of the step is a decode and every product runs on the native
        small GEMM (weights in x's dtype, or int8); else None (the Python layers run). Decoder layers with forward
        hooks (the engine's fault injection, a user's) run in Python, so that their hooks run."""
        if meta.prefills or meta.num_decodes != x.shape[0] or x.device.type != "cpu" or self.parallel.tp_size != 1 \
                or uses_triton(x.device.type) \
                or any(layer._forward_pre_hooks or layer._forward_hooks for layer in self.layers):
            return None
        if self._decode_weights is None:
            self._decode_weights = self._pack_decode_weights()
        weights, widths, max_rows = self._decode_weights
        kernels = native_ops(x)
        if not weights or kernels is None or x.shape[0] > max_rows or weights[1].dtype not in (x.dtype, torch.int8):
            return None
        attn = self.layers[0].self_attn
        return kernels.decode_layers(x, residual, weights, widths, [t for kv in kv_caches for t in kv], *cos_sin,
                                     meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                                     attn.num_heads, attn.num_kv_heads, attn.head_dim, self.cfg.rms_norm_eps,
                                     attn.scale)

    def _pack_decode_weights(self) -> tuple[list[torch.Tensor], list[int], int]:
        """decode_layers' per-layer tensors and widths, and the most rows every product takes natively; no tensors
        when a product does not run on the native small GEMM (another backend, no kernels)."""
        none = torch.empty(0)

        def product(lin: Linear) -> list[torch.Tensor]:  # packed weight, bias, int8 column scales and shifts
            return [lin._small_packed, none if lin.bias is None else lin.bias,
                    none if lin._int8_scale is None else lin._int8_scale,
                    none if lin._int8_shift is None else lin._int8_shift]

        weights: list[torch.Tensor] = []
        widths: list[int] = []
        max_rows = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin._small_packed is None for lin in linears):
                return [], [], 0
            q_norm = none if attn.q_norm is None else attn.q_norm.weight
            k_norm = none if attn.k_norm is None else attn.k_norm.weight
            weights += [layer.input_layernorm.weight, *product(attn.qkv_proj), q_norm, k_norm,
                        *product(attn.o_proj), layer.post_attention_layernorm.weight,
                        *product(mlp.gate_up_proj), *product(mlp.down_proj)]
            widths += [attn.qkv_proj.out_features, attn.o_proj.out_features, mlp.gate_up_proj.out_features]
            max_rows += [lin._native_max_rows for lin in linears]
        return weights, widths, min(max_rows, default=0)

    # ------------------------------------------------------------------ weights
    def load_weights(self, model_dir: Path) -> None:
        """Read safetensors shards (single file or index) into the fused parameters: this rank's layers, and of
        each tensor the slice this rank owns."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in _iter_safetensors(model_dir):
            name = self._local_name(name.removeprefix("model."))
            if name is None:
                continue
            tensor = self._tp_slice(name, tensor)
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
                params[name].data[:tensor.shape[0]].copy_(tensor)  # vocabulary rows: the tail may be padding
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
        cfg, tp = self.cfg, self.parallel.tp_size
        if target == "qkv_proj":
            kv = self.num_local_kv_heads * cfg.head_dim
            return [cfg.num_heads // tp * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size // tp] * 2

    def _local_name(self, name: str) -> str | None:
        """The parameter name on this rank (layers renumbered from the stage's first), None if it lives elsewhere."""
        if name.startswith("layers."):
            index, rest = name.split(".", 2)[1:]
            if int(index) not in self.layer_range:
                return None
            return f"layers.{int(index) - self.layer_range.start}.{rest}"
        if name.startswith("embed_tokens."):
            if self.embed_tokens is None:  # a later stage: only a tied head reads the embedding
                return "lm_head." + name.removeprefix("embed_tokens.") \
                    if self.lm_head is not None and self.cfg.tie_word_embeddings else None
        elif name.startswith("lm_head."):
            if self.lm_head is None or self.cfg.tie_word_embeddings:
                return None  # another stage's, or tied: the embedding is the head
        elif name.startswith("norm.") and self.norm is None:
            return None
        return name

    def _tp_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This tp rank's slice of a checkpoint tensor: rows of the column-parallel projections and of the
        vocabulary, columns of the row-parallel ones; norms are replicated."""
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        if tp == 1:
            return tensor
        cfg, d = self.cfg, self.cfg.head_dim
        module, kind = name.split(".")[-2:]
        if module in ("q_proj", "gate_proj", "up_proj"):
            size = tensor.shape[0] // tp
            return tensor[rank * size:(rank + 1) * size]
        if module in ("k_proj", "v_proj"):
            start = self.parallel.layout.kv_head_start(cfg.num_kv_heads, rank) * d
            return tensor[start:start + self.num_local_kv_heads * d]
        if module in ("o_proj", "down_proj") and kind == "weight":
            size = tensor.shape[1] // tp
            return tensor[:, rank * size:(rank + 1) * size]
        if module in ("embed_tokens", "lm_head"):
            rows = self.parallel.layout.vocab_rows(cfg.vocab_size)
            return tensor[rank * rows:(rank + 1) * rows]
        return tensor


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
