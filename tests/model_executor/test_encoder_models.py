"""Encoder-only pooling models (BERT, XLM-RoBERTa; models/bert.py) end to end: embeddings against
sentence-transformers on tiny random checkpoints built with transformers' own classes (CLS and mean pooling, cosine
>= 0.9999 per vector in float32), cross-encoder scores against transformers' sequence-classification forward (BERT's
pair token types included), on the CPU backend (native kernels where they apply) and the PyTorch reference.
Every prompt runs whole in one step (no chunked prefill, no prefix caching: attention is bidirectional), however
small the configured token budget, and keeps no KV cache: the engine allocates none, and no request holds a block."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.entrypoints.llm import LLM
from pagedserve.errors import InvalidRequestError
from pagedserve.pooling_params import PoolingParams
from tiny_models import tiny_corpus
from tiny_pooling_models import build_encoder_tokenizer, build_tiny_encoder, make_tiny_encoder_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ("bert", "xlm-roberta")


@pytest.fixture(scope="module")
def texts():
    corpus = tiny_corpus()
    # "hi" is a prompt of 3 tokens: it would run as decode rows (causal) in a decoder's batch
    return [corpus[0][:40], " ".join(corpus[1:5]), "hi", corpus[5][:120], " ".join(corpus[6:8])]


def _engine(path, **kwargs) -> LLM:
    kwargs = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=512) | kwargs
    return LLM(str(path), **kwargs)


def _assert_no_kv_cache(llm: LLM) -> None:
    """An encoder's K/V never outlive its step: no KV tensor, an empty pool (num_kv_blocks is ignored)."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_config.num_blocks == 0 and engine.kv_cache_manager.num_blocks == 0
    assert engine.runner.kv_caches == [] and engine.runner.model.kv_cache_groups == []


def _record_block_tables(llm: LLM, monkeypatch) -> list[list[int]]:
    """Every scheduled request's block table from now on (an encoder's must all be empty)."""
    scheduler, tables = llm.llm_engine.scheduler, []
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        tables.extend(item.block_ids for item in out.scheduled)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording)
    return tables


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("arch, pooling, normalize", [("bert", "cls", True), ("bert", "mean", False),
                                                      ("xlm-roberta", "cls", False), ("xlm-roberta", "mean", True)])
def test_embeddings_match_sentence_transformers(tmp_path, texts, arch, pooling, normalize, backend, monkeypatch):
    from sentence_transformers import SentenceTransformer

    path = make_tiny_encoder_checkpoint(arch, tmp_path / arch, tokenizer=build_encoder_tokenizer(arch),
                                        pooling=pooling, normalize=normalize)
    want = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True, batch_size=3).float()
    llm = _engine(path, attention_backend=backend)  # a bare *Model: the pooling runner from the architecture
    config = llm.llm_engine.config
    assert config.pooler.pooling_type == pooling.upper()
    assert not config.scheduler.enable_chunked_prefill and not config.cache.enable_prefix_caching
    tables = _record_block_tables(llm, monkeypatch)
    outs = llm.embed(texts, use_tqdm=False)
    assert len(tables) == len(texts) and not any(tables)
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = F.cosine_similarity(got, want, dim=-1)
    assert bool((cos >= 0.9999).all()), cos
    if not normalize:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    _assert_no_kv_cache(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_cross_encoder_scores_match_hf(tmp_path, texts, arch):
    """LLM.score of a *ForSequenceClassification with one label: sigmoid of HF's logit on the tokenizer's pair
    (BERT's second text with token type 1); classify with several labels: HF's logits and their softmax."""
    tokenizer = build_encoder_tokenizer(arch)
    hf = build_tiny_encoder(arch, tokenizer=tokenizer, num_labels=1)
    path = tmp_path / arch
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    llm = _engine(path)
    assert llm.llm_engine.config.pooler.task == "classify" and llm.llm_engine.config.pooler.pooling_type == "CLS"
    query, docs = texts[0], texts[1:]
    outs = llm.score(query, docs, use_tqdm=False)
    for doc, out in zip(docs, outs):
        encoded = tokenizer(text=query, text_pair=doc, return_tensors="pt")
        assert out.prompt_token_ids == encoded["input_ids"][0].tolist()
        with torch.no_grad():
            logit = hf(**encoded).logits[0, 0]
        assert out.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
    if arch == "bert":  # the token types matter: the same ids all of type 0 score differently
        encoded = tokenizer(text=query, text_pair=docs[0], return_tensors="pt")
        with torch.no_grad():
            untyped = torch.sigmoid(hf(input_ids=encoded["input_ids"]).logits[0, 0]).item()
        assert abs(untyped - outs[0].outputs.score) > 1e-3
    # truncated from the left: the kept tokens keep their types
    kept = llm.score(query, docs[0], truncate_prompt_tokens=12, use_tqdm=False)[0]
    encoded = tokenizer(text=query, text_pair=docs[0], return_tensors="pt")
    with torch.no_grad():
        logit = hf(**{k: v[:, -12:] for k, v in encoded.items()}).logits[0, 0]
    assert kept.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
    _assert_no_kv_cache(llm)


def test_classifier_with_labels_matches_hf(tmp_path, texts):
    tokenizer = build_encoder_tokenizer("xlm-roberta")
    hf = build_tiny_encoder("xlm-roberta", tokenizer=tokenizer, num_labels=3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    llm = _engine(tmp_path)
    raw = llm.classify(texts, use_tqdm=False, pooling_params=PoolingParams(activation=False))
    for text, out in zip(texts, raw):
        with torch.no_grad():
            want = hf(**tokenizer(text, return_tensors="pt")).logits[0]
        assert torch.allclose(torch.tensor(out.outputs.probs), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="'score' task"):
        llm.score(texts[0], texts[1], use_tqdm=False)


def test_encoder_limits(tmp_path, texts):
    """XLM-R's positions start past its padding id: max_model_len is max_position_embeddings - pad - 1; an
    encoder does not generate, and runs in one process."""
    tokenizer = build_encoder_tokenizer("xlm-roberta")
    path = make_tiny_encoder_checkpoint("xlm-roberta", tmp_path / "x", tokenizer=tokenizer)
    assert _engine(path, max_model_len=None).llm_engine.config.model.max_model_len == 512
    with pytest.raises(ValueError, match="max_model_len"):
        _engine(path, max_model_len=513)
    with pytest.raises(ValueError, match="pooling model"):
        _engine(path, runner="generate")
    llm = _engine(path)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.embed([list(range(3, 600))], use_tqdm=False)
    assert len(llm.embed([list(range(3, 515))], use_tqdm=False)[0].outputs.embedding) == 64  # 512 tokens
    _assert_no_kv_cache(llm)
