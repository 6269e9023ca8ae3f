"""What new client code sends, over HTTP with the official openai package: vLLM's server beam search
(use_beam_search / length_penalty through extra_body) against the offline LLM.beam_search, the Responses API
(client.responses.create: plain, streamed, function tools) and vLLM's `vllm:` metric names on /metrics."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import API_KEY, ServerProcess, auth_headers

from pagedserve import LLM, BeamSearchParams

PROMPT = [0, 201, 54, 422, 85, 268, 339, 69, 86, 321, 17, 250, 33, 411, 96, 120, 57, 300, 12, 77, 5]
ARGS = ("--dtype", "float32", "--num-kv-blocks", "160", "--max-model-len", "256", "--api-key", API_KEY,
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def server(model_dir):
    server = ServerProcess(model_dir, ARGS)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), num_threads=1, dtype="float32", num_kv_blocks=160, max_model_len=256)


def model_name(client) -> str:
    return client.models.list().data[0].id


# ------------------------------------------------------------------------------------------ beam search
@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_completions_beam_search_equals_offline(client, offline, length_penalty):
    out = client.completions.create(model=model_name(client), prompt=PROMPT, n=3, max_tokens=6,
                                    extra_body={"use_beam_search": True, "length_penalty": length_penalty,
                                                "ignore_eos": True})
    ref = offline.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(
        beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=length_penalty))[0]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [s.text for s in ref.sequences]
    assert [c.finish_reason for c in out.choices] == ["length"] * 3
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 18


def test_chat_beam_search_equals_offline(server, client, offline):
    messages = [{"role": "user", "content": "hello there"}]
    out = client.chat.completions.create(model=model_name(client), messages=messages, n=2, max_tokens=5,
                                         extra_body={"use_beam_search": True})
    prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=auth_headers()).json()["tokens"]
    ref = offline.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=5))[0]
    assert [c.message.content for c in out.choices] == [s.text for s in ref.sequences]
    assert [c.finish_reason for c in out.choices] == [s.finish_reason for s in ref.sequences]


@pytest.mark.parametrize("extra, param", [({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"),
                                          ({"temperature": 0.7}, "temperature"), ({"n": 11}, "n"),
                                          ({"max_tokens": 300}, "max_tokens"),
                                          ({"length_penalty": "x"}, "length_penalty")])
def test_beam_search_bad_values_are_400_naming_the_field(server, extra, param):
    body = {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth_headers(), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
