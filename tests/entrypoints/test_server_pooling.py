"""The pooling routes through a real `pagedserve serve`: /v1/embeddings with the official openai client (float and
base64, strings and token arrays) against sentence-transformers, /pooling, /rerank and /v1/score of a cross-encoder
against transformers' sequence-classification forward, and the 400s: `dimensions` on a model that is not
Matryoshka, generation on a pooling model, embeddings on a generative one."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from server_helpers import start_servers
from tiny_pooling_models import build_tiny_classifier, make_tiny_embedding_checkpoint

ARGS = ("--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-batched-tokens", "32")
TEXTS = ["the cat reads a long letter before noon", "a small dog", "the scheduler frees the memory blocks " * 6]


@pytest.fixture(scope="module")
def pooling_servers(tmp_path_factory, tiny_tokenizer):
    """The embedding model's server and the cross-encoder's, started together; both must exit cleanly."""
    embed_path = make_tiny_embedding_checkpoint("qwen3", tmp_path_factory.mktemp("embed"), tokenizer=tiny_tokenizer)
    hf = build_tiny_classifier("qwen3", tokenizer=tiny_tokenizer, num_labels=1)
    rerank_path = tmp_path_factory.mktemp("rerank")
    hf.save_pretrained(rerank_path, safe_serialization=True)
    tiny_tokenizer.save_pretrained(rerank_path)
    servers = start_servers((embed_path, ("--runner", "pooling", "--served-model-name", "tiny-embed", *ARGS)),
                            (rerank_path, ("--served-model-name", "tiny-rerank", *ARGS)))
    yield {"embed": (servers[0], embed_path), "rerank": (servers[1], rerank_path, hf)}
    for srv in servers:
        assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def embedder(pooling_servers):
    return pooling_servers["embed"]


@pytest.fixture(scope="module")
def reranker(pooling_servers):
    return pooling_servers["rerank"]


def test_embeddings_with_the_openai_client(embedder):
    import openai
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    srv, path = embedder
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True).float()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    # the client asks for base64 and decodes it itself unless told otherwise
    for fmt in (None, "float"):
        kwargs = {"encoding_format": fmt} if fmt else {}
        resp = client.embeddings.create(model="tiny-embed", input=TEXTS, **kwargs)
        assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == "tiny-embed"
        got = torch.tensor([d.embedding for d in resp.data])
        assert bool((F.cosine_similarity(got, want, dim=-1) >= 0.9999).all())
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert resp.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    raw = client.embeddings.create(model="tiny-embed", input=TEXTS[1], encoding_format="base64")
    decoded = torch.from_numpy(np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4").copy())
    assert torch.allclose(decoded, got[1], atol=1e-6)
    ids = client.embeddings.create(model="tiny-embed", input=[tokenizer.encode(t) for t in TEXTS[:2]],
                                   encoding_format="float")
    assert torch.allclose(torch.tensor([d.embedding for d in ids.data]), got[:2], atol=1e-5)
    with pytest.raises(openai.BadRequestError) as err:  # not a Matryoshka model
        client.embeddings.create(model="tiny-embed", input="x", dimensions=16)
    assert err.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as err:  # a pooling model does not generate
        client.completions.create(model="tiny-embed", prompt="x", max_tokens=2)
    assert err.value.body["param"] == "model"


def test_pooling_route_and_refusals(embedder):
    srv, _ = embedder
    r = httpx.post(srv.url + "/pooling", json={"input": TEXTS[:2]}, timeout=60)
    assert r.status_code == 200, r.text
    emb = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[:2]}, timeout=60).json()
    # the same vectors up to float rounding: two calls may batch and chunk the rows differently (on CPUs without the
    # native small GEMM the products then take other summation orders)
    torch.testing.assert_close(torch.tensor([d["data"] for d in r.json()["data"]]),
                               torch.tensor([d["embedding"] for d in emb["data"]]), rtol=1e-5, atol=1e-6)
    r = httpx.post(srv.url + "/rerank", json={"query": "a", "documents": ["b"]}, timeout=60)
    assert r.status_code == 200  # an embedding model ranks by cosine similarity
    r = httpx.post(srv.url + "/v1/embeddings", json={"input": "x" * 3000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    for body in ({"input": []}, {"input": [[]]}, {"input": ["a", ""]}, {"input": "a", "encoding_format": "hex"}):
        assert httpx.post(srv.url + "/v1/embeddings", json=body, timeout=60).status_code == 400, body
    assert "/v1/embeddings" in httpx.get(srv.url + "/openapi.json", timeout=30).json()["paths"]
    assert "Traceback" not in srv.log()


def test_rerank_and_score_match_hf(reranker):
    srv, _, hf = reranker
    query, docs = "the cat reads", ["a small dog", "the cat reads a long letter", "every token", "the blue book"]
    r = httpx.post(srv.url + "/rerank", json={"model": "tiny-rerank", "query": query, "documents": docs,
                                              "top_n": 3}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reranker[1]))
    with torch.no_grad():
        want = [torch.sigmoid(hf(torch.tensor([tokenizer(text=query, text_pair=d)["input_ids"]])).logits[0, 0]).item()
                for d in docs]
    order = sorted(range(len(docs)), key=lambda i: want[i], reverse=True)[:3]
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        assert x["document"]["text"] == docs[x["index"]]
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
    for route in ("/v1/rerank", "/v2/rerank"):
        again = httpx.post(srv.url + route, json={"query": query, "documents": docs}, timeout=60).json()
        assert len(again["results"]) == len(docs)
    score = httpx.post(srv.url + "/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
    r = httpx.post(srv.url + "/v1/embeddings", json={"input": "x"}, timeout=60)  # a classifier does not embed
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.post(srv.url + "/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"


def test_pooling_routes_on_a_generative_model(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=60,
                   headers={"Authorization": "Bearer test-key-123"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    schema = httpx.get(server.url + "/openapi.json", timeout=30,
                       headers={"Authorization": "Bearer test-key-123"}).json()
    assert "/v1/embeddings" not in schema["paths"]  # documented where the model serves it
