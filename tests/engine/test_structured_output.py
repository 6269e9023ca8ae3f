"""Structured output with the real engine (llguidance masks in the vectorized sampler): JSON schema, regex,
choice and grammar constraints, mixed with free requests in one batch; n > 1, seeds, preemption; invalid
constraints refused naming the field; the OpenAI / vLLM request fields over HTTP with the official client."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jsonschema
import openai
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 999}},
          "required": ["ok", "n"], "additionalProperties": False}
GRAMMAR = 'start: "def " NAME "(" NAME? "):"\nNAME: /[a-z_]{1,8}/'


@pytest.fixture(scope="module", params=[True, False], ids=["masks-overlapped", "checked-first"])
def llm(model_dir, request):
    """Both ways of running the masks (engine/structured_output.py): beside the forward on a worker thread, and
    sampling first with only rejected rows masked. The engine picks one by its cores; tests run each."""
    llm = LLM(str(model_dir), num_threads=1, num_kv_blocks=256, max_model_len=512, dtype="float32")
    llm.llm_engine.structured_output.overlap_masks = request.param
    return llm


def prompts(k: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 700, (8 + 3 * i,), generator=g).tolist() for i in range(k)]


def check(kind: str, text: str) -> None:
    if kind == "json":
        obj = json.loads(text)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 999
    elif kind == "regex":
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", text), text
    elif kind == "choice":
        assert text in ("red", "green", "blue"), text
    elif kind == "grammar":
        assert re.fullmatch(r"def [a-z_]{1,8}\(([a-z_]{1,8})?\):", text), text
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)


CONSTRAINTS = {
    "json": SO(json=SCHEMA, disable_any_whitespace=True),
    "regex": SO(regex=r"[A-Z]{2}-\d{3}"),
    "choice": SO(choice=["red", "green", "blue"]),
    "grammar": SO(grammar=GRAMMAR),
    "json_object": SO(json_object=True, disable_any_whitespace=True),
}


def test_every_kind_in_one_mixed_batch_and_free_rows_unaffected(llm):
    ps = prompts(6)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[ps[5]], sampling_params=free, use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=c) for c in CONSTRAINTS.values()]
    outs = llm.generate(prompt_token_ids=ps, sampling_params=params + [free], use_tqdm=False)
    for kind, out in zip(CONSTRAINTS, outs):
        c = out.outputs[0]
        if kind == "json_object" and c.finish_reason == "length":  # any object: a random model may write on
            assert c.text.startswith("{")
            continue
        assert c.finish_reason == "stop", (kind, c.text)
        check(kind, c.text)
    assert outs[5].outputs[0].token_ids == alone  # the free row of the batch saw no mask
    assert not llm.llm_engine.structured_output.matchers  # per-sequence grammar state is dropped at the end


SCHEMAS = [
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                              "maxItems": 3}},
        "required": ["name", "tags"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                         "y": {"type": "integer"}},
                                        "required": ["x", "y"], "additionalProperties": False}},
     "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"enum": ["alpha", "beta", 3, None]},
    {"type": "object", "properties": {"kind": {"const": "pt"}, "ok": {"type": ["boolean", "null"]}},
     "required": ["kind", "ok"], "additionalProperties": False},
]


@pytest.mark.parametrize("overlap_masks", [True, False], ids=["masks-overlapped", "checked-first"])
def test_json_schemas_validate_over_seeds_in_a_mixed_chunked_batch(model_dir, overlap_masks):
    """Every schema x several seeds, all in one batch with a free request, a small token budget (chunked
    prefill) and prefix caching on: every output validates, and the free request is unaffected."""
    llm = LLM(str(model_dir), num_threads=1, num_kv_blocks=256, max_model_len=512, dtype="float32",
              max_num_batched_tokens=32)
    llm.llm_engine.structured_output.overlap_masks = overlap_masks
    ps = [prompts(12)[-1], prompts(2)[1]]  # a 41-token prompt shared by the constrained requests
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[ps[1]], sampling_params=free, use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=SO(json=schema))
              for schema in SCHEMAS for seed in range(4)]
    outs = llm.generate(prompt_token_ids=[ps[0]] * len(params) + [ps[1]], sampling_params=params + [free],
                        use_tqdm=False)
    for (schema, out) in zip([s for s in SCHEMAS for _ in range(4)], outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert outs[-1].outputs[0].token_ids == alone
    assert llm.llm_engine.get_stats().scheduler.prefix_cache_hits > 0


def test_random_sampling_n_and_seeds_stay_inside_the_grammar(llm):
    """Plain random rows (checked after sampling when masks are not overlapped) and top-p / top-k rows (whose mask
    always comes first) in one batch: every sample matches, and seeds reproduce."""
    regex = SO(regex=r"[A-Z]{2}-[0-9]{3}")  # not \d: llguidance's \d takes digits newer than Python's Unicode tables
    params = [SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=40, structured_outputs=regex),
              SamplingParams(n=2, temperature=1.5, top_p=0.9, top_k=50, seed=12, max_tokens=40, structured_outputs=regex)]
    outs = llm.generate(prompt_token_ids=prompts(2), sampling_params=params, use_tqdm=False)
    texts = [c.text for out in outs for c in out.outputs]
    assert len(texts) == 6
    for t in texts:
        check("regex", t)
    again = llm.generate(prompt_token_ids=prompts(2), sampling_params=params, use_tqdm=False)
    assert [c.text for out in again for c in out.outputs] == texts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the masks on CUDA need a GPU (benchmarks/device_check.sh)")
@pytest.mark.parametrize("overlap_masks", [True, False], ids=["masks-overlapped", "checked-first"])
def test_masks_on_cuda_give_the_cpu_tokens(model_dir, overlap_masks):
    """The CUDA half: every kind of constraint and a free row in one batch on the GPU (masks built on the host,
    added to the logits on the device) give the float32 CPU engine's greedy tokens, and seeded random rows stay
    inside their grammar."""
    ps = prompts(6)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=c) for c in CONSTRAINTS.values()]
    regex = SO(regex=r"[A-Z]{2}-[0-9]{3}")
    sampled = [SamplingParams(n=4, temperature=1.0, seed=5, top_p=0.9, max_tokens=40, structured_outputs=regex)]
    greedy = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(model_dir), device=device, num_threads=1, num_kv_blocks=256, max_model_len=512,
                  dtype="float32")
        assert llm.llm_engine.runner.device.type == device
        llm.llm_engine.structured_output.overlap_masks = overlap_masks
        outs = llm.generate(prompt_token_ids=ps, sampling_params=params + [free], use_tqdm=False)
        greedy[device] = [o.outputs[0].token_ids for o in outs]
        if device == "cuda":
            for kind, out in zip(CONSTRAINTS, outs):
                if not (kind == "json_object" and out.outputs[0].finish_reason == "length"):
                    check(kind, out.outputs[0].text)
            rows = llm.generate(prompt_token_ids=ps[:1], sampling_params=sampled, use_tqdm=False)[0].outputs
            assert len(rows) == 4
            for c in rows:
                check("regex", c.text)
        del llm
    assert greedy["cuda"] == greedy["cpu"]


def test_checked_first_greedy_tokens_equal_the_overlapped_masks(llm):
    """Sampling first and masking only rejected rows is exact for greedy: the same tokens as masking every row."""
    ps = prompts(5)
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=c) for c in CONSTRAINTS.values()]
    manager = llm.llm_engine.structured_output
    mode = manager.overlap_masks
    runs = {}
    try:
        for overlap in (True, False):
            manager.overlap_masks = overlap
            before = manager.checked_rows, manager.rejected_rows
            outs = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
            runs[overlap] = [o.outputs[0].token_ids for o in outs]
            checked, rejected = manager.checked_rows - before[0], manager.rejected_rows - before[1]
            assert (checked > rejected > 0) if not overlap else checked == 0  # the random model is often rejected
    finally:
        manager.overlap_masks = mode
    assert runs[True] == runs[False]


def test_checked_first_sampling_draws_from_the_masked_distribution(llm):
    """A row sampled without its mask, and sampled again under it when its grammar rejects the token
    (ModelRunner._resample_rejected), has exactly the masked distribution: 20000 rows at temperature 1 from logits
    where the allowed tokens hold about half the mass. A fallback to the masked argmax, or a second unmasked
    draw, would fail."""
    from pagedserve.core.request import Request

    runner, manager = llm.llm_engine.runner, llm.llm_engine.structured_output
    manager.add("c", llm.llm_engine.input_processor.grammars.compile(SO(regex=r"[a-e]")))
    try:
        allowed = torch.nonzero(manager.masks_now(["c"])[0, :manager.vocab_size] == 0).flatten()
        assert 2 <= len(allowed) < 50
        g = torch.Generator().manual_seed(5)
        logits = torch.randn(manager.vocab_size, generator=g)
        weights = torch.arange(1, len(allowed) + 1, dtype=torch.float32)  # unequal: 1, 2, ... within the set
        rest = torch.logsumexp(logits, 0).exp() - logits[allowed].exp().sum()
        logits[allowed] = (weights / weights.sum() * rest).log()  # p(allowed) = 1/2
        expected = weights / weights.sum()
        n = 20000
        requests = [Request("c", [1], SamplingParams(temperature=1.0, max_tokens=1), 1) for _ in range(n)]
        batch = logits.expand(n, -1).to(runner.device, copy=True)  # the logits live where the model runs
        out = runner.sampler(batch, runner._sampling_metadata(requests), runner.default_generator)
        first = out.sampled_token_ids.clone().cpu()
        runner._resample_rejected(batch, requests, out, list(range(n)), manager)
        tokens = out.sampled_token_ids.cpu()
        assert 0.45 < torch.isin(first, allowed).float().mean() < 0.55  # both paths ran
        assert bool(torch.isin(tokens, allowed).all())
        kept = torch.isin(first, allowed)
        assert torch.equal(tokens[kept], first[kept])  # an allowed first draw stands
        freq = (tokens.unsqueeze(1) == allowed.unsqueeze(0)).float().mean(0)
        sigma = (expected * (1 - expected) / n).sqrt()
        assert bool(((freq - expected).abs() < 5 * sigma).all()), (freq, expected)
    finally:
        manager.retain(set())


def test_constraints_survive_preemption(model_dir):
    ps = prompts(4)
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=SO(regex=r"[a-z]{40}-[0-9]{20}"))
    roomy = LLM(str(model_dir), num_threads=1, num_kv_blocks=256, max_model_len=512, dtype="float32")
    expected = [o.outputs[0].text for o in roomy.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)]
    tight = LLM(str(model_dir), num_threads=1, num_kv_blocks=16, block_size=8, max_model_len=512, dtype="float32")
    got = [o.outputs[0].text for o in tight.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)]
    assert tight.llm_engine.get_stats().scheduler.num_preemptions > 0
    assert got == expected
    for t in got:
        assert re.fullmatch(r"[a-z]{40}-[0-9]{20}", t), t


@pytest.mark.parametrize("constraint, param", [
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(grammar="start: ( unclosed"), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
])
def test_invalid_constraints_are_refused_naming_the_field(llm, constraint, param):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompt_token_ids=prompts(1), use_tqdm=False,
                     sampling_params=SamplingParams(max_tokens=4, structured_outputs=SO(**constraint)))
    assert info.value.param == param


# ------------------------------------------------------------------------------------ over HTTP
def test_openai_response_format_and_vllm_fields(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key-123", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    messages = [{"role": "user", "content": "give me json"}]
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=120, temperature=0,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "thing", "schema": SCHEMA}})
    choice = r.choices[0]  # OpenAI's JSON allows free whitespace: a random model may spend max_tokens on it
    if choice.finish_reason == "stop":
        check("json", choice.message.content)
    assert choice.message.content.startswith("{")
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=120, temperature=0,
                                  extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert r.choices[0].finish_reason == "stop"
    check("json", r.choices[0].message.content)
    r = c.completions.create(model=model, prompt="color:", max_tokens=10, temperature=0,
                             extra_body={"guided_choice": ["red", "green", "blue"]})
    check("choice", r.choices[0].text)
    assert r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=model, prompt="id:", max_tokens=20, temperature=0,
                             extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
    check("regex", r.choices[0].text)
    stream = c.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0, stream=True,
                                       extra_body={"guided_grammar": GRAMMAR})
    check("grammar", "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"guided_regex": "a(b"})
    assert info.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=model, prompt="x", max_tokens=4,
                             extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert "one output constraint" in info.value.body["message"]


# ------------------------------------------------------------------------------------ tool calling
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 12},
                                                                          "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
                                                           "required": ["city", "days"],
                                                           "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}


def check_weather(args: str) -> None:
    obj = json.loads(args)
    assert set(obj) == {"city", "days"} and isinstance(obj["city"], str) and 1 <= obj["days"] <= 7


def test_tool_calls_named_and_required_streamed_equal_full(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key-123", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    messages = [{"role": "user", "content": "weather in Paris?"}]
    common = dict(model=model, messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=150)
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = c.chat.completions.create(tool_choice=named, **common).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None
    (call,) = full.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather(call.function.arguments)
    chunks = list(c.chat.completions.create(tool_choice=named, stream=True, **common))
    pieces = [tc for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls
              for tc in ch.choices[0].delta.tool_calls]
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        ["tool_calls"]

    # one call (a random-weight model would otherwise keep appending parallel calls up to max_tokens)
    common["parallel_tool_calls"] = False
    full = c.chat.completions.create(tool_choice="required", **common).choices[0]
    assert full.finish_reason == "tool_calls" and len(full.message.tool_calls) == 1
    for call in full.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            check_weather(call.function.arguments)
        else:
            assert json.loads(call.function.arguments)["tz"] in ("UTC", "CET")
    chunks = list(c.chat.completions.create(tool_choice="required", stream=True, **common))
    streamed = [tc for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls
                for tc in ch.choices[0].delta.tool_calls]
    assert len(streamed) > 2  # the arguments stream in pieces, not whole at the end
    reassembled: dict[int, list[str]] = {}
    for piece in streamed:  # the first piece of a call carries its id and name
        assert (piece.index in reassembled) == (piece.id is None)
        name, args = reassembled.setdefault(piece.index, [piece.function.name, ""])
        reassembled[piece.index][1] = args + (piece.function.arguments or "")
    assert [tuple(v) for _, v in sorted(reassembled.items())] == \
        [(t.function.name, t.function.arguments) for t in full.message.tool_calls]

    # a tool result goes back through the template; "auto" needs the server flags
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", '
                                                                                             '"days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = c.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=4)
    assert "enable-auto-tool-choice" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=4,
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"


def test_server_builds_the_grammar_tokenizer_at_start_up(server):
    """Built before the server is ready, so the first constrained request's step does not pay for it; it is one of
    the start-up stages the server logs, each with its duration. The last stage freezes the start-up heap, so
    no full collection traverses it while the server streams (such a collection was an 80-250 ms stall)."""
    line = next(line for line in server.log().splitlines() if "Start-up stages:" in line)
    for stage in ("process start and imports", "config", "tokenizer", "model load", "KV cache allocation",
                  "native kernels", "warm-up", "structured output (llguidance)", "HTTP app", "heap freeze", "total"):
        assert re.search(re.escape(stage) + r" \d+\.\d\d s", line), (stage, line)
    frozen = re.search(r"Froze (\d+) objects of the start-up heap", server.log())
    assert frozen and int(frozen.group(1)) > 50_000, server.log()[-3000:]  # torch + transformers: ~300k
    assert re.search(r"Port open: accepting requests \d+\.\d\d s after the process started", server.log())


@pytest.mark.server
def test_auto_tool_choice_hermes_over_http_streams_content_then_the_call(model_dir):
    """--enable-auto-tool-choice --tool-call-parser hermes on a real server: the model's text is forced into the
    Hermes format by a regex constraint (a random-weight model would not write it); the server turns it into
    content + tool_calls, and the streamed deltas (content first, then the call once closed) reassemble to it."""
    from server_helpers import API_KEY, MAIN_ARGS, get_server

    srv = get_server(model_dir, MAIN_ARGS + ("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    regex = (r'Sure[.!] <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
             r'</tool_call>')
    common = dict(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "weather in Paris?"}],
                  tools=[WEATHER, TIME], temperature=0, max_tokens=80,
                  extra_body={"structured_outputs": {"regex": regex}})
    full = c.chat.completions.create(**common).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content in ("Sure.", "Sure!")
    (call,) = full.message.tool_calls
    assert call.function.name == "get_weather"
    check_weather(call.function.arguments)
    chunks = list(c.chat.completions.create(stream=True, **common))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == full.message.content
    (streamed,) = [tc for d in deltas for tc in d.tool_calls or []]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        ["tool_calls"]


def parse_in_pieces(plan, text: str, parser: str | None, size: int):
    """Feed the text to a streaming tool-call parser `size` characters at a time -> (content, calls)."""
    from pagedserve.entrypoints.openai.tool_calls import ToolCallDeltas, assemble, make_tool_call_parser

    tool_parser, deltas = make_tool_call_parser(plan, parser), ToolCallDeltas()
    for start in range(0, len(text), size):
        deltas += tool_parser.feed(text[start:start + size])
    deltas += tool_parser.finish()
    content, calls = assemble(deltas)
    return content, [(c.function.name, c.function.arguments) for c in calls]


TOOL_OUTPUTS = [  # (plan, parser, text, expected content, expected calls)
    ("auto", "hermes", 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "ok", [("f", '{"a": 1}')]),
    ("auto", "hermes", 'a <tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", '
                       '"arguments": {"s": "<tool_call>"}}</tool_call> b', "a \n b",
     [("f", "{}"), ("g", '{"s": "<tool_call>"}')]),
    ("auto", "hermes", "no calls here <tool_ca", "no calls here <tool_ca", []),
    ("auto", "hermes", "<tool_call>not json</tool_call> x ", "<tool_call>not json</tool_call> x ", []),
    ("auto", "llama3_json", '{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"x": "y"}'), ("g", "{}")]),
    ("auto", "llama3_json", "  plain {text}", "  plain {text}", []),
    ("auto", "llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("auto", "mistral", 'hi [TOOL_CALLS] [{"name": "f", "arguments": {"q": 2}}]', "hi", [("f", '{"q": 2}')]),
    ("auto", "mistral", "[TOOL_CALLS] [broken", "[TOOL_CALLS] [broken", []),
    ("required", None, '[{"name":"f","parameters":{"a":[1,{"b":"}]\\""}]}},{"name":"g\\"x","parameters":{}}]',
     None, [("f", '{"a":[1,{"b":"}]\\""}]}'), ('g"x', "{}")]),
    ("required", None, '[{"name":"f","param', '[{"name":"f","param', []),
    ("none", None, "just text", "just text", []),
]


@pytest.mark.parametrize("mode,parser,text,content,calls", TOOL_OUTPUTS)
def test_tool_call_parsers_stream_in_any_pieces(mode, parser, text, content, calls):
    """Every parser gives the same content and calls whether the text comes whole or a few characters at a
    time (what makes streamed deltas reassemble to the non-streamed answer)."""
    from pagedserve.entrypoints.openai.tool_calls import ToolPlan

    plan = ToolPlan(mode)
    for size in (len(text) or 1, 1, 2, 5):
        assert parse_in_pieces(plan, text, parser, size) == (content, calls), size
    named = ToolPlan("named", function_name="f")
    assert parse_in_pieces(named, '{"a":1}', None, 3) == (None, [("f", '{"a":1}')])


def test_mask_bias_allows_exactly_the_grammars_tokens(llm):
    """The manager's logit bias, however it is filled (on the worker beside the forward, up front on the engine
    thread, or for a rejected row after sampling), is 0 exactly for the tokens llguidance's matcher accepts and -inf
    elsewhere; free rows of the same batch stay all zero; `allows` agrees with it token by token; the sampler adds
    it in one op and sets the columns past its width to -inf."""
    from pagedserve.model_executor.sampler import apply_token_mask_bias

    manager = llm.llm_engine.structured_output
    grammar = llm.llm_engine.input_processor.grammars.compile(SO(regex=r"[A-Z]{2}-\d{3}"))
    manager.add("constrained", grammar)
    try:
        masks = manager.start_masks(["free", "constrained"], [False, True])
        assert masks.checked_rows == []  # on the worker, or up front for a row that needs its whole mask
        bias = masks.bias.result()
        # checked first: a row that may sample before its mask is known is left for the check
        later = manager.start_masks(["free", "constrained"], [False, False])
        if manager.overlap_masks:
            assert later.checked_rows == [] and torch.equal(later.bias.result(), bias)
        else:
            assert later.bias is None and later.checked_rows == [1]
        matcher = manager.matchers["constrained"]
        allowed = [t for t in range(manager.vocab_size) if matcher.validate_tokens([t]) == 1]
        assert 0 < len(allowed) < manager.vocab_size
        assert manager.allows(["constrained"] * manager.vocab_size, list(range(manager.vocab_size))) == \
            [t in set(allowed) for t in range(manager.vocab_size)]
        assert bool((bias[0] == 0).all())
        for row in (bias[1], manager.masks_now(["constrained"])[0]):
            assert torch.nonzero(row == 0).flatten().tolist() == allowed
            assert bool(torch.isneginf(row[[t for t in range(manager.vocab_size) if t not in set(allowed)]]).all())
        logits = torch.randn(2, manager.vocab_size + 5)
        expected = logits.clone()
        apply_token_mask_bias(logits, bias)
        assert torch.equal(logits[0, :manager.vocab_size], expected[0, :manager.vocab_size])
        assert torch.equal(logits[1, allowed], expected[1, allowed])
        assert bool(torch.isneginf(logits[:, bias.shape[1]:]).all())
    finally:
        manager.retain(set())


@pytest.mark.slow
def test_mask_worker_opens_no_openmp_pool(tiny_tokenizer_dir):
    """The grammar thread runs no parallel torch op: OpenMP would give it a thread pool of its own, and with more
    pool threads than cores libgomp stops spin-waiting, so the engine's every parallel region wakes its worker by
    futex (StructuredOutputManager._fill). A new pool shows as a new OS thread of the process.
    Neither way of filling masks imports torch._dynamo (llguidance.torch does): that import made a server's first
    constrained request 4-5 s slower. New threads are counted by id, not by number: on a loaded machine a transient
    thread of the set-up ended inside the window once and made the count -1."""
    code = f"""
