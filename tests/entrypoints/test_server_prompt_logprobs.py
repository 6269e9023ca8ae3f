"""Over HTTP with the official openai client: echo (with and without logprobs, streaming, max_tokens 0 as
lm-evaluation-harness sends), vLLM's prompt_logprobs field, logit_bias / allowed_token_ids / bad_words, against HF
transformers in float32 on a chunked-prefill server."""
from __future__ import annotations

import httpx
import pytest
import torch
from hf_reference import load_hf_model
from openai import OpenAI
from server_helpers import API_KEY, FP32_CHUNKED_ARGS, auth_headers, get_server

PROMPT = [0, 201, 54, 422, 85, 268, 339, 69, 86, 321, 17, 250, 33, 411, 96, 120, 57, 300, 12, 77, 5]


@pytest.fixture(scope="module")
def server(model_dir):
    # chunks of 8 tokens: the prompt's logprobs come from three prefill chunks (a server shared with test_lm_eval)
    return get_server(model_dir, FP32_CHUNKED_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    with torch.no_grad():
        logits = load_hf_model(model_dir)(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row j scores token j + 1


def model_name(client):
    return client.models.list().data[0].id


def test_echo_logprobs_max_tokens_0(client, hf_logprobs, model_dir):
    out = client.completions.create(model=model_name(client), prompt=PROMPT, echo=True, logprobs=1, max_tokens=0,
                                    temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j, token in enumerate(PROMPT[1:], start=0):
        assert lp.token_logprobs[j + 1] == pytest.approx(float(hf_logprobs[j, token]), abs=1e-4)
        assert len(lp.top_logprobs[j + 1]) in (1, 2)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert choice.text == "".join(lp.tokens)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(PROMPT)


def test_echo_with_generation_and_streaming(client, hf_logprobs):
    model = model_name(client)
    full = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 3
    assert lp.token_logprobs[1] == pytest.approx(float(hf_logprobs[0, PROMPT[1]]), abs=1e-4)
    # the first generated token is HF's argmax after the prompt
    assert lp.token_logprobs[len(PROMPT)] == pytest.approx(float(hf_logprobs[-1].max()), abs=1e-4)
    tokens, token_lps, text = [], [], ""
    for chunk in client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                token_lps += c.logprobs.token_logprobs
    assert tokens == lp.tokens and text == full.choices[0].text
    assert token_lps[0] is None and token_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    plain = client.completions.create(model=model, prompt="the cat", echo=True, max_tokens=2, temperature=0)
    assert plain.choices[0].text.startswith("the cat") and plain.choices[0].logprobs is None


def test_vllm_prompt_logprobs_field(client, hf_logprobs):
    out = client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    pl = out.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(PROMPT)
    for j, token in enumerate(PROMPT[1:]):
        entry = pl[j + 1][str(token)]
        assert entry["logprob"] == pytest.approx(float(hf_logprobs[j, token]), abs=1e-4)
        assert entry["rank"] == int((hf_logprobs[j] > hf_logprobs[j, token]).sum()) + 1


def test_logit_bias_over_http(client, hf_logprobs):
    """+100 forces HF's least likely token, -100 on HF's argmax gives its second best (the reported logprobs are
    the raw model's, as in vLLM), on completions and chat; allowed_token_ids restricts to one token."""
    model = model_name(client)
    last = hf_logprobs[-1]
    unlikely, top, second = int(last.argmin()), int(last.argmax()), int(last.topk(2).indices[1])

    def first_logprob(**kwargs) -> float:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                        **kwargs)
        return out.choices[0].logprobs.token_logprobs[0]

    assert first_logprob(logit_bias={str(unlikely): 100}) == pytest.approx(float(last[unlikely]), abs=1e-4)
    assert first_logprob(logit_bias={str(top): -100}) == pytest.approx(float(last[second]), abs=1e-4)
    assert first_logprob(extra_body={"allowed_token_ids": [second]}) == pytest.approx(float(last[second]), abs=1e-4)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                          logprobs=True, top_logprobs=1)
    chosen = chat.choices[0].logprobs.content[0]
    banned = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                            logprobs=True, top_logprobs=1,
                                            logit_bias={str(chat_token_id(client, chosen.token)): -100})
    assert banned.choices[0].logprobs.content[0].token != chosen.token


def chat_token_id(client, token: str) -> int:
    r = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize", headers=auth_headers(),
                   json={"prompt": token, "add_special_tokens": False}, timeout=60).json()
    assert len(r["tokens"]) == 1
    return r["tokens"][0]


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"768": 1}}, "logit_bias"),
    ({"allowed_token_ids": [768]}, "allowed_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"bad_words": [" "]}, "bad_words"),
])
def test_bad_values_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", headers=auth_headers(),
                   json={"prompt": PROMPT, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_prompt_logprobs(server, client):
    body = {"model": model_name(client), "messages": [{"role": "user", "content": "the cat reads"}],
            "max_tokens": 1, "prompt_logprobs": 1}
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth_headers(), json=body, timeout=60).json()
    pl = r["prompt_logprobs"]
    assert pl[0] is None and len(pl) == r["usage"]["prompt_tokens"] and all(len(e) in (1, 2) for e in pl[1:])
    # streamed: the same values, once, in the first chunk after the prefill (an extension: vLLM refuses it)
    chunks = list(client.chat.completions.create(stream=True, **{k: v for k, v in body.items() if k != "prompt_logprobs"},
                                                 extra_body={"prompt_logprobs": 1}))
    carrying = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert carrying == [pl]


def test_best_of_returns_the_highest_cumulative_logprobs(client):
    """best_of=4, n=2 with a seed draws the same 4 samples as n=4 (sample i uses seed + i); the 2 returned are the
    4's best by cumulative logprob, best first."""
    model = model_name(client)
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, logprobs=0)
    all4 = client.completions.create(n=4, **kwargs).choices
    ranked = sorted(all4, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 12


@pytest.mark.parametrize("body, param", [
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 600}, "truncate_prompt_tokens"),
])
def test_best_of_and_truncation_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", headers=auth_headers(), json={"prompt": PROMPT, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_truncate_prompt_tokens(client):
    model = model_name(client)
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 7})
    tail = client.completions.create(model=model, prompt=PROMPT[-7:], max_tokens=4, temperature=0)
    assert cut.choices[0].text == tail.choices[0].text and cut.usage.prompt_tokens == 7
