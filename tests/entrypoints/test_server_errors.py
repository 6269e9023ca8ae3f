"""Every error case of the OpenAI server, with raw httpx: status code and the OpenAI body shape
{"error": {"message", "type", "param", "code"}}.  Bad input is never a 500; then 300 mixed bad
requests must leave the server healthy and still giving the same greedy text."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from server_helpers import API_KEY, auth_headers

pytestmark = pytest.mark.server

C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "the cat reads"}]
LONG_TEXT = " ".join(["the cat reads a long letter"] * 120)  # ~700+ tokens > max_model_len 512



@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers=auth_headers(), timeout=30) as c:
        yield c


def check_error(r: httpx.Response, status: int, param: str | None = "<any>", contains: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "<any>":
        assert err["param"] == param, err
    if contains is not None:
        assert contains.lower() in err["message"].lower(), err
    return err


# (path, json body, expected status, expected param or "<any>", substring of the message)
CASES = [
    # missing / empty
    (C, {}, 400, "prompt", "prompt"),
    (C, {"prompt": ""}, 400, "prompt", "empty"),
    (C, {"prompt": []}, 400, "prompt", "empty"),
    (C, {"prompt": [[]]}, 400, "prompt", "empty"),
    (C, {"prompt": ["ok", ""]}, 400, "prompt[1]", "empty"),
    (CH, {}, 400, "messages", "messages"),
    (CH, {"messages": []}, 400, "messages", "at least one"),
    # wrong types
    (C, {"prompt": 5}, 400, "prompt", None),
    (C, {"prompt": [1, "a"]}, 400, "prompt", None),
    (C, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", None),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    (C, {"prompt": "x", "n": 1.5}, 400, "n", None),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    (C, {"prompt": "x", "stop": 5}, 400, "stop", None),
    (C, {"prompt": "x", "echo": 1}, 400, "echo", None),
    (C, {"prompt": "x", "stream_options": {"include_usage": "yes"}, "stream": True}, 400,
     "stream_options.include_usage", None),
    (CH, {"messages": "hi"}, 400, "messages", None),
    (CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    (CH, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    (CH, {"messages": [{"content": "x"}]}, 400, "messages[0].role", None),
    (CH, {"messages": MSG, "logprobs": 3}, 400, "logprobs", None),
    # out of range
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", None),
    (C, {"prompt": "x", "temperature": -0.1}, 400, "temperature", None),
    (C, {"prompt": "x", "temperature": 2.5}, 400, "temperature", None),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    (C, {"prompt": "x", "n": 0}, 400, "n", None),
    (C, {"prompt": "x", "n": 129}, 400, "n", None),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    (C, {"prompt": "x", "logprobs": -1}, 400, "logprobs", None),
    (C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None),
    (C, {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty", None),
    (C, {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    (C, {"prompt": "x", "min_p": 1.5}, 400, "min_p", None),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    (C, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", None),
    (C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids[0]", None),
    (C, {"prompt": "x", "seed": 2**70}, 400, "seed", None),
    (CH, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", None),
    (CH, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    (CH, {"messages": MSG, "temperature": 3}, 400, "temperature", None),
    (CH, {"messages": MSG, "top_p": 0}, 400, "top_p", None),
    (CH, {"messages": MSG, "n": 200}, 400, "n", None),
    (CH, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    # cross-field and engine-side (ValueError -> 400)
    (C, {"prompt": "x", "min_tokens": 10, "max_tokens": 3}, 400, "min_tokens", "min_tokens"),
    (C, {"prompt": "x", "priority": 5}, 400, "priority", "priority"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "echo"),
    (C, {"prompt": [5, 6, 100000]}, 400, "prompt", "token ids"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CH, {"messages": MSG, "max_tokens": 3, "max_completion_tokens": 4}, 400, "max_tokens", None),
    (CH, {"messages": MSG, "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message", None),
    # too long for max_model_len (512): the message says the limit
    (C, {"prompt": LONG_TEXT}, 400, "prompt", "512"),
    (C, {"prompt": "the cat reads", "max_tokens": 510}, 400, "max_tokens", "512"),
    (C, {"prompt": list(range(3, 600))}, 400, "prompt", "512"),
    (C, {"prompt": ["x", LONG_TEXT]}, 400, "prompt[1]", "512"),
    (CH, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "messages", "512"),
    (CH, {"messages": MSG, "max_tokens": 600}, 400, "max_tokens", "512"),
    # unknown / unimplemented fields are rejected by name, never ignored
    (C, {"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix"),
    (C, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    (C, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias", "must be in [0,"),
    (C, {"prompt": "x", "allowed_token_ids": [99999999]}, 400, "allowed_token_ids", None),
    (C, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids", None),
    (C, {"prompt": "x", "bad_words": [""]}, 400, "bad_words", None),
    (C, {"prompt": "x", "best_of": 1, "n": 2}, 400, "best_of", "must be >= n"),
    (C, {"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of", "cannot be streamed"),
    (C, {"prompt": "x", "foo": 1}, 400, "foo", "foo"),
    (CH, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "enable-auto-tool-choice"),
    (CH, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400,
     "tools[0].function.name", None),
    (CH, {"messages": MSG, "tool_choice": "auto"}, 400, "tool_choice", "tool_choice"),
    (CH, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format.type", "response_format"),
    (CH, {"messages": MSG, "guided_regex": "a(b"}, 400, "guided_regex", "regex"),
    (CH, {"messages": MSG, "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice", "one output constraint"),
    (CH, {"messages": MSG, "functions": []}, 400, "functions", "functions"),
    (CH, {"messages": MSG, "logit_bias": {"-1": 5}}, 400, "logit_bias", None),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     400, "<any>", None),
    # unknown model
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    (CH, {"messages": MSG, "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", None),
    # tokenize / detokenize
    ("/tokenize", {}, 400, "<any>", "exactly one"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "<any>", "exactly one"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", None),
    ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens", None),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", None),
    ("/detokenize", {}, 400, "tokens", None),
]


@pytest.mark.parametrize("path,body,status,param,contains", CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}-{','.join(c[1]) or 'empty'}" for i, c in enumerate(CASES)])
def test_bad_request(http, path, body, status, param, contains):
    check_error(http.post(path, json=body), status, param, contains)


def test_bad_request_also_when_streaming(http):
    # Errors found before generation starts are real HTTP errors, not a 200 stream with an error inside.
    check_error(http.post(C, json={"prompt": "x", "temperature": 9, "stream": True}), 400, "temperature")
    check_error(http.post(C, json={"prompt": "x", "max_tokens": 600, "stream": True}), 400, "max_tokens", "512")
    check_error(http.post(CH, json={"messages": MSG, "model": "nope", "stream": True}), 404, "model")
    check_error(http.post(C, json={"prompt": "x", "priority": 1, "stream": True}), 400, "priority")


def test_invalid_json_and_non_object_bodies(http):
    h = {"Content-Type": "application/json"}
    check_error(http.post(C, content=b"{bad json", headers=h), 400, None, "json")
    check_error(http.post(C, content=b'{"prompt": "x",}', headers=h), 400, None, "json")
    check_error(http.post(C, content=b"[1, 2]", headers=h), 400, None)
    check_error(http.post(C, content=b'"just a string"', headers=h), 400, None)
    check_error(http.post(C, content=b"", headers=h), 400, None)
    check_error(http.post(CH, content=b"\xff\xfe", headers=h), 400, None)
    check_error(http.post(C, content=b"prompt=x", headers={"Content-Type": "application/x-www-form-urlencoded"}),
                400, None)


def test_unknown_route_and_method(http):
    check_error(http.get("/v1/nope"), 404, None)
    check_error(http.get(C), 405, None)
    check_error(http.get("/v1/models/gpt-4"), 404, "model")


def test_api_key(server):
    url = server.url
    body = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        for method, path, kw in (("POST", C, {"json": body}), ("POST", CH, {"json": {"messages": MSG}}),
                                 ("GET", "/v1/models", {}), ("POST", "/tokenize", {"json": {"prompt": "x"}}),
                                 ("POST", "/detokenize", {"json": {"tokens": [5]}}), ("GET", "/version", {})):
            r = httpx.request(method, url + path, headers=headers, **kw)
            err = check_error(r, 401, None)
            assert err["code"] == "invalid_api_key"
    # /health and /metrics stay open
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    assert httpx.get(url + "/metrics", timeout=60).status_code == 200
    assert httpx.post(url + C, json=body, headers=auth_headers(), timeout=60).status_code == 200


def _random_bad_request(rng: random.Random) -> tuple[str, str, bytes | None, dict, dict]:
    """(method, path, raw content or None, json body, headers) of a request that must fail with a 4xx."""
    kind = rng.random()
    headers = auth_headers()
    if kind < 0.6:
        path, body, _, _, _ = rng.choice(CASES)
        body = dict(body)
        if rng.random() < 0.5 and path in (C, CH) and "stream" not in body and "stream_options" not in body:
            body["stream"] = True
        return "POST", path, None, body, headers
    if kind < 0.7:
        junk = rng.choice([b"{", b"}{", b"null", b"[]", b"{\"prompt\": }", bytes(rng.randrange(256) for _ in range(20))])
        return "POST", rng.choice([C, CH, "/tokenize"]), junk, {}, {**headers, "Content-Type": "application/json"}
    if kind < 0.8:
        return "POST", C, None, {"prompt": "x"}, rng.choice([{}, {"Authorization": "Bearer nope"}])
    if kind < 0.9:  # a random field with a value that is wrong for it
        invalid = {"max_tokens": ["str", -1, 0, {}, True], "temperature": ["str", -1, 3, {}],
                   "top_p": [0, 2, "str"], "n": [0, 1000, "x", 1.5], "logprobs": [50, -2, "x"],
                   "stop": [5, {}, [""], [1]], "seed": ["x", 1.5, 2**80], "top_k": [-5, "x"],
                   "min_p": [2, -1], "stream": ["x", 3], "echo": ["x", 3], "zzz": [1, "a", None]}
        field = rng.choice(sorted(invalid))
        return "POST", C, None, {"prompt": "the cat", field: rng.choice(invalid[field])}, headers
    return "GET", rng.choice(["/v1/missing", "/v1/models/other", "/nothing"]), None, {}, headers


def test_300_mixed_bad_requests_leave_server_healthy(server):
    reference_body = {"prompt": "the cat reads a long letter", "max_tokens": 12, "temperature": 0,
                      "ignore_eos": True}
    before = httpx.post(server.url + C, json=reference_body, headers=auth_headers(), timeout=60).json()
    rng = random.Random(1234)
    requests = [_random_bad_request(rng) for _ in range(300)]

    async def run() -> list[tuple[int, str]]:
        sem = asyncio.Semaphore(24)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def one(req):
                method, path, content, body, headers = req
                async with sem:
                    if content is not None:
                        r = await client.request(method, path, content=content, headers=headers)
                    else:
                        r = await client.request(method, path, json=body if method == "POST" else None,
                                                 headers=headers)
                    return r.status_code, r.text
            return await asyncio.gather(*(one(r) for r in requests))

    results = asyncio.run(run())
    for (status, text), req in zip(results, requests):
        assert 400 <= status < 500, (status, text, req)
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    after = httpx.post(server.url + C, json=reference_body, headers=auth_headers(), timeout=60).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert after["usage"] == before["usage"]
    log = server.log()
    assert "Traceback" not in log and "Internal server error" not in log, log[-3000:]
