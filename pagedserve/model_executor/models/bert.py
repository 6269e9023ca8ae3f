"""Encoder-only models: BERT and RoBERTa / XLM-RoBERTa (one family: RoBERTa is BERT with its position ids offset
past the padding id and another classification head), as embedding models (the bare *Model checkpoints, pooled as
their sentence-transformers config says, CLS by default) and cross-encoders (*ForSequenceClassification).

Embeddings: word + absolute position + token type (registry's token types, token_types.py), then LayerNorm. Each
layer is post-norm: LayerNorm(x + attention(x)), LayerNorm(x + MLP(x)), with biases everywhere and a GELU MLP.
Attention is bidirectional: the engine runs each prompt whole in one step (registry.is_encoder_only: no chunked
prefill, no prefix caching) as one non-causal prefill span (PrefillSpan.causal False), attended by the backend's
forward_encoder from the step's own K/V (the CPU backend: its native prefill kernel, bidirectional; elsewhere
PyTorch's SDPA per span). No K/V outlives the step, so the model has no KV cache groups: the engine allocates no KV
cache and no request holds a block.

The forward returns the final hidden states of the rows the pooler reads (pooling_runner.py); `pooler_head` turns a
pooled vector into the model's output: itself (an embedding model), or the classification head's logits (BERT:
classifier(tanh(pooler(CLS))); RoBERTa: out_proj(tanh(dense(CLS)))). Single process only (no tensor parallel).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pagedserve.core.kv_cache_groups import KVCacheGroup
from pagedserve.model_executor.attention.backend import AttentionBackend, KVCache
from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.layers.activation import POINTWISE_ACTIVATIONS
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.decoder_lm import iter_safetensors
from pagedserve.model_executor.parallel_state import ParallelState
from pagedserve.model_executor.pooler import num_labels
from pagedserve.model_executor.quantization.base import QuantizationConfig
from pagedserve.model_executor.token_types import split_token_types

# checkpoint module (after encoder.layer.{i}.) -> ours (after layers.{i}.); q/k/v go to one fused projection
_LAYER_NAMES = {"attention.output.dense": "o_proj", "attention.output.LayerNorm": "attn_norm",
                "intermediate.dense": "up_proj", "output.dense": "down_proj", "output.LayerNorm": "mlp_norm"}
_QKV = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, hf: dict, attn_backend: AttentionBackend, quant_config: QuantizationConfig,
                 prefix: str) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, hf.get("layer_norm_eps", 1e-12)
        self.attn_backend = attn_backend
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(h, 3 * h, True, quant_config, f"{prefix}.qkv_proj")
        self.o_proj = Linear(h, h, True, quant_config, f"{prefix}.o_proj")
        self.attn_norm = nn.LayerNorm(h, eps)
        self.up_proj = Linear(h, cfg.intermediate_size, True, quant_config, f"{prefix}.up_proj")
        self.down_proj = Linear(cfg.intermediate_size, h, True, quant_config, f"{prefix}.down_proj")
        self.mlp_norm = nn.LayerNorm(h, eps)
        act = hf.get("hidden_act", "gelu")
        if act not in POINTWISE_ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported for encoder models; supported: "
                             f"{', '.join(POINTWISE_ACTIVATIONS)}.")
        self.act = POINTWISE_ACTIVATIONS[act]  # fused into up_proj's GEMM where it runs on oneDNN

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, h = x.shape
        qkv = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_dim)
        o = self.attn_backend.forward_encoder(qkv[:, 0], qkv[:, 1], qkv[:, 2], meta, self.scale)
        x = self.attn_norm(self.o_proj(o.reshape(t, h)).add_(x))
        return self.mlp_norm(self.down_proj(self.up_proj(x, self.act)).add_(x))


class _Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, hf: dict, position_offset: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(hf.get("max_position_embeddings", 512), h)
        self.token_type_embeddings = nn.Embedding(hf.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, hf.get("layer_norm_eps", 1e-12))
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ids, types = split_token_types(input_ids)
        x = self.word_embeddings(ids) + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(x + self.token_type_embeddings(types))


class BertEmbeddingModel(nn.Module):
    """BertModel: the encoder's final hidden states, pooled by the runner (an embedding model)."""
    has_lm_head = False
    is_pooling_model = True
    reads_token_types = True  # a pair's second text: token type 1 (token_types.py)
    checkpoint_prefix = "bert."  # a *ForSequenceClassification checkpoint's base model (a bare one has none)

    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                 quant_config: QuantizationConfig) -> None:
        super().__init__()
        if parallel.layout.world_size > 1:
            raise ValueError("Encoder models (BERT, RoBERTa) run in one process (tensor_parallel_size 1).")
        hf = json.loads((cfg.model_dir / "config.json").read_text())
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {hf['position_embedding_type']!r} is not supported; "
                             f"encoder models need absolute position embeddings.")
        self.cfg, self.parallel, self.attn_backend = cfg, parallel, attn_backend
        self.num_local_kv_heads = cfg.num_heads
        self.embeddings = _Embeddings(cfg, hf, self.position_offset(hf))
        self.layers = nn.ModuleList(EncoderLayer(cfg, hf, attn_backend, quant_config, f"layers.{i}")
                                    for i in range(cfg.num_layers))
        self.fused_decode = None  # (the native whole-stack decode is the decoders')
        # no KV cache (core/kv_cache_groups.py): every layer attends to the step's own K/V only
        self.kv_cache_groups: list[KVCacheGroup] = []
        self.layer_kv_slots: list[tuple[int, int]] = []

    @staticmethod
    def position_offset(hf: dict) -> int:
        """Added to a token's position before the position embedding lookup (RoBERTa's padding offset)."""
        return 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """The final hidden states [len(logits_indices), hidden] (model dtype) of the rows the pooler reads.
        kv_caches: empty (the runner's, for a model without KV cache groups)."""
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, meta)
        return x[logits_indices]

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled hidden states [N, hidden] float32 -> the model's raw output (an embedding model: themselves)."""
        return pooled

    def process_weights_after_loading(self) -> None:
        self.hidden_dtype = self.embeddings.LayerNorm.weight.dtype
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()

    # ------------------------------------------------------------------ weights
    def load_weights(self, model_dir: Path) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in iter_safetensors(model_dir):
            target = self._param_name(name.removeprefix(self.checkpoint_prefix))
            if target is None:
                continue
            pname, shard = target
            if pname not in params:
                raise ValueError(f"Unexpected weight {name!r} in checkpoint {model_dir}.")
            if shard is None:
                params[pname].data.copy_(tensor)
            else:  # one of q/k/v in the fused projection: its rows
                rows = tensor.shape[0]
                params[pname].data[shard * rows:(shard + 1) * rows].copy_(tensor)
            loaded.add(pname if shard is None else f"{pname}#{shard}")
        expected = {f"{n}#{i}" for n in params if ".qkv_proj." in n for i in range(3)} | \
            {n for n in params if ".qkv_proj." not in n}
        missing = expected - loaded
        if missing:
            raise ValueError(f"Checkpoint {model_dir} lacks weights: {sorted(missing)[:5]} ...")

    def _param_name(self, name: str) -> tuple[str, int | None] | None:
        """Our parameter (and q/k/v shard) for a checkpoint tensor; None for tensors this model does not use."""
        name = name.replace(".gamma", ".weight").replace(".beta", ".bias")  # old TF-converted LayerNorms
        if name.startswith("encoder.layer."):
            index, rest = name.removeprefix("encoder.layer.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if module in _QKV:
                return f"layers.{index}.qkv_proj.{kind}", _QKV[module]
            return f"layers.{index}.{_LAYER_NAMES.get(module, module)}.{kind}", None
        if name.startswith("embeddings.position_ids") or name.startswith("embeddings.token_type_ids"):
            return None  # buffers
        if name.startswith(("pooler.", "lm_head.", "cls.")) and not self.reads(name):
            return None  # heads of other tasks
        return name, None

    def reads(self, name: str) -> bool:
        """Whether this model keeps a head's tensor (a classifier keeps its own)."""
        return False


class RobertaEmbeddingModel(BertEmbeddingModel):
    """RobertaModel / XLMRobertaModel: position ids start past the padding id (Hugging Face's
    create_position_ids_from_input_ids for prompts without padding)."""
    checkpoint_prefix = "roberta."

    @staticmethod
    def position_offset(hf: dict) -> int:
        return hf.get("pad_token_id", 1) + 1


class BertForSequenceClassification(BertEmbeddingModel):
    """A cross-encoder: classifier(tanh(pooler.dense(h_CLS))) (the runner pools CLS)."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                 quant_config: QuantizationConfig) -> None:
        super().__init__(cfg, parallel, attn_backend, quant_config)
        self.pooler = nn.ModuleDict({"dense": nn.Linear(cfg.hidden_size, cfg.hidden_size)})
        self.classifier = nn.Linear(cfg.hidden_size, num_labels(cfg.model_dir, cfg.hf_overrides))

    def reads(self, name: str) -> bool:
        return name.startswith("pooler.")

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """-> float32 logits [N, num_labels]."""
        x = torch.tanh(self.pooler["dense"](pooled.to(self.classifier.weight.dtype)))
        return self.classifier(x).float()


class RobertaForSequenceClassification(RobertaEmbeddingModel):
    """A cross-encoder: out_proj(tanh(dense(h_CLS))) (RobertaClassificationHead; the runner pools CLS)."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                 quant_config: QuantizationConfig) -> None:
        super().__init__(cfg, parallel, attn_backend, quant_config)
        self.classifier = nn.ModuleDict({"dense": nn.Linear(cfg.hidden_size, cfg.hidden_size),
                                         "out_proj": nn.Linear(cfg.hidden_size,
                                                               num_labels(cfg.model_dir, cfg.hf_overrides))})

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        head = self.classifier
        return head["out_proj"](torch.tanh(head["dense"](pooled.to(head["dense"].weight.dtype)))).float()
