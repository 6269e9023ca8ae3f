"""The published API tells the truth, and no request body can make the server fall over.

* `test_openapi_*`: /openapi.json documents the constraints the server enforces, the OpenAI error body for
  every error status, and no status the server never sends (FastAPI's 422).
* `test_schemathesis_conformance`: schemathesis (`st run --checks all`) against a real `pagedserve serve`
  on the tiny random-weight llama, bounded (fixed examples per operation, fixed seed).  Schema-valid
  requests must be accepted, except the refusals `pagedserve.entrypoints.openai.protocol.BUSINESS_RULES`
  documents (a prompt longer than the context, an out-of-vocabulary id, min_tokens > max_tokens, ...):
  positive_data_acceptance lets a 400 through and `business_rule_refusal` (registered below, loaded by
  schemathesis as a hooks file) fails any 400 on schema-valid data that breaks none of those rules.
* `test_fuzz_request_bodies`: every bad value of a table once (SamplingParams-like fields out of range or of the
  wrong type, empty / nested / out-of-vocabulary prompts, huge ids such as stop_token_ids=[10**7], bad
  messages, garbage JSON, NaN / Infinity, cross-field rules and limits) while streams run next to them, then
  FUZZ_EXAMPLES random valid and bad bodies (hypothesis, derandomized): every answer is a well-formed 200 for a
  valid body and an OpenAI-style 4xx for a bad one, never a 5xx; the concurrent streams end intact; a known
  greedy request gives the same text before and after.  It prints a one-line summary of the counts.
* smaller checks: the smallest schema-valid bodies are served, 405 has `Allow`, 413 (with and without a
  Content-Length), /health is JSON.

The server is a separate process (module scope), not the shared `server` fixture.
"""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

pytestmark = pytest.mark.server

C, CH = "/v1/completions", "/v1/chat/completions"
MAX_MODEL_LEN = 128
# Per-request limits of the engine (EngineArgs defaults; the server below does not change them).
MAX_SEQUENCES_PER_REQUEST = 256
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 8192
RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                            "return_dict", "return_tensors", "chat_template", "tools", "documents"}
MAX_BODY_BYTES = 65536
SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256", "--max-num-seqs", "64",
               "--max-request-body-bytes", str(MAX_BODY_BYTES))
