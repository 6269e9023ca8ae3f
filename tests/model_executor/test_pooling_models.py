"""Pooling models end to end (LLM.embed / classify / score) against the references: sentence-transformers on the same
checkpoint for embeddings (cosine >= 0.9999 per vector, float32), transformers' *ForSequenceClassification forward for
classification and cross-encoder scores. Prompts are longer than the token budget, so every prompt is pooled from
several prefill chunks; every KV block is back in the pool afterwards."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.entrypoints.llm import LLM
from pagedserve.errors import InvalidRequestError
from pagedserve.pooling_params import PoolingParams
from tiny_models import tiny_corpus
from tiny_pooling_models import build_tiny_classifier, make_tiny_embedding_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 16  # tokens per step: the longer prompts below run in 2-5 chunks


@pytest.fixture(scope="module")
def texts():
    corpus = tiny_corpus()
    return [corpus[0][:40], " ".join(corpus[1:5]), corpus[5][:120], "hello", " ".join(corpus[6:8]), corpus[8][:70]]


def _engine(path, **kwargs) -> LLM:
    kwargs = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=BUDGET, max_model_len=512) | kwargs
    return LLM(str(path), **kwargs)


def _assert_pool_is_free(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.block_pool.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks


def _assert_cosine(got, want) -> None:
    got, want = torch.tensor(got, dtype=torch.float32), torch.as_tensor(want, dtype=torch.float32)
    cos = F.cosine_similarity(got, want, dim=-1)
    assert bool((cos >= 0.9999).all()), cos


@pytest.mark.parametrize("arch, pooling, normalize, save_base", [
    ("qwen3", "lasttoken", True, False),  # Qwen3-Embedding style: a causal LM, last token, normalised
    ("llama", "mean", False, False),
    ("qwen2", "cls", True, True),  # a bare Qwen2Model checkpoint: the pooling runner chosen from the architecture
])
def test_embeddings_match_sentence_transformers(tmp_path, tiny_tokenizer, texts, arch, pooling, normalize, save_base):
    from sentence_transformers import SentenceTransformer

    path = make_tiny_embedding_checkpoint(arch, tmp_path / arch, tokenizer=tiny_tokenizer, pooling=pooling,
                                          normalize=normalize, save_base=save_base)
    want = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True, batch_size=4)
    llm = _engine(path, **({} if save_base else {"runner": "pooling"}))
    assert llm.llm_engine.config.pooler.pooling_type == {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}[pooling]
    assert max(len(tiny_tokenizer.encode(t)) for t in texts) > 2 * BUDGET  # pooled over several chunks
    outs = llm.embed(texts, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    _assert_cosine([o.outputs.embedding for o in outs], want)
    if not normalize:  # the raw vectors too, not only their direction
        assert torch.allclose(torch.tensor([o.outputs.embedding for o in outs]), want.float(), atol=1e-4, rtol=1e-4)
    _assert_pool_is_free(llm)


def test_last_token_pooling_of_short_prompts(tmp_path, tiny_tokenizer):
    """Prompts of a few tokens run as decode rows (the native whole-stack decode where it builds): the pooled rows
    are picked from its output as from the layers' (whose last MLP runs on the pooled rows only)."""
    from sentence_transformers import SentenceTransformer

    path = make_tiny_embedding_checkpoint("qwen3", tmp_path / "q", tokenizer=tiny_tokenizer)
    texts = ["hi", "a b", "the cat"]
    want = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True)
    llm = _engine(path, runner="pooling")
    _assert_cosine([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)], want)
    _assert_pool_is_free(llm)


