"""Encoder models through a real `pagedserve serve`: a BERT embedding model with the official openai client against
sentence-transformers, and a BERT cross-encoder's /rerank and /v1/score (the pair's token types made by the server
from the tokenizer) against transformers' sequence-classification forward."""
from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F

from server_helpers import ServerProcess
from tiny_pooling_models import build_encoder_tokenizer, make_tiny_encoder_checkpoint

ARGS = ("--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-batched-tokens", "32")
TEXTS = ["the cat reads a long letter before noon", "a small dog", "the scheduler frees the memory blocks " * 6]


@pytest.fixture(scope="module")
def bert_embedder(tmp_path_factory):
    path = make_tiny_encoder_checkpoint("bert", tmp_path_factory.mktemp("bert"),
                                        tokenizer=build_encoder_tokenizer("bert"), pooling="mean")
    srv = ServerProcess(path, ("--served-model-name", "tiny-bert", *ARGS))
    yield srv, path
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def bert_reranker(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    tokenizer = build_encoder_tokenizer("bert")
    path = make_tiny_encoder_checkpoint("bert", tmp_path_factory.mktemp("bert-rerank"), tokenizer=tokenizer,
                                        num_labels=1)
    srv = ServerProcess(path, ("--served-model-name", "tiny-bert-rerank", *ARGS))
    yield srv, tokenizer, AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    assert srv.stop() == 0, srv.log()[-3000:]


def test_bert_embeddings_with_the_openai_client(bert_embedder):
    import openai
    from sentence_transformers import SentenceTransformer

    srv, path = bert_embedder
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True).float()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    resp = client.embeddings.create(model="tiny-bert", input=TEXTS)  # base64 on the wire, decoded by the client
    got = torch.tensor([d.embedding for d in resp.data])
    cos = F.cosine_similarity(got, want, dim=-1)
    assert bool((cos >= 0.9999).all()), cos
    assert "Traceback" not in srv.log()


def test_bert_rerank_and_score_match_hf(bert_reranker):
    srv, tokenizer, hf = bert_reranker
    query, docs = "the cat reads", ["a small dog", "the cat reads a long letter", "every token", "the blue book"]
    with torch.no_grad():
        want = [torch.sigmoid(hf(**tokenizer(text=query, text_pair=d, return_tensors="pt")).logits[0, 0]).item()
                for d in docs]
    body = httpx.post(srv.url + "/rerank", json={"query": query, "documents": docs}, timeout=60).json()
    assert [x["index"] for x in body["results"]] == sorted(range(len(docs)), key=lambda i: want[i], reverse=True)
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
    score = httpx.post(srv.url + "/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
    assert "Traceback" not in srv.log()
