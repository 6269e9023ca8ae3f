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
    _write_sentence_transformers_modules(out, model.config.hidden_size, pooling, normalize)
    return out


def _write_sentence_transformers_modules(out: Path, hidden_size: int, pooling: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir()
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden_size, ST_POOLING_KEYS[pooling]: True}))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


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


# ------------------------------------------------------------------------------------------ encoders (BERT, XLM-R)
ENCODER_ARCHS = {"bert": "Bert", "xlm-roberta": "XLMRoberta"}


def build_encoder_tokenizer(arch: str):
    """The tiny BPE vocabulary with the family's templates: BERT's `<s> A </s> B </s>` with token types 0 / 1 (as
    [CLS] / [SEP]), XLM-R's `<s> A </s></s> B </s>` without token types (its tokenizer returns none)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from tiny_models import _train_tokenizer_json

    backend = Tokenizer.from_str(_train_tokenizer_json(768))
    special = [("<s>", backend.token_to_id("<s>")), ("</s>", backend.token_to_id("</s>"))]
    if arch == "bert":
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s>:0 $A:0 </s>:0 $B:1 </s>:1", special_tokens=special)
        names = ["input_ids", "token_type_ids", "attention_mask"]
    else:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=special)
        names = ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                                   sep_token="</s>", pad_token="<pad>", model_max_length=512,
                                   clean_up_tokenization_spaces=False, model_input_names=names)


def build_tiny_encoder(arch: str, *, tokenizer, num_labels: int | None = None, seed: int = 5,
                       **overrides) -> torch.nn.Module:
    """transformers' <Family>Model (num_labels None) or <Family>ForSequenceClassification, float32, eval: 2 layers,
    hidden 64, 4 heads unless overridden (config fields: a larger shape for benchmarks); weights drawn wide (std
    1/sqrt(fan_in), LayerNorms and biases random) so that attention is far from uniform and a causal mask, a wrong
    position or token type would show."""
    family = ENCODER_ARCHS[arch]
    pad = tokenizer.pad_token_id
    fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128) | overrides
    config = getattr(transformers, f"{family}Config")(
        vocab_size=len(tokenizer), max_position_embeddings=512 + (pad + 1 if arch == "xlm-roberta" else 0),
        type_vocab_size=2 if arch == "bert" else 1, pad_token_id=pad, num_labels=num_labels or 2, **fields)
    cls = getattr(transformers, f"{family}Model" if num_labels is None else f"{family}ForSequenceClassification")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 * (2.0 if "query" in name else 1.0))
    return model.eval()


def make_tiny_encoder_checkpoint(arch: str, out_dir, *, tokenizer, pooling: str | None = "cls",
                                 normalize: bool = True, num_labels: int | None = None, **overrides) -> Path:
    """An embedding model with sentence-transformers' modules (pooling given), or a cross-encoder (num_labels)."""
    out = Path(out_dir)
    model = build_tiny_encoder(arch, tokenizer=tokenizer, num_labels=num_labels, **overrides)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if num_labels is None:
        _write_sentence_transformers_modules(out, model.config.hidden_size, pooling, normalize)
    return out
