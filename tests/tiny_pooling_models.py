"""Tiny random pooling checkpoints built with transformers' own classes (the weights of tiny_models.py's init):

    make_tiny_embedding_checkpoint("qwen3", out, pooling="lasttoken")  # a causal LM + sentence-transformers modules
    make_tiny_embedding_checkpoint("qwen2", out, save_base=True)       # the bare Qwen2Model (architectures *Model)
    make_tiny_classifier_checkpoint("qwen2", out, num_labels=3)        # Qwen2ForSequenceClassification

The embedding checkpoints carry `modules.json` and `1_Pooling/config.json` (and `2_Normalize` when normalised), so
that sentence-transformers loads the same model the engine serves.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from tiny_models import _arch_spec, _config_class, _init_weights, build_tiny_model

ST_POOLING_KEYS = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
                   "cls": "pooling_mode_cls_token"}


def make_tiny_embedding_checkpoint(arch: str, out_dir, *, tokenizer, pooling: str = "lasttoken",
                                   normalize: bool = True, matryoshka_dimensions: list[int] | None = None,
                                   save_base: bool = False, seed: int = 7, **overrides) -> Path:
    """overrides: config fields (a larger shape for benchmarks)."""
    out = Path(out_dir)
    model = build_tiny_model(arch, tokenizer=tokenizer, seed=seed, **overrides)
    (model.model if save_base else model).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if matryoshka_dimensions:
        cfg = json.loads((out / "config.json").read_text())
        cfg["matryoshka_dimensions"] = matryoshka_dimensions
        (out / "config.json").write_text(json.dumps(cfg))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir()
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": model.config.hidden_size, ST_POOLING_KEYS[pooling]: True}))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return out


def build_tiny_classifier(arch: str, *, tokenizer, num_labels: int, seed: int = 11) -> torch.nn.Module:
    """transformers' <Family>ForSequenceClassification, float32, eval, tiny_models' init (score included)."""
    causal_name, kwargs = _arch_spec(arch)
    config = _config_class(causal_name)(**kwargs, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                        num_labels=num_labels)
    torch.manual_seed(seed)
    model = getattr(transformers, causal_name.replace("ForCausalLM", "ForSequenceClassification"))(config)
    model = model.to(torch.float32)
    _init_weights(model, seed)
    return model.eval()


def make_tiny_classifier_checkpoint(arch: str, out_dir, *, tokenizer, num_labels: int) -> Path:
    out = Path(out_dir)
    build_tiny_classifier(arch, tokenizer=tokenizer, num_labels=num_labels).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
