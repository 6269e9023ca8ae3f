"""Decoder families as pooling models (vLLM's as_embedding_model / as_seq_cls_model): the same layers and weights,
no LM head; the forward returns the final (normed) hidden states of the rows the pooler reads
(model_executor/pooling_runner.py), and `pooler_head` turns pooled vectors into the model's output: the vector
itself (an embedding model: Qwen3-Embedding, e5-mistral style) or a classification head's logits (transformers'
*ForSequenceClassification: a bias-free `score` linear on the last token's hidden state).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from pagedserve.model_executor.attention.backend import AttentionBackend, KVCache
from pagedserve.model_executor.attention.metadata import AttentionMetadata
from pagedserve.model_executor.layers.decoder import DecoderLayer
from pagedserve.model_executor.model_config import ModelConfig
from pagedserve.model_executor.models.decoder_lm import DecoderForCausalLM
from pagedserve.model_executor.parallel_state import ParallelState
from pagedserve.model_executor.pooler import classifier_from_token, num_labels
from pagedserve.model_executor.quantization.base import QuantizationConfig


class _PoolingDecoder:
    """Mixed in before a DecoderForCausalLM family."""
    has_lm_head = False
    is_pooling_model = True
    reads_token_types = False  # (a decoder has no token type embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor | None:
        """The final hidden states [len(logits_indices), hidden] (model dtype) of the rows the pooler reads; where
        it reads fewer rows than the step has (last token, CLS), the last layer's MLP runs on those rows only."""
        prune = logits_indices.numel() < input_ids.numel() and isinstance(self.layers[-1], DecoderLayer)
        out = self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices if prune else None)
        if out is None:
            return None
        x, residual = out
        return self.norm(x, residual) if prune else self.norm(x[logits_indices], residual[logits_indices])

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled hidden states [N, hidden] float32 -> the model's raw output (an embedding model: themselves)."""
        return pooled


class _SequenceClassifier(_PoolingDecoder):
    def __init__(self, cfg: ModelConfig, parallel: ParallelState, attn_backend: AttentionBackend,
                 quant_config: QuantizationConfig) -> None:
        super().__init__(cfg, parallel, attn_backend, quant_config)
        # replicated on every rank (a few labels): the checkpoint's `score.weight` [num_labels, hidden]
        self.score = nn.Linear(cfg.hidden_size, num_labels(cfg.model_dir, cfg.hf_overrides), bias=False)

    def pooler_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """-> float32 logits [N, num_labels]."""
        return self.score(pooled.to(self.score.weight.dtype)).float()

    def checkpoint_tensors(self, model_dir: Path):
        """A causal LM checkpoint served as a classifier (classifier_from_token, e.g. a Qwen3-Reranker): `score` is
        its LM head's rows of those tokens, or for a two-way softmax the row of yes minus the row of no (the
        sigmoid of their logits' difference is the softmax's yes probability), as vLLM converts it."""
        from_tokens = classifier_from_token(self.cfg.model_dir, self.cfg.hf_overrides)
        if from_tokens is None:
            yield from super().checkpoint_tensors(model_dir)
            return
        tokens, two_way = from_tokens
        ids = _token_ids(self.cfg.tokenizer, tokens)
        head = "embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        for name, tensor in super().checkpoint_tensors(model_dir):
            if name.removeprefix("model.") == head:
                rows = tensor[ids].float()
                yield "score.weight", rows[1:] - rows[:1] if two_way else rows
                if head == "lm_head.weight":
                    continue
            yield name, tensor


def _token_ids(tokenizer_path: str, tokens: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    bad = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if bad:
        raise ValueError(f"classifier_from_token: {bad} are not tokens of the model's vocabulary.")
    return ids


@lru_cache(maxsize=None)
def as_embedding_model(cls: type[DecoderForCausalLM]) -> type[nn.Module]:
    name = cls.__name__.removesuffix("ForCausalLM") + "ForEmbedding"
    return type(name, (_PoolingDecoder, cls), {})


@lru_cache(maxsize=None)
def as_seq_cls_model(cls: type[DecoderForCausalLM]) -> type[nn.Module]:
    name = cls.__name__.removesuffix("ForCausalLM") + "ForSequenceClassification"
    return type(name, (_SequenceClassifier, cls), {})