@pytest.mark.slow  # ~21 s in the fast tier at load ~5 (its longest test): the slow tier
def test_chunked_and_preempted_prefills_pool_the_whole_prompt(tmp_path, tiny_tokenizer, texts):
    """MEAN pooling sums every chunk; a KV pool too small for all prompts at once preempts some mid-prefill, and
    their partial sums start again with them."""
    from sentence_transformers import SentenceTransformer

    path = make_tiny_embedding_checkpoint("llama", tmp_path / "m", tokenizer=tiny_tokenizer, pooling="mean")
    want = SentenceTransformer(str(path), device="cpu").encode(texts * 3, convert_to_tensor=True)
    llm = _engine(path, runner="pooling", num_kv_blocks=12, block_size=8, max_num_batched_tokens=32,
                  long_prefill_token_threshold=8,
                  enable_prefix_caching=False)
    outs = llm.embed(texts * 3, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_cosine([o.outputs.embedding for o in outs], want)
    _assert_pool_is_free(llm)


def test_matryoshka_dimensions(tmp_path, tiny_tokenizer, texts):
    path = make_tiny_embedding_checkpoint("qwen3", tmp_path / "mrl", tokenizer=tiny_tokenizer,
                                          matryoshka_dimensions=[16, 32, 64])
    llm = _engine(path, runner="pooling")
    full = torch.tensor([o.outputs.embedding for o in llm.embed(texts[:3], use_tqdm=False)])
    short = llm.embed(texts[:3], use_tqdm=False, pooling_params=PoolingParams(dimensions=16))
    assert all(len(o.outputs.embedding) == 16 for o in short)
    assert torch.allclose(torch.tensor([o.outputs.embedding for o in short]), F.normalize(full[:, :16], dim=-1),
                          atol=1e-5)
    with pytest.raises(InvalidRequestError, match="dimensions must be one of") as err:
        llm.embed(texts[:1], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    assert err.value.param == "dimensions"


def test_errors_name_the_parameter(tmp_path, tiny_tokenizer, tiny_model_dir, texts):
    path = make_tiny_embedding_checkpoint("qwen3", tmp_path / "e", tokenizer=tiny_tokenizer)
    llm = _engine(path, runner="pooling")
    with pytest.raises(InvalidRequestError, match="matryoshka") as err:  # not a Matryoshka model
        llm.embed(texts[:1], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    assert err.value.param == "dimensions"
    with pytest.raises(InvalidRequestError, match="pooling model") as err:
        llm.generate(texts[:1], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="'classify' task") as err:
        llm.classify(texts[:1], use_tqdm=False)
    assert err.value.param == "task"
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.embed([list(range(3, 600))], use_tqdm=False)
    with pytest.raises(ValueError, match="task 'classify' is not supported"):
        _engine(path, task="classify")
    _assert_pool_is_free(llm)
    generator = _engine(tiny_model_dir("qwen3"), num_kv_blocks=16)
    assert generator.llm_engine.config.pooler is None
    with pytest.raises(InvalidRequestError, match="generative model"):
        generator.embed(texts[:1], use_tqdm=False)


def _hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("arch, num_labels", [("qwen2", 3), ("llama", 2)])
def test_classification_matches_hf(tmp_path, tiny_tokenizer, texts, arch, num_labels):
    hf = build_tiny_classifier(arch, tokenizer=tiny_tokenizer, num_labels=num_labels)
    path = tmp_path / arch
    hf.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer.save_pretrained(path)
    llm = _engine(path)  # *ForSequenceClassification: the pooling runner, classify, from the architecture
    assert llm.llm_engine.config.pooler.task == "classify"
    outs = llm.classify(texts, use_tqdm=False)
    raw = llm.classify(texts, use_tqdm=False, pooling_params=PoolingParams(activation=False))
    tokenizer = llm.get_tokenizer()  # the checkpoint's, as HF would load it
    for text, out, logits in zip(texts, outs, raw):
        assert out.prompt_token_ids == tokenizer.encode(text)
        want = _hf_logits(hf, out.prompt_token_ids)
        assert torch.allclose(torch.tensor(logits.outputs.probs), want, atol=1e-4, rtol=1e-4)
        assert torch.allclose(torch.tensor(out.outputs.probs), torch.softmax(want, -1), atol=1e-5)
        assert out.outputs.num_classes == num_labels
    with pytest.raises(InvalidRequestError, match="'score' task"):  # a cross-encoder has one label
        llm.score(texts[0], texts[1:3], use_tqdm=False)
    _assert_pool_is_free(llm)


def test_cross_encoder_scores_match_hf(tmp_path, tiny_tokenizer, texts):
    hf = build_tiny_classifier("qwen3", tokenizer=tiny_tokenizer, num_labels=1)
    path = tmp_path / "reranker"
    hf.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer.save_pretrained(path)
    llm = _engine(path, task="score")
    query, docs = texts[0], texts[1:]
    outs = llm.score(query, docs, use_tqdm=False)
    assert len(outs) == len(docs)
    tokenizer = llm.get_tokenizer()
    for doc, out in zip(docs, outs):
        ids = tokenizer(text=query, text_pair=doc)["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(torch.sigmoid(_hf_logits(hf, ids))[0].item(), abs=1e-5)
    pairwise = llm.score(docs[:2], docs[2:4], use_tqdm=False)
    assert [o.prompt_token_ids for o in pairwise] == [tokenizer(text=a, text_pair=b)["input_ids"]
                                                      for a, b in zip(docs[:2], docs[2:4])]
    with pytest.raises(InvalidRequestError, match="give one text_1"):
        llm.score(docs[:2], docs[:3], use_tqdm=False)
    _assert_pool_is_free(llm)


def test_embedding_model_scores_by_cosine_similarity(tmp_path, tiny_tokenizer, texts):
    path = make_tiny_embedding_checkpoint("qwen3", tmp_path / "e", tokenizer=tiny_tokenizer)
    llm = _engine(path, runner="pooling")
    emb = torch.tensor([o.outputs.embedding for o in llm.embed(texts[:3], use_tqdm=False)])
    scores = [o.outputs.score for o in llm.score(texts[0], texts[1:3], use_tqdm=False)]
    assert scores == pytest.approx(F.cosine_similarity(emb[:1], emb[1:3], dim=-1).tolist(), abs=1e-5)
    _assert_pool_is_free(llm)


def test_aborted_and_truncated_pooling_requests(tmp_path, tiny_tokenizer, texts):
    """An abort mid-prefill drops the request's partial pooled state and frees its blocks; truncate_prompt_tokens
    keeps the last tokens."""
    path = make_tiny_embedding_checkpoint("llama", tmp_path / "m", tokenizer=tiny_tokenizer, pooling="mean")
    llm = _engine(path, runner="pooling")
    engine = llm.llm_engine
    engine.add_request("long", texts[1], PoolingParams())
    engine.step()  # its first chunk only: the prompt is longer than the budget
    runner = engine.runner.pooler
    assert "long" in runner.partial and engine.kv_cache_manager.block_pool.num_used_blocks > 0
    engine.abort_request("long")
    engine.add_request("short", texts[3], PoolingParams())
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["short"] and not runner.partial
    _assert_pool_is_free(llm)
    full = llm.embed([texts[1]], use_tqdm=False)[0]
    tail = llm.embed([texts[1]], truncate_prompt_tokens=8, use_tqdm=False)[0]
    assert tail.prompt_token_ids == full.prompt_token_ids[-8:]
    alone = llm.embed([full.prompt_token_ids[-8:]], use_tqdm=False)[0]
    assert torch.allclose(torch.tensor(tail.outputs.embedding), torch.tensor(alone.outputs.embedding), atol=1e-6)