import os, sys, torch
from transformers import AutoTokenizer
from pagedserve.config import RequestLimits
from pagedserve.engine.grammar_compiler import GrammarCompiler
from pagedserve.engine.structured_output import StructuredOutputManager
from pagedserve.sampling_params import StructuredOutputsParams
torch.set_num_threads(2)
torch.full((4096, 64), 1.0).sum()  # the main thread's pool exists
manager = StructuredOutputManager(AutoTokenizer.from_pretrained({str(tiny_tokenizer_dir)!r}), 65536)
grammar = GrammarCompiler(manager, RequestLimits()).compile(StructuredOutputsParams(json={{"type": "object"}}))
for i in range(64):
    manager.add(str(i), grammar)
manager.start_masks(["0"], [False]).bias.result()  # the grammar thread and llguidance's executor exist
before = set(os.listdir("/proc/self/task"))
bias = manager.start_masks([str(i) for i in range(64)], [False] * 64).bias.result()  # 64 x 2048 mask words: a parallel-sized fill
assert bias.shape[0] == 64 and bool((bias[:, :65536] == 0).any(dim=1).all())
manager.masks_now(["1"])  # the engine thread's way
print("torch._dynamo imported:", "torch._dynamo" in sys.modules)
print("new threads:", len(set(os.listdir("/proc/self/task")) - before))  # ids: a thread that ends is not one less
"""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["torch._dynamo imported: False", "new threads: 0"], out.stdout