REFERENCE = {"prompt": "the cat reads a long letter", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


# ------------------------------------------------------------------------------------------ rules
def _ids_out_of_vocab(value: Any, vocab: int) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value >= vocab
    if isinstance(value, list):
        return any(_ids_out_of_vocab(v, vocab) for v in value)
    return False


def _bad_logit_bias(bias: Any, vocab: int) -> bool:
    if not isinstance(bias, dict):
        return False
    return any(not k.isdigit() or int(k) >= vocab or not -100 <= v <= 100 for k, v in bias.items())


CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def business_rule_broken(path: str, body: Any, error: dict[str, Any], vocab: int) -> str | None:
    """Why a schema-valid `body` may be refused with this 400 `error` (a rule of protocol.BUSINESS_RULES that
    the body really breaks), or None when it breaks none of them: then the refusal is a conformance bug."""
    if not isinstance(body, dict):
        return None
    param = str(error.get("param") or "")
    field = re.split(r"[.\[]", param, maxsplit=1)[0]
    code = error.get("code")
    chat = path in (CH, "/tokenize") and "messages" in body
    # the effective max_tokens (None: the server's default, what max_model_len leaves after the prompt)
    max_tokens = body.get("max_tokens", None if path == CH else 16)
    if path == CH and body.get("max_completion_tokens") is not None:
        max_tokens = body["max_completion_tokens"]
    if code == "context_length_exceeded" and field in ("prompt", "messages", "max_tokens", "input", "max_output_tokens"):
        return "prompt (+ max_tokens) longer than max_model_len"  # needs the tokenizer: the server decides
    if field in ("prompt", "messages") and path != CH and _ids_out_of_vocab(body.get("prompt"), vocab):
        return "prompt token id outside the vocabulary"
    if field == "stop_token_ids" and _ids_out_of_vocab(body.get("stop_token_ids"), vocab):
        return "stop token id outside the vocabulary"
    if field == "tokens" and path == "/detokenize" and _ids_out_of_vocab(body.get("tokens"), vocab):
        return "token id outside the vocabulary"
    if field == "min_tokens" and body.get("min_tokens", 0) > (MAX_MODEL_LEN if max_tokens is None else max_tokens):
        return "min_tokens > max_tokens"
    if field == "min_tokens" and max_tokens is None and body.get("min_tokens", 0) > 0:
        return "min_tokens > the default max_tokens (what the context leaves after the prompt)"
    if body.get("use_beam_search") is True and (code == "unsupported_parameter" or field in ("n", "max_tokens")):
        return "a field use_beam_search does not honour, n above half of --max-logprobs, or no room for max_tokens"
    best_of, n = body.get("best_of"), body.get("n", 1)
    if field == "best_of" and best_of is not None and (best_of < n or (best_of > n and body.get("stream"))):
        return "best_of < n, or best_of > n with stream"
    truncate = body.get("truncate_prompt_tokens")
    if field == "truncate_prompt_tokens" and truncate is not None and (truncate == 0 or truncate > MAX_MODEL_LEN - 1):
        return "truncate_prompt_tokens 0 or above max_model_len - 1"
    if field == "priority" and body.get("priority", 0) != 0:
        return "priority without --scheduling-policy priority"
    if field == "stream_options" and body.get("stream_options") is not None and not body.get("stream"):
        return "stream_options without stream"
    if field == "max_tokens" and path == C and body.get("max_tokens") == 0 and not body.get("echo"):
        return "max_tokens 0 without echo"
    if field == "logit_bias" and _bad_logit_bias(body.get("logit_bias"), vocab):
        return "logit_bias key outside the vocabulary or bias outside [-100, 100]"
    if field == "allowed_token_ids" and (not body.get("allowed_token_ids")
                                         or _ids_out_of_vocab(body["allowed_token_ids"], vocab)):
        return "allowed_token_ids empty or outside the vocabulary"
    if field == "bad_words" and any(not w.strip() for w in body.get("bad_words") or []):
        return "a blank bad word"
    if field == "top_logprobs" and body.get("top_logprobs") is not None and not body.get("logprobs"):
        return "top_logprobs without logprobs"
    both = (body.get("max_tokens"), body.get("max_completion_tokens"))
    if field == "max_tokens" and path == CH and None not in both and both[0] != both[1]:
        return "max_tokens != max_completion_tokens"
    if field == "continue_final_message" and chat and body.get("continue_final_message") \
            and body.get("add_generation_prompt", True):
        return "add_generation_prompt and continue_final_message"
    if field == "chat_template_kwargs" and RESERVED_TEMPLATE_KWARGS & set(body.get("chat_template_kwargs") or {}):
        return "reserved chat_template_kwargs key"
    if field == "n" and code == "too_many_sequences":
        prompts = body.get("prompt")
        count = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)) else 1
        if count * body.get("n", 1) > MAX_SEQUENCES_PER_REQUEST:
            return "prompts x n above --max-sequences-per-request"
    if field == "seed" and isinstance(body.get("seed"), int) and not -(2**63) <= body["seed"] < 2**63:
        # Not a business rule: the value is outside the schema's int64 range, but schemathesis compares it as
        # a double, where 2**63 - 1 + 200 == 2**63 - 1.
        return "seed outside int64 (JSON double rounding in the generator)"
    if field in CONSTRAINT_FIELDS:
        given = [f for f in CONSTRAINT_FIELDS if body.get(f) is not None
                 and not (f == "response_format" and isinstance(body[f], dict) and body[f].get("type") == "text")]
        if len(given) > 1:
            return "more than one output constraint"
        if code == "invalid_grammar":
            return "the grammar engine refused the schema / regex / grammar"
        fmt, so = body.get("response_format"), body.get("structured_outputs")
        if field == "response_format" and isinstance(fmt, dict) and fmt.get("type") == "json_schema" \
                and (fmt.get("json_schema") or {}).get("schema") is None:
            return "json_schema without its schema"
        if field == "structured_outputs" and isinstance(so, dict) and sum(
                so.get(k) is not None for k in ("json", "regex", "choice", "grammar")) + bool(so.get("json_object")) != 1:
            return "structured_outputs needs exactly one constraint"
        if field in ("guided_json", "structured_outputs") and isinstance(body.get(field), (dict, str)):
            value = body[field] if field == "guided_json" else body[field].get("json")
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    return "the JSON schema is not JSON"
            if value is not None and not isinstance(value, (dict, bool)):
                return "the JSON schema is not an object"
    if field in ("tools", "tool_choice"):
        tools = body.get("tools") or []
        choice = body.get("tool_choice")
        if choice is None:  # absent or null: the default
            choice = "auto" if tools else "none"
        # chat's tools are {"function": {"name"}}, /v1/responses' {"name"} (and so are their named tool_choice)
        names = {t["function"]["name"] if isinstance(t.get("function"), dict) else t.get("name")
                 for t in tools if isinstance(t, dict)}
        if choice == "auto" and tools:
            return '"auto" tool choice without --enable-auto-tool-choice'
        if choice not in (None, "none") and not tools:
            return "tool_choice without tools"
        if isinstance(choice, dict) and ((choice.get("function") or {}).get("name") or choice.get("name")) not in names:
            return "tool_choice names a function that is not among the tools"
        if code == "invalid_grammar":
            return "a function's parameters schema is invalid"
        if field == "tool_choice" and choice not in (None, "none", "auto") and any(
                body.get(f) is not None and not (f == "response_format" and isinstance(body[f], dict)
                                                 and body[f].get("type") == "text") for f in CONSTRAINT_FIELDS):
            return "tool_choice required / named plus another output constraint"
    if field == "stop":
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or sum(map(len, stops)) > MAX_STOP_CHARS:
            return "too many / too long stop strings"
    return None


