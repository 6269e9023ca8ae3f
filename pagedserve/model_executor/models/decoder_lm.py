"""The causal LM shared by the Llama-family architectures: embedding, the decoder layers (layers/decoder.py,
configured by each family's DecoderOptions), final norm and LM head, and safetensors loading. A family is a
subclass in its own file that sets its options (models/llama.py, qwen2.py, qwen3.py; registry.py lists them).

The model sees a flat batch of tokens; everything about KV layout is behind its attention backend.

Tensor parallel: the layers' projections are split as layers/decoder.py says; embedding and LM head are split by
vocabulary rows. Pipeline parallel: a stage builds only its layers (the embedding on the first, the final norm and
LM head on the last) and hands (hidden, residual) to the next. Checkpoint tensors are sliced as they are read, so
no rank ever holds the whole model.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.core.kv_cache_groups import KVCacheGroup, layer_cache_slots, make_kv_cache_groups
from pagedserve.model_executor.attention.backend import AttentionBackend, KVCache
from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.layers.decoder import DecoderLayer, DecoderOptions
from pagedserve.model_executor.layers.embedding import VocabParallelEmbedding
from pagedserve.model_executor.layers.fused_decode import FusedDecodeStack
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.layers.norm import RMSNorm
from pagedserve.model_executor.layers.rotary import RotaryEmbedding
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.parallel_state import ParallelState
from pagedserve.model_executor.quantization.base import QuantizationConfig


class DecoderForCausalLM(nn.Module):
    supports_fused_decode = True  # every layer is the dense DecoderLayer the native decode stack runs
    has_lm_head = True  # pooling models (models/adapters.py) read the final hidden states instead
    norm_class = RMSNorm  # the final norm's (a family with another norm sets its own)
    final_logit_soft_cap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)

    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                 quant_config: QuantizationConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        self.attn_backend = attn_backend
        layout = parallel.layout
        self.num_local_kv_heads = layout.local_kv_heads(cfg.num_kv_heads)
        self.layer_range = layout.layer_range(cfg.num_layers, parallel.pp_rank)
        vocab_rows = layout.vocab_rows(cfg.vocab_size)
        self.set_kv_cache_groups(make_kv_cache_groups([cfg.layer_sliding_window(i) for i in range(cfg.num_layers)]))
        self.rotary = self.make_rotary(cfg)
        self.embed_tokens = VocabParallelEmbedding(vocab_rows, cfg.hidden_size, parallel) \
            if parallel.is_first_stage else None
        options = self.decoder_options(cfg)
        # prefixes name the checkpoint's layers (global indices), for formats that treat some layers differently
        self.layers = nn.ModuleList(self.make_layer(cfg, parallel, attn_backend, quant_config, options, f"layers.{i}")
                                    for i in self.layer_range)
        self.norm = self.lm_head = None
        if parallel.is_last_stage:
            self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, attn_backend)
        if parallel.is_last_stage and self.has_lm_head:
            self.lm_head = Linear(cfg.hidden_size, vocab_rows, False, quant_config, "lm_head")
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        self.fused_decode: FusedDecodeStack | None = None  # built once the weights are processed

    def set_kv_cache_groups(self, groups: list[KVCacheGroup]) -> None:
        """Which block table and KV tensor each layer uses (core/kv_cache_groups.py; a draft model takes one group:
        it writes every layer through the target's group 0 table)."""
        self.kv_cache_groups = groups
        slots = layer_cache_slots(groups)
        self.layer_kv_slots = [slots[i] for i in self.layer_range]  # per local layer: (group, KV tensor)
        if getattr(self, "fused_decode", None) is not None:  # regrouped after loading (a draft model)
            self.fused_decode.layer_groups = [g for g, _ in self.layer_kv_slots]

    def decoder_options(self, cfg: ModelConfig) -> DecoderOptions:
        """What this family sets on the shared decoder layer (a subclass overrides it)."""
        return DecoderOptions(qkv_bias=bool(cfg.attention_bias))

    def make_layer(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                   quant_config: QuantizationConfig, options: DecoderOptions, prefix: str) -> nn.Module:
        """One decoder layer (a family with its own layer overrides it)."""
        return DecoderLayer(cfg, parallel, attn_backend, quant_config, options, prefix)

    def make_rotary(self, cfg: ModelConfig) -> nn.Module:
        """The rotary embedding whose `cos_sin(positions, meta)` every layer reads (a family with partial rotary
        or per-layer bases overrides it)."""
        return build_rotary(cfg, cfg.rope_theta, cfg.rope_scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input embeddings (a family that scales them overrides it)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor | None:
        """Returns float32 logits over the whole vocabulary for the rows in `logits_indices` only, on the rank that
        holds them (the last stage's tp rank 0; None on the other ranks)."""
        out = self.hidden_states(input_ids, positions, kv_caches, meta)
        if out is None:
            return None
        x, residual = out
        if logits_indices.numel() == 0:  # no row samples this step (every rank knows it): no collective
            return torch.empty((0, self.cfg.vocab_size), device=x.device)
        # in the model dtype: the sampler converts to float32 where it needs to (greedy rows take the argmax as is)
        logits = self.lm_head(self.norm(x[logits_indices], residual[logits_indices]))
        if self.final_logit_soft_cap is not None:  # elementwise: each rank caps its vocabulary rows
            logits = torch.tanh(logits / self.final_logit_soft_cap) * self.final_logit_soft_cap
        return self.parallel.gather_vocab(logits, self.cfg.vocab_size)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata, rows: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoder layers over the flat batch: (hidden, residual) before the final norm on the last stage; an
        earlier stage sends them on and returns None. rows (a pooling model's, one stage only): only these rows
        are returned, and the last layer's MLP runs only on them (DecoderLayer's `rows`)."""
        ps = self.parallel
        meta = self.attn_backend.build_metadata(meta)
        if self.embed_tokens is not None:
            x, residual = self.embed(input_ids), None
        else:
            x, residual = ps.recv_hidden(input_ids.shape[0], self.cfg.hidden_size,
                                         self.hidden_dtype, input_ids.device)
        cos_sin = self.rotary.cos_sin(positions, meta)
        fused = self.fused_decode(x, residual, cos_sin, kv_caches, meta) if self.fused_decode is not None else None
        if fused is not None:
            x, residual = fused
            if rows is not None:
                x, residual = x[rows], residual[rows]
        else:
            metas = [meta, *map(self.attn_backend.build_metadata, meta.group_metadata)]
            last = len(self.layers) - 1
            for i, (layer, kv_cache, (group, _)) in enumerate(zip(self.layers, kv_caches, self.layer_kv_slots)):
                if rows is not None and i == last:
                    x, residual = layer(cos_sin, x, residual, kv_cache, metas[group], rows)
                else:
                    x, residual = layer(cos_sin, x, residual, kv_cache, metas[group])
        if self.norm is None:
            ps.send_hidden(x, residual)
            return None
        return x, residual

    def process_weights_after_loading(self) -> None:
        """Once loaded and in the model dtype: each linear's method turns its weight into what its kernels read,
        then the native whole-stack decode is built where it can run."""
        self.hidden_dtype = self.layers[0].input_layernorm.weight.dtype  # the model dtype, what stages hand over
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        if self.supports_fused_decode:
            self.fused_decode = FusedDecodeStack.build(self.layers, self.attn_backend, self.parallel,
                                                       self.cfg.rms_norm_eps, [g for g, _ in self.layer_kv_slots])

    # ------------------------------------------------------------------ weights
    def load_weights(self, model_dir: Path) -> None:
        """Read safetensors shards (single file or index) into the fused parameters: this rank's layers, and of
        each tensor the slice this rank owns."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in self.checkpoint_tensors(model_dir):
            name = self._local_name(name.removeprefix("model."))
            if name is None:
                continue
            tensor = self._tp_slice(name, tensor)
            parts = name.split(".")
            extra = self.load_extra_weight(name, tensor, params)
            if extra is not None:
                loaded.add(extra)
            elif len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                pname = ".".join(parts[:-2] + [target, parts[-1]])
                param = params[pname]
                sizes = self._shard_sizes(target)
                offset = sum(sizes[:shard])
                load_shard(param, tensor, offset, sizes[shard],
                            any(f"{pname}#{i}" in loaded for i in range(len(fused))))
                loaded.add(f"{pname}#{shard}")
            elif name in params and hasattr(params[name], "output_dim"):  # a quantized checkpoint's tensor
                params[name].data.copy_(tensor)  # (a per-tensor scale broadcasts over the output features)
                loaded.add(name)
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

    def checkpoint_tensors(self, model_dir: Path):
        """(name, tensor) of every checkpoint tensor, in the names the loader maps (a family whose checkpoint fuses
        projections differently splits them here)."""
        return iter_safetensors(model_dir)

    def load_extra_weight(self, name: str, tensor: torch.Tensor, params: dict) -> str | None:
        """A family's own checkpoint tensors (MoE experts): copies `tensor` into `params` and returns the key it
        loaded, or None for the shared rules."""
        return None

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


def load_shard(param: torch.Tensor, tensor: torch.Tensor, offset: int, size: int, another_loaded: bool) -> None:
    """One checkpoint projection into its fused parameter: output features [offset, offset + size), rows of a float
    weight. A quantized checkpoint's tensor (quantization/packed.py) says where its output features lie (`output_dim`,
    `packed_factor` of them to an element), or that it has none: then each shard holds the whole tensor, and where
    they must agree (GPTQ's g_idx, one input order for the fused layer) a disagreement is a ValueError."""
    dim = getattr(param, "output_dim", 0)
    if dim is None:
        if another_loaded and getattr(param, "shared_by_shards", False) and not torch.equal(param.data, tensor):
            raise ValueError("The fused projections of a layer (q/k/v or gate/up) have different act-order "
                             "group indices (g_idx); they must share one.")
        param.data.copy_(tensor)
        return
    factor = getattr(param, "packed_factor", 1)
    param.data.narrow(dim, offset // factor, size // factor).copy_(tensor)


def build_rotary(cfg: ModelConfig, theta: float, scaling: dict | None,
                 rotary_dim: int | None = None) -> RotaryEmbedding:
    """A rotary embedding over the model's served positions (past max_position_embeddings where a scaling extends
    the context), the config's reference lengths given."""
    return RotaryEmbedding(cfg.head_dim, max(cfg.max_model_len, cfg.max_position_embeddings), theta, scaling,
                           rotary_dim=rotary_dim, max_position_embeddings=cfg.max_position_embeddings,
                           max_model_len=cfg.max_model_len)


def iter_safetensors(model_dir: Path):
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
