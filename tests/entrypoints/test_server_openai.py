"""The OpenAI-compatible server end to end, through the official `openai` client.

A real `pagedserve serve <tiny llama>` subprocess (tests/server_helpers.py), greedy decoding so
streamed and non-streamed results can be compared exactly.
"""
from __future__ import annotations

import httpx
import openai
import pytest

from server_helpers import API_KEY, auth_headers, metric_value

pytestmark = pytest.mark.server

PROMPT = "the cat reads a long letter"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat reads"}]



@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def model(client):
    return client.models.list().data[0].id


def tokenize(server, **body) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, headers=auth_headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def greedy(client, model, prompt=PROMPT, max_tokens=12, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def test_models_health_version(server, client, model):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    card = models[0].model_dump()
    assert card["id"] == model and card["max_model_len"] == 512
    assert card["demo_model"] is False  # the extra field saying whether this is the embedded demo model
    assert client.models.retrieve(model).id == model
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    r = httpx.get(server.url + "/version", headers=auth_headers(), timeout=60)
    assert r.status_code == 200 and r.json()["version"]


def test_completion_basic_usage(server, client, model):
    out = greedy(client, model)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == model
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len(tokenize(server, prompt=PROMPT))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_stream_equals_greedy_and_usage(client, model):
    full = greedy(client, model, max_tokens=16)
    chunks = list(greedy(client, model, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_without_usage(client, model):
    chunks = list(greedy(client, model, max_tokens=4, stream=True))
    assert chunks and all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_chat_basic_and_stream(server, client, model):
    kw = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenize(server, messages=MESSAGES))
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]


def test_chat_max_completion_tokens(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_n2_completions_and_chat(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert set(texts) == {0, 1} and all(texts.values())
    assert chunks[-1].usage.completion_tokens == 12
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, n=2,
                                          extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1] and chat.usage.completion_tokens == 10


def test_completion_logprobs(client, model):
    out = greedy(client, model, max_tokens=8, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset[0] == 0
    for i in range(7):
        assert lp.text_offset[i + 1] - lp.text_offset[i] == len(lp.tokens[i])
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0.0 and 3 <= len(top) <= 4
        assert tok in top and top[tok] == pytest.approx(tlp)
        assert tlp == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the sampled token is the argmax
    # streaming gives the same logprobs
    chunks = list(greedy(client, model, max_tokens=8, logprobs=3, stream=True))
    toks = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offs = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert toks == lp.tokens and offs == lp.text_offset


def test_chat_logprobs(client, model):
    kw = dict(model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token  # greedy
    stream = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e.token for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == [c.token for c in content]
    plain = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


def test_list_of_prompts_and_token_ids(server, client, model):
    prompts = [PROMPT, "a small dog"]
    singles = [greedy(client, model, prompt=p, max_tokens=6).choices[0].text for p in prompts]
    batch = greedy(client, model, prompt=prompts, max_tokens=6)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == singles
    ids = [tokenize(server, prompt=p) for p in prompts]
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
    one = greedy(client, model, prompt=ids[0], max_tokens=6)
    assert one.choices[0].text == singles[0] and one.usage.prompt_tokens == len(ids[0])
    many = greedy(client, model, prompt=ids, max_tokens=6)
    assert [c.text for c in many.choices] == singles
    # n=2 x 2 prompts: choices indexed prompt_idx * n + i
    nn = greedy(client, model, prompt=prompts, max_tokens=4, n=2)
    assert [c.index for c in nn.choices] == [0, 1, 2, 3] and nn.usage.completion_tokens == 16
    assert nn.usage.prompt_tokens == sum(len(i) for i in ids)  # counted once per prompt, not per sample


def test_echo(client, model):
    plain = greedy(client, model, max_tokens=5)
    echoed = greedy(client, model, max_tokens=5, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    chunks = list(greedy(client, model, max_tokens=5, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain.choices[0].text


def test_stop_string(client, model):
    text = greedy(client, model, max_tokens=16).choices[0].text
    stop = text[3:6]
    assert stop.strip(), text
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


def test_tokenize_detokenize_round_trip(server):
    body = {"prompt": PROMPT, "add_special_tokens": False}
    r = httpx.post(server.url + "/tokenize", json=body, headers=auth_headers(), timeout=60)
    data = r.json()
    assert r.status_code == 200 and data["count"] == len(data["tokens"]) and data["max_model_len"] == 512
    r2 = httpx.post(server.url + "/detokenize", json={"tokens": data["tokens"]}, headers=auth_headers(), timeout=60)
    assert r2.status_code == 200 and r2.json() == {"prompt": PROMPT}
    with_bos = tokenize(server, prompt=PROMPT)
    assert len(with_bos) == data["count"] + 1  # add_special_tokens defaults to true (the tiny tokenizer adds <s>)
    chat = tokenize(server, messages=MESSAGES)
    assert chat and chat[0] == with_bos[0]


def test_metrics_names_and_counters_move(server, client, model):
    def scrape() -> str:
        r = httpx.get(server.url + "/metrics", timeout=60)  # open without the API key
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return r.text

    before = scrape()
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "request_time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "iteration_tokens_total_bucket",
                 "request_prompt_tokens_bucket", "request_generation_tokens_bucket"]:
        assert f"pagedserve:{name}{{" in before, name
    assert f'model_name="{model}"' in before

    def values(text):
        return {
            "gen": metric_value(text, "pagedserve:generation_tokens_total"),
            "prompt": metric_value(text, "pagedserve:prompt_tokens_total"),
            "length": metric_value(text, "pagedserve:request_success_total", finished_reason="length"),
            "e2e": metric_value(text, "pagedserve:e2e_request_latency_seconds_count"),
            "ttft": metric_value(text, "pagedserve:time_to_first_token_seconds_count"),
            "queries": metric_value(text, "pagedserve:prefix_cache_queries_total"),
        }

    v0 = values(before)
    out = greedy(client, model, max_tokens=7)
    greedy(client, model, max_tokens=7)  # same prompt again: prefix-cache hits
    v1 = values(scrape())
    assert v1["gen"] - v0["gen"] == 14
    assert v1["prompt"] - v0["prompt"] >= out.usage.prompt_tokens
    assert v1["length"] - v0["length"] == 2 and v1["e2e"] - v0["e2e"] == 2 and v1["ttft"] - v0["ttft"] == 2
    assert v1["queries"] > v0["queries"]
    text = scrape()
    assert metric_value(text, "pagedserve:num_requests_running") == 0
    assert metric_value(text, "pagedserve:prefix_cache_hits_total") > 0


def test_openai_client_sees_typed_errors(server, client, model):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=5)
    assert exc.value.status_code == 400 and exc.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=MESSAGES, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}])
    assert exc.value.param == "tool_choice"  # "auto" (the default with tools) needs --enable-auto-tool-choice
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert exc.value.code == "model_not_found"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