def test_business_rule_oracle():
    """The oracle behind `business_rule_refusal` accepts only refusals the body earns."""
    err = lambda param, code="invalid_value": {"param": param, "code": code}  # noqa: E731
    assert business_rule_broken(C, {"prompt": "a", "min_tokens": 20}, err("min_tokens"), 768)
    assert business_rule_broken(C, {"prompt": "a", "min_tokens": 2}, err("min_tokens"), 768) is None
    assert business_rule_broken(C, {"prompt": [5, 768]}, err("prompt"), 768)
    assert business_rule_broken(C, {"prompt": [5, 767]}, err("prompt"), 768) is None
    assert business_rule_broken(C, {"prompt": "a"}, err("prompt"), 768) is None  # e.g. a bogus "empty" refusal
    assert business_rule_broken(C, {"prompt": "a"}, err("prompt", "context_length_exceeded"), 768)
    assert business_rule_broken(C, {"prompt": "a", "best_of": 1, "n": 2}, err("best_of"), 768)
    assert business_rule_broken(C, {"prompt": "a", "best_of": 2, "stream": True}, err("best_of"), 768)
    assert business_rule_broken(C, {"prompt": "a", "best_of": 2}, err("best_of"), 768) is None
    assert business_rule_broken(CH, {"messages": [{"role": "user"}], "continue_final_message": True},
                                err("continue_final_message"), 768)
    assert business_rule_broken(CH, {"messages": [{"role": "user"}]}, err("messages"), 768) is None
    assert business_rule_broken(CH, {"messages": [], "max_completion_tokens": 3, "min_tokens": 4},
                                err("min_tokens"), 768)
    assert business_rule_broken(CH, {"messages": [], "max_completion_tokens": 4, "min_tokens": 4},
                                err("min_tokens"), 768) is None
    assert business_rule_broken(C, {"prompt": "a", "seed": 2**63}, err("seed"), 768)
    assert business_rule_broken(C, {"prompt": "a", "seed": 2**63 - 1}, err("seed"), 768) is None


if __name__ == "_schemathesis_hooks":  # loaded by `st run` through SCHEMATHESIS_HOOKS (see below)
    import schemathesis

    _VOCAB = int(os.environ["CONFORMANCE_VOCAB_SIZE"])

    @schemathesis.check
    def business_rule_refusal(ctx, response, case):
        """A 400 on schema-valid data must be one of the documented business-rule refusals."""
        meta = getattr(case, "meta", None)
        mode = getattr(getattr(meta, "generation", None), "mode", None)
        if response.status_code != 400 or mode is None or not mode.is_positive:
            return None
        try:
            error = response.json()["error"]
        except Exception:
            raise AssertionError(f"400 without an OpenAI error body: {response.text[:300]}")
        if business_rule_broken(case.path, case.body, error, _VOCAB) is None:
            raise AssertionError(f"Schema-valid request refused without breaking a documented rule "
                                 f"(protocol.BUSINESS_RULES): {error}")
        return None


