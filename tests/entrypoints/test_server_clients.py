"""What new client code sends, over HTTP with the official openai package: vLLM's server beam search
(use_beam_search / length_penalty through extra_body) against the offline LLM.beam_search, the Responses API
(client.responses.create: plain, streamed, function tools) and vLLM's `vllm:` metric names on /metrics."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_helpers import API_KEY, ServerProcess, auth_headers, metric_value

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
    # streamed: the same beams, one chunk each once the search ends (as vLLM streams beam search)
    chunks = list(client.completions.create(model=model_name(client), prompt=PROMPT, n=3, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, extra_body={
                                                "use_beam_search": True, "length_penalty": length_penalty,
                                                "ignore_eos": True}))
    assert [(c.index, c.text) for ch in chunks for c in ch.choices] == [(c.index, c.text) for c in out.choices]
    assert chunks[-1].usage.completion_tokens == 18
    text = httpx.get(str(client.base_url.join("/metrics")), timeout=60).text  # every beam's KV blocks back in the pool
    assert metric_value(text, "pagedserve:num_requests_running") == 0
    assert metric_value(text, "pagedserve:kv_cache_usage_perc") == pytest.approx(0.0, abs=1e-6)


def test_chat_beam_search_equals_offline(server, client, offline):
    messages = [{"role": "user", "content": "hello there"}]
    out = client.chat.completions.create(model=model_name(client), messages=messages, n=2, max_tokens=5,
                                         extra_body={"use_beam_search": True})
    prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=auth_headers(), timeout=60).json()["tokens"]
    ref = offline.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=5))[0]
    assert [c.message.content for c in out.choices] == [s.text for s in ref.sequences]
    assert [c.finish_reason for c in out.choices] == [s.finish_reason for s in ref.sequences]
    chunks = list(client.chat.completions.create(model=model_name(client), messages=messages, n=2, max_tokens=5,
                                                 stream=True, extra_body={"use_beam_search": True}))
    assert [(c.index, c.delta.content) for ch in chunks for c in ch.choices] == \
        [(c.index, c.message.content) for c in out.choices]


@pytest.mark.parametrize("extra, param", [({"echo": True}, "echo"), ({"logprobs": 2}, "logprobs"),
                                          ({"temperature": 0.7}, "temperature"), ({"n": 11}, "n"),
                                          ({"max_tokens": 300}, "max_tokens"),
                                          ({"length_penalty": "x"}, "length_penalty")])
def test_beam_search_bad_values_are_400_naming_the_field(server, extra, param):
    body = {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth_headers(), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---------------------------------------------------------------------------------------- /v1/responses
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}


def test_responses_plain_equals_chat(client):
    model = model_name(client)
    resp = client.responses.create(model=model, input="hello there", instructions="be brief", max_output_tokens=6,
                                   temperature=0)
    chat = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    assert resp.object == "response" and resp.id.startswith("resp_")
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    # a message list (content parts) renders the same prompt
    listed = client.responses.create(model=model, max_output_tokens=6, temperature=0, input=[
        {"role": "system", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]}])
    assert listed.output_text == resp.output_text and listed.usage.input_tokens == resp.usage.input_tokens


def test_responses_stream_events(client):
    model = model_name(client)
    plain = client.responses.create(model=model, input="tell me", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model=model, input="tell me", max_output_tokens=8, temperature=0,
                                          stream=True))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if plain.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == done.text == plain.output_text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    # the SDK's own accumulator (responses.stream) follows the events (it raises on one out of place) to the same end
    with client.responses.stream(model=model, input="tell me", max_output_tokens=8, temperature=0) as stream:
        *_, last = stream
    assert last.response.output_text == plain.output_text


def test_responses_function_tools(client):
    model = model_name(client)
    common = dict(model=model, input="weather in Paris?", tools=[WEATHER], temperature=0, max_output_tokens=60,
                  tool_choice={"type": "function", "name": "get_weather"})
    resp = client.responses.create(**common)
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
    events = list(client.responses.create(stream=True, **common))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == done.arguments == call.arguments
    assert events[-1].response.output[0].type == "function_call"
    # the call and its result sent back: the model answers in a message
    follow = client.responses.create(model=model, max_output_tokens=4, temperature=0, tools=[WEATHER], input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], tool_choice="none")
    assert follow.output[0].type == "message"


@pytest.mark.parametrize("extra, param", [({"previous_response_id": "resp_x"}, "previous_response_id"),
                                          ({"max_output_tokens": 0}, "max_output_tokens"),
                                          ({"temperature": 3}, "temperature"),
                                          ({"tool_choice": "required"}, "tool_choice"),
                                          ({"input": "x " * 400}, "input"),  # past max_model_len
                                          ({"text": {"format": {"type": "json_schema", "name": "s",
                                                                "schema": {"type": "nonsense"}}}}, "text.format")])
def test_responses_bad_values_are_400_naming_the_field(server, extra, param):
    """Named as the client sent them, not as the chat request they became (input, not messages)."""
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", **extra}, headers=auth_headers(), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------------------------------------------ vllm: metrics
VLLM_SERIES = [  # (vLLM's name, pagedserve's)
    ("vllm:num_requests_running", "pagedserve:num_requests_running"),
    ("vllm:num_requests_waiting", "pagedserve:num_requests_waiting"),
    ("vllm:kv_cache_usage_perc", "pagedserve:kv_cache_usage_perc"),
    ("vllm:gpu_cache_usage_perc", "pagedserve:kv_cache_usage_perc"),
    ("vllm:prompt_tokens_total", "pagedserve:prompt_tokens_total"),
    ("vllm:generation_tokens_total", "pagedserve:generation_tokens_total"),
    ("vllm:prefix_cache_queries_total", "pagedserve:prefix_cache_queries_total"),
    ("vllm:time_to_first_token_seconds_count", "pagedserve:time_to_first_token_seconds_count"),
    ("vllm:time_to_first_token_seconds_sum", "pagedserve:time_to_first_token_seconds_sum"),
    ("vllm:time_per_output_token_seconds_count", "pagedserve:inter_token_latency_seconds_count"),
    ("vllm:inter_token_latency_seconds_sum", "pagedserve:inter_token_latency_seconds_sum"),
    ("vllm:e2e_request_latency_seconds_count", "pagedserve:e2e_request_latency_seconds_count"),
    ("vllm:request_prompt_tokens_sum", "pagedserve:request_prompt_tokens_sum"),
    ("vllm:iteration_tokens_total_count", "pagedserve:iteration_tokens_total_count"),
]


def test_vllm_metric_names_are_the_same_series(server, client):
    model = model_name(client)
    before = httpx.get(server.url + "/metrics", timeout=60).text
    # a prompt no other test sent: no prefix-cache hit, so its every token is a prefill token computed
    out = client.completions.create(model=model, prompt=PROMPT[::-1] + [9], max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics", timeout=60).text  # no API key: as Prometheus scrapes it
    for vllm_name, own in VLLM_SERIES:
        assert metric_value(text, vllm_name, model_name=model) == metric_value(text, own, model_name=model), vllm_name
    # counted once: the request's tokens moved both names by exactly its usage
    for name, count in (("vllm:prompt_tokens_total", out.usage.prompt_tokens),
                        ("vllm:generation_tokens_total", out.usage.completion_tokens)):
        assert metric_value(text, name, model_name=model) - metric_value(before, name, model_name=model) == count
    success = metric_value(text, "vllm:request_success_total", model_name=model, finished_reason="length")
    assert success == metric_value(text, "pagedserve:request_success_total", model_name=model,
                                   finished_reason="length") > 0
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert "# TYPE vllm:request_success_total counter" in text
    assert "vllm:engine_step_failures" not in text  # pagedserve's own additions keep their one name