# ----------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def conf_server(tiny_model_dir):
    from server_helpers import ServerProcess

    # The first server of a run may build the native kernels (minutes on a busy 2-core machine).
    srv = ServerProcess(tiny_model_dir("llama"), SERVER_ARGS, startup_timeout=900)
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def vocab_size(tiny_model_dir) -> int:
    return int(json.loads((Path(tiny_model_dir("llama")) / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def openapi(conf_server) -> dict:
    r = httpx.get(conf_server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def _greedy_text(url: str) -> str:
    r = httpx.post(url + C, json=REFERENCE, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# ----------------------------------------------------------------------------------- the document
def _walk(node: Any):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _resolve(doc: dict, node: dict) -> dict:
    while "$ref" in node:
        node = doc["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def test_openapi_constraints(openapi):
    schemas = openapi["components"]["schemas"]
    # pydantic keywords that leaked instead of JSON Schema's minimum / maximum would be silently ignored
    leaked = [n for n in _walk(openapi) if {"ge", "le", "gt", "lt"} & set(n) and "type" in n]
    assert not leaked, leaked[:3]
    completion = schemas["CompletionRequest"]["properties"]
    alternatives = completion["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1}.items() <= alternatives[0].items()
    assert all(a.get("minItems") == 1 for a in alternatives[1:]), alternatives
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    stop = completion["stop"]["anyOf"]
    assert stop[0]["minLength"] == 1 and stop[1]["items"]["minLength"] == 1
    assert completion["n"]["minimum"] == 1 and completion["n"]["maximum"] == 128
    assert completion["temperature"]["anyOf"][0]["maximum"] == 2
    assert completion["stop_token_ids"]["anyOf"][0]["items"]["minimum"] == 0
    # /tokenize: exactly one of prompt / messages
    body = openapi["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    variants = [_resolve(openapi, v) for v in body["anyOf"]]
    assert sorted(tuple(v["required"]) for v in variants) == [("messages",), ("prompt",)]
    assert all(v["additionalProperties"] is False for v in variants)


EXPECTED_ERRORS = {
    (C, "post"): {400, 401, 404, 413, 429, 500, 503},
    (CH, "post"): {400, 401, 404, 413, 429, 500, 503},
    ("/v1/responses", "post"): {400, 401, 404, 413, 429, 500, 503},
    ("/tokenize", "post"): {400, 401, 404, 413, 500},
    ("/detokenize", "post"): {400, 401, 404, 413, 500},
    ("/v1/models", "get"): {401, 500},
    ("/v1/models/{model_id}", "get"): {401, 404, 500},
    ("/health", "get"): {500, 503},
    ("/version", "get"): {401, 500},
    ("/metrics", "get"): {500},
}


def test_openapi_documents_errors_and_content_types(openapi):
    seen = set()
    for path, item in openapi["paths"].items():
        for method, op in item.items():
            seen.add((path, method))
            responses = op["responses"]
            assert "422" not in responses, (path, method)  # validation errors are 400s here
            errors = {int(s) for s in responses if s[0] in "45"}
            assert errors == EXPECTED_ERRORS[(path, method)], (path, method, errors)
            for status in errors:
                schema = responses[str(status)]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (path, status)
            ok = responses["200"]["content"]
            assert list(ok) == (["text/plain"] if path == "/metrics" else
                                ["application/json", "text/event-stream"] if path in (C, CH, "/v1/responses") else
                                ["application/json"]), (path, list(ok))
    assert seen == set(EXPECTED_ERRORS)
    error = _resolve(openapi, {"$ref": "#/components/schemas/ErrorInfo"})
    assert sorted(error["required"]) == ["code", "message", "param", "type"]
    assert "HTTPValidationError" not in openapi["components"]["schemas"]
    health = _resolve(openapi, openapi["paths"]["/health"]["get"]["responses"]["200"]["content"]
                      ["application/json"]["schema"])
    assert health["properties"]["status"]["const"] == "ok"


def test_schema_valid_edge_bodies_are_accepted(conf_server):
    """The smallest schema-valid bodies (what schemathesis' coverage phase tries first) are served."""
    url = conf_server.url
    msg = [{"role": "user"}]
    cases = [(C, {"prompt": "a", "max_tokens": 1}), (C, {"prompt": ["a"], "max_tokens": 1}),
             (C, {"prompt": [5], "max_tokens": 1}), (C, {"prompt": [[5], [6, 7]], "max_tokens": 1}),
             (C, {"prompt": "a", "max_tokens": 2.0, "n": 1.0, "stop": [], "stop_token_ids": [0]}),
             (C, {"prompt": "a", "max_tokens": 1, "top_k": -1, "top_p": 5e-324, "temperature": 0}),
             (CH, {"messages": msg, "max_tokens": 1}),
             (CH, {"messages": [{"role": "assistant", "content": []}], "max_tokens": 1}),
             ("/tokenize", {"prompt": "a"}), ("/tokenize", {"messages": msg}),
             ("/detokenize", {"tokens": []}), ("/detokenize", {"tokens": [0, 1.0]})]
    for path, body in cases:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, body, r.status_code, r.text)
    for path, body, param in [("/tokenize", {}, "prompt"), (C, {"prompt": ""}, "prompt"),
                              (CH, {"messages": []}, "messages"), (C, {"prompt": "a", "stop": [""]}, "stop[0]")]:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_405_carries_allow(conf_server):
    r = httpx.request("TRACE", conf_server.url + "/health", timeout=30)
    assert r.status_code == 405 and r.headers.get("allow") == "GET", (r.status_code, r.headers)
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(conf_server.url + C, timeout=30)
    assert r.status_code == 405 and "POST" in r.headers.get("allow", "")


def test_body_too_large_is_413(conf_server):
    """Documented 413, with or without a Content-Length (a chunked body is counted as it streams in)."""
    body = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    headers = {"Content-Type": "application/json"}

    def chunks():
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    for path in (C, "/tokenize"):
        for content, how in ((body, "content-length"), (chunks(), "chunked")):
            r = httpx.post(conf_server.url + path, content=content, headers=headers, timeout=60)
            assert r.status_code == 413, (path, how, r.status_code, r.text[:300])
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(conf_server.url + C, json={"prompt": "x" * 1000, "max_tokens": 1}, timeout=60)
    assert r.status_code in (200, 400), r.text  # under the limit: not a 413


def test_health_is_json(conf_server):
    r = httpx.get(conf_server.url + "/health", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json" and r.json() == {"status": "ok"}


# ------------------------------------------------------------------------------------ schemathesis
ST_EXAMPLES = 25  # per operation and phase
ST_SEED = 20251201
ST_CONFIG = """
# Schema-valid requests a server must not refuse for their shape; the 400 is let through here only for the
# rules a schema cannot express (protocol.BUSINESS_RULES), and the hooks' `business_rule_refusal` check
# fails any 400 on schema-valid data that breaks none of them.
[checks.positive_data_acceptance]
expected-statuses = ["2XX", "400", "401", "403", "404", "409", "429", "5XX"]
"""


def _st_command() -> list[str]:
    exe = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    return [exe] if exe else [sys.executable, "-m", "schemathesis.cli"]


@pytest.mark.timeout(600)
def test_schemathesis_conformance(conf_server, vocab_size, tmp_path):
    pytest.importorskip("schemathesis")
    config = tmp_path / "schemathesis.toml"
    config.write_text(ST_CONFIG)
    # `--checks all` turns on schemathesis's 10 s response-time check too. How long a request takes depends on
    # what else the machine runs (CI shares 2 cores between 3 workers), so that limit is raised to the request
    # timeout: it stays a hang guard and never becomes a timed assertion.
    cmd = [*_st_command(), "--config-file", str(config), "run", conf_server.url + "/openapi.json",
           "--checks", "all", "--max-response-time", "60", "--request-timeout", "60",
           "--max-examples", str(ST_EXAMPLES), "--seed", str(ST_SEED), "--workers", "1",
           "--generation-database", "none", "--no-color", "--output-sanitize", "false",
           "--suppress-health-check", "too_slow,filter_too_much"]
    env = dict(os.environ, SCHEMATHESIS_HOOKS=str(Path(__file__).resolve()), CONFORMANCE_VOCAB_SIZE=str(vocab_size),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    before = _greedy_text(conf_server.url)
    start = time.monotonic()
    # a hang guard, not a time limit: ~70-90 s on a quiet 2-core machine, over 170 s when two CI runs share it
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    generated = re.search(r"(\d+) generated", out)
    print(f"\nschemathesis {' '.join(cmd[1:])}\n  -> {generated.group(0) if generated else '?'} cases, "
          f"exit {proc.returncode}, {elapsed:.0f} s")
    assert proc.returncode == 0 and generated and int(generated.group(1)) > 100, out[-12000:]
    assert "Traceback" not in conf_server.log(), conf_server.log()[-3000:]
    assert conf_server.alive() and _greedy_text(conf_server.url) == before


# -------------------------------------------------------------------------------------- fuzzing
def _bad_material(vocab: int) -> dict[str, Any]:
    """Values the server must refuse with a 4xx: per field (out of range, wrong type, breaking a rule), prompt
    and messages shapes, raw bodies that are not a JSON object, and cross-field rules / limits."""
    long_text = "the cat reads a long letter " * 40  # > MAX_MODEL_LEN tokens
    user = [{"role": "user", "content": "x"}]
    return {
        "fields": {
            "n": [0, -1, 129, 1.5, "2", None, [1], True], "temperature": [-0.1, 2.5, "hot", [], True],
            "top_p": [0, -0.5, 1.5, "x"], "top_k": [-2, -100, 2.5, "5"], "min_p": [-0.1, 1.5, "x"],
            "max_tokens": [0, -1, 10**7, 2.5, "8", {}], "min_tokens": [-1, 1.5, 10**6, "1"],
            "logprobs": [-1, 21, 10**9, "3", 2.5], "seed": [2**64, -(2**64), 1.5, "7"],
            "presence_penalty": [2.5, -3, "x"], "frequency_penalty": [-2.5, 9, None],
            "repetition_penalty": [0, -1, "x"],
            "stop": ["", [""], ["a", ""], 5, [5], {"a": 1}],
            "stop_token_ids": [[-1], [vocab], [10**7], [2**63], "1", [1.5]],
            "priority": [1, -5, 1.5, "1"], "stream": ["yes", 1, None], "echo": ["x", 2], "best_of": [2, 0, 200, "1"],
            "cache_salt": ["", 5], "user": [5, []], "stream_options": [{"include_usage": True}, {"x": 1}, "yes"],
            "suffix": ["x"], "logit_bias": [{"5": 101}, {"x": 1}, {str(vocab): 1}, [1]],
            "allowed_token_ids": [[], [vocab], [-1]], "bad_words": [[""], "x", [5]], "tools": [[{}], "x", [{"type": "function", "function": {"name": "bad name!"}}]],
            "response_format": [{"type": "bogus"}, "json", {"type": "json_schema"}],
            "guided_regex": ["a(b", "", 5], "guided_choice": [[], [""], "a"], "structured_outputs": [{}, {"regex": "a", "choice": ["a"]}],
        },
        "prompt": ["", [], [[]], ["a", ""], [1, "a"], [[1], "a"], [[[1]]], [vocab], [10**7], [-1], [[5], [vocab + 3]],
                   [2**63], 5, None, {"text": "x"}, [1.5, 2.5], True, long_text, list(range(1, MAX_MODEL_LEN + 5))],
        "messages": [[], "hi", [{}], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
                     [{"role": "tool", "content": 5}], [{"role": "user", "content": "x", "tool_calls": [{}]}],
                     [{"role": "user", "content": long_text}]],
        "json": [b"{", b"}{", b"null", b"[]", b"[1, 2]", b'"s"', b"", b"\xff\xfe\x00", b'{"prompt": NaN}',
                 b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}',
                 b'{"prompt": "x", "repetition_penalty": 1e999}', b'{"prompt": "x", "top_p": -Infinity}',
                 b'{"prompt": "x", "max_tokens": 1e999}', b'{"prompt": "x", "n": 1e400}', b'{"prompt": "x",}',
                 b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": NaN}'],
        "rule": [
            (C, {"prompt": "x", "min_tokens": 5, "max_tokens": 2}), (C, {"prompt": "x", "best_of": 1, "n": 2}),
            (C, {"prompt": "x", "max_tokens": 0}), (C, {"prompt": "x", "stream_options": {}}),
            # the out-of-vocabulary stop id that used to fail the whole batch inside the sampler
            (C, {"prompt": "x", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [10**7]}),
            (C, {"prompt": ["a", "b", "c"], "n": 100}), (C, {"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}),
            (C, {"prompt": "x", "stop": ["s" * (MAX_STOP_CHARS + 1)]}), (C, {"prompt": "x", "model": "gpt-4"}),
            (C, {"prompt": "the cat", "max_tokens": MAX_MODEL_LEN}),
            (CH, {"messages": user, "top_logprobs": 2}),
            (CH, {"messages": user, "max_tokens": 3, "max_completion_tokens": 4}),
            (CH, {"messages": user, "continue_final_message": True}),
            (CH, {"messages": user, "chat_template_kwargs": {"messages": []}}),
            (CH, {"messages": user, "model": "gpt-4"}),
            ("/tokenize", {}), ("/tokenize", {"prompt": "x", "messages": [{"role": "user"}]}),
            ("/tokenize", {"prompt": ""}), ("/tokenize", {"messages": []}), ("/detokenize", {"tokens": [vocab]}),
            ("/detokenize", {"tokens": [10**7, -1]}), ("/detokenize", {}),
        ],
    }


def _bad_case(material: dict, kind: str, path: str, base: dict, choice: Any) -> tuple[str, str, Any, Any]:
    """(kind, path, json body, raw bytes) of one bad request built from `choice` of `material[kind]`."""
    if kind == "json":
        return "bad:json", path, None, choice
    if kind == "rule":
        return "bad:rule", choice[0], choice[1], None
    if kind in ("prompt", "messages"):
        return f"bad:{kind}", path, {**base, kind: choice}, None
    field, value = choice
    body = {**base, field: value}
    if field == "best_of":
        body["n"] = 3  # best_of >= n (without stream) would be fine
    if field == "stream_options":
        body["stream"] = False  # stream_options is fine with stream=true
    return f"bad:{field}", path, body, None


def _systematic_bad_cases(vocab: int) -> list[tuple[str, str, Any, Any]]:
    """Every bad value once (completions; the fields chat shares also on chat)."""
    m = _bad_material(vocab)
    comp = {"prompt": "the cat", "max_tokens": 4}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = []
    for field, values in m["fields"].items():
        for value in values:
            cases.append(_bad_case(m, "fields", C, comp, (field, value)))
            if field not in ("echo", "best_of", "suffix", "logprobs"):  # completions-only (chat: unknown or bool)
                cases.append(_bad_case(m, "fields", CH, chat, (field, value)))
    cases += [_bad_case(m, "prompt", C, comp, p) for p in m["prompt"]]
    cases += [_bad_case(m, "messages", CH, chat, p) for p in m["messages"]]
    cases += [_bad_case(m, "json", path, None, raw) for raw in m["json"] for path in (C, CH, "/tokenize")]
    cases += [_bad_case(m, "rule", "", None, rule) for rule in m["rule"]]
    return cases


def _systematic_valid_cases(vocab: int) -> list[tuple[str, str, Any, Any]]:
    """Valid bodies at the edges of what is allowed: each must be served (200) correctly."""
    user = [{"role": "user", "content": "the cat"}]
    cases = [
        (C, {"prompt": "the cat", "n": 128, "max_tokens": 2}), (C, {"prompt": ["a", "b"], "n": 128, "max_tokens": 1}),
        (C, {"prompt": "the cat", "logprobs": 20, "n": 2, "max_tokens": 3, "stream": True}),
        (C, {"prompt": [vocab - 1, 0, 1, 2], "stop_token_ids": [vocab - 1, 0], "min_tokens": 2, "max_tokens": 3}),
        (C, {"prompt": list(range(3, 3 + MAX_MODEL_LEN - 1)), "max_tokens": 1}),
        (C, {"prompt": [[5, 6], [7]], "echo": True, "max_tokens": 2}),
        (C, {"prompt": "the cat", "stop": ["s"] * MAX_STOP_STRINGS, "max_tokens": 3}),
        (C, {"prompt": "the cat", "stream": True, "stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}}),
        (C, {"prompt": "the cat", "best_of": 3, "n": 3, "max_tokens": 2, "seed": -(2**63), "temperature": 2}),
        (C, {"prompt": "the cat", "max_tokens": 4, "top_k": 1, "top_p": 1e-9, "min_p": 1, "repetition_penalty": 1e-3}),
        (CH, {"messages": user, "logprobs": True, "top_logprobs": 20, "max_tokens": 2, "stream": True}),
        (CH, {"messages": [*user, {"role": "assistant", "content": "it"}], "add_generation_prompt": False,
              "continue_final_message": True, "max_completion_tokens": 2}),
        (CH, {"messages": user, "max_tokens": 3, "max_completion_tokens": 3, "n": 4, "seed": 2**63 - 1}),
        ("/detokenize", {"tokens": list(range(vocab))}),
    ]
    return [("valid:edge", path, body, None) for path, body in cases]


def _fuzz_cases(vocab: int):
    """Random (kind, path, body, raw): "valid:..." (must be a 200 with a well-formed answer) or a random bad
    value on a random valid body ("bad:...", must be an OpenAI 4xx)."""
    from hypothesis import strategies as st

    m = _bad_material(vocab)
    text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=24)
    ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)
    prompt = st.one_of(text, st.lists(text, min_size=1, max_size=3), ids, st.lists(ids, min_size=1, max_size=3))
    messages = st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"])},
        optional={"content": st.one_of(st.none(), text, st.lists(st.fixed_dictionaries(
            {"type": st.just("text"), "text": text}), max_size=2))}), min_size=1, max_size=3)
    sampling = {"n": st.integers(1, 3), "temperature": st.one_of(st.none(), st.floats(0, 2)),
                "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
                "seed": st.integers(-(2**63), 2**63 - 1), "presence_penalty": st.floats(-2, 2),
                "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.1, 3),
                "stop": st.one_of(text, st.lists(text, max_size=4)),
                "stop_token_ids": st.lists(st.integers(0, vocab - 1), max_size=4), "ignore_eos": st.booleans(),
                "stream": st.booleans(), "priority": st.just(0), "skip_special_tokens": st.booleans(),
                "include_stop_str_in_output": st.booleans(), "user": text, "cache_salt": text}
    max_tokens = st.integers(1, 12)
    completion = st.fixed_dictionaries({"prompt": prompt, "max_tokens": max_tokens}, optional={
        **sampling, "logprobs": st.integers(0, 20), "echo": st.booleans()})
    chat = st.fixed_dictionaries({"messages": messages, "max_tokens": max_tokens}, optional={
        **sampling, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}).map(
        lambda b: {**b, "logprobs": True} if "top_logprobs" in b else b)  # top_logprobs needs logprobs
    flat_fields = [(f, v) for f, values in m["fields"].items() for v in values]

    @st.composite
    def case(draw):
        kind = draw(st.sampled_from(["valid:completion", "valid:chat", "valid:completion", "valid:chat",
                                     "valid:tokenize", "fields", "prompt", "messages", "json", "rule"]))
        if kind.startswith("valid:"):
            if kind == "valid:tokenize":
                body = draw(st.one_of(st.fixed_dictionaries({"prompt": text}),
                                      st.fixed_dictionaries({"messages": messages}),
                                      st.fixed_dictionaries({"tokens": ids})))
                return kind, "/detokenize" if "tokens" in body else "/tokenize", body, None
            path = C if kind == "valid:completion" else CH
            body = dict(draw(completion if path == C else chat))
            if draw(st.booleans()):
                body["min_tokens"] = draw(st.integers(0, body["max_tokens"]))
            return kind, path, body, None
        path = CH if kind == "messages" else C if kind == "prompt" else draw(st.sampled_from([C, CH]))
        base = draw(completion if path == C else chat)
        choice = draw(st.sampled_from(flat_fields if kind == "fields" else m[kind]))
        if kind == "fields" and path == CH and choice[0] in ("echo", "best_of", "suffix", "logprobs"):
            path, base = C, draw(completion)
        return _bad_case(m, kind, path, base, choice)

    return case()


FUZZ_EXAMPLES = 200


def _check_ok(path: str, body: dict, r: httpx.Response) -> None:
    if path == "/tokenize":
        assert r.json()["count"] == len(r.json()["tokens"]) > 0
        return
    if path == "/detokenize":
        assert isinstance(r.json()["prompt"], str)
        return
    prompts = body.get("prompt")
    num_prompts = len(prompts) if isinstance(prompts, list) and isinstance(prompts[0], (str, list)) else 1
    expected = num_prompts * body.get("n", 1)
    if body.get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), [c for c in chunks if "error" in c]  # a hidden failure
        finished = {ch["index"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")}
        assert finished == set(range(expected)), (finished, expected)
    else:
        data = r.json()
        assert [c["index"] for c in data["choices"]] == list(range(expected))
        assert all(c["finish_reason"] in ("stop", "length") for c in data["choices"]), data["choices"]


class _Victims:
    """A thread streaming well-formed greedy completions back to back until stopped; records broken ones."""

    BODY: ClassVar[dict] = {"prompt": "the cat reads", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                            "n": 2, "stream": True, "stream_options": {"include_usage": True}}

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.done, self.errors = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(C, json=self.BODY)
                    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                    chunks = [json.loads(e) for e in events[:-1]]
                    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
                    usage = chunks[-1].get("usage") or {}
                    ok = (r.status_code == 200 and events[-1] == "[DONE]" and reasons == ["length", "length"]
                          and usage.get("completion_tokens") == 2 * self.BODY["max_tokens"])
                    if not ok:
                        self.errors.append((r.status_code, r.text[-500:]))
                except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
                    self.errors.append(repr(exc))
                self.done += 1


def test_fuzz_request_bodies(conf_server, vocab_size):
    """Every bad value once, then FUZZ_EXAMPLES random valid / bad bodies (hypothesis); never a 5xx, valid
    bodies answered correctly, and the server gives the same greedy text afterwards."""
    from hypothesis import HealthCheck, given, settings

    url = conf_server.url
    before = _greedy_text(url)
    kinds: collections.Counter = collections.Counter()
    statuses: collections.Counter = collections.Counter()
    start = time.monotonic()

    with httpx.Client(base_url=url, timeout=120) as client:
        def send(example) -> None:
            kind, path, body, raw = example
            if raw is not None:
                r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            else:
                r = client.post(path, json=body)
            kinds[kind] += 1
            statuses[r.status_code // 100 * 100] += 1
            assert r.status_code < 500, (kind, path, body, raw, r.status_code, r.text[:500])
            if kind.startswith("valid:"):
                assert r.status_code == 200, (kind, path, body, r.status_code, r.text[:500])
                _check_ok(path, body, r)
            else:
                assert 400 <= r.status_code < 500, (kind, path, body, raw, r.status_code, r.text[:300])
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, error
                assert isinstance(error["message"], str) and error["message"] and error["type"], error

        # One bad request fails alone: streams keep running next to the bad-value sweep, and each must end
        # normally with all its tokens (no error chunk, no cut).
        victims = _Victims(url)
        victims.start()
        try:
            for example in _systematic_valid_cases(vocab_size) + _systematic_bad_cases(vocab_size):
                send(example)
        finally:
            victims.stop()
        assert victims.done >= 1 and not victims.errors, (victims.done, victims.errors[:3])

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_fuzz_cases(vocab_size))
        def run(example):
            send(example)

        run()

    elapsed = time.monotonic() - start
    bad = {k[4:]: v for k, v in sorted(kinds.items()) if k.startswith("bad:")}
    valid = sum(v for k, v in kinds.items() if k.startswith("valid:"))
    print(f"\nfuzz: {sum(kinds.values())} requests in {elapsed:.0f} s: {valid} valid, {sum(bad.values())} bad "
          f"({len(bad)} kinds: {bad}); statuses {dict(sorted(statuses.items()))}; 5xx: {statuses[500]}; "
          f"{victims.done} concurrent victim streams intact")
    assert statuses[500] == 0
    assert valid >= FUZZ_EXAMPLES // 5, kinds
    assert conf_server.alive() and httpx.get(url + "/health", timeout=30).status_code == 200
    assert _greedy_text(url) == before
    assert "Traceback" not in conf_server.log(), conf_server.log()[-3000:]
