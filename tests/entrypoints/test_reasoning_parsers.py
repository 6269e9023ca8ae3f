"""--reasoning-parser (issue 53 item 3): the parsers unit-wise (streamed deltas, split anywhere, concatenate to the
whole answer's split), and over loopback with the official `openai` client, a chat answer forced (guided_regex)
to hold <think>...</think> comes back with reasoning_content, whole and as streamed deltas."""
from __future__ import annotations

import pytest

from pagedserve.entrypoints.openai.reasoning import make_reasoning_parser

CASES = [
    ("qwen3", None, "<think>step one</think>\n\nthe answer", "step one", "\n\nthe answer"),
    ("qwen3", None, "no thinking here", "", "no thinking here"),
    ("qwen3", {"enable_thinking": False}, "<think>x</think>y", "", "<think>x</think>y"),
    ("deepseek_r1", None, "because</think>42", "because", "42"),
    ("deepseek_r1", None, "<think>because</think>42", "because", "42"),
    ("deepseek_r1", None, "unfinished <thi", "unfinished <thi", ""),
    ("gpt_oss", None, "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>hi",
     "hmm", "hi"),
]


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", CASES)
def test_split_whole_and_streamed_in_every_piece_size(name, kwargs, text, reasoning, content):
    whole = make_reasoning_parser(name, kwargs).split(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for size in (1, 2, 3, 7):
        parser = make_reasoning_parser(name, kwargs)
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        outs = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert "".join(o.reasoning for o in outs) == reasoning
        assert "".join(o.content for o in outs) == content


def test_no_parser_without_the_flag():
    assert make_reasoning_parser(None, None) is None


@pytest.fixture(scope="module")
def reasoning_servers(tiny_model_dir):
    """The two parsers' servers, started together (server_helpers is imported here: the parser tests above start
    none and stay in the fast tier); each must exit cleanly."""
    from server_helpers import start_servers

    model_dir, args = tiny_model_dir("llama"), ("--num-kv-blocks", "64", "--max-model-len", "256")
    # qwen3: the regex writes the thinking (a random model would not): constraints apply to the reasoning too there
    servers = start_servers((model_dir, (*args, "--reasoning-parser", "qwen3", "--structured-outputs-config",
                                         '{"enable_in_reasoning": true}')),
                            (model_dir, (*args, "--reasoning-parser", "deepseek_r1")))
    yield dict(zip(("qwen3", "deepseek_r1"), servers))
    for server in servers:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.mark.server
def test_reasoning_content_over_http_whole_and_streamed(reasoning_servers):
    openai = pytest.importorskip("openai")

    client = openai.OpenAI(base_url=reasoning_servers["qwen3"].url + "/v1", api_key="none")
    args = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}],
                max_tokens=40, temperature=0, extra_body={"guided_regex": "<think>[a-z]{3}</think>[a-z]{3}"})
    msg = client.chat.completions.create(**args).choices[0].message
    reasoning, content = msg.model_extra["reasoning_content"], msg.content
    assert len(reasoning) == 3 and len(content) == 3 and "<think>" not in content
    got_r, got_c = "", ""
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            got_r += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            got_c += choice.delta.content or ""
    assert (got_r, got_c) == (reasoning, content)


@pytest.mark.server
def test_constraints_wait_for_the_end_of_reasoning_over_http(reasoning_servers):
    """Default (vLLM's): with a parser the constraint starts after the end-of-thinking marker. deepseek_r1's answer
    starts in reasoning and this random model never writes `</think>`: the output is the unconstrained one; with
    thinking switched off the constraint holds from the first token."""
    import re

    openai = pytest.importorskip("openai")

    client = openai.OpenAI(base_url=reasoning_servers["deepseek_r1"].url + "/v1", api_key="none")
    args = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}],
                max_tokens=8, temperature=0)
    regex = {"guided_regex": r"[A-Z]{2}-\d{3}"}
    free = client.chat.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].message
    thinking = client.chat.completions.create(**args, extra_body={**regex, "ignore_eos": True}).choices[0].message
    assert (thinking.model_extra["reasoning_content"], thinking.content) == \
        (free.model_extra["reasoning_content"], free.content)
    off = client.chat.completions.create(**args, extra_body={**regex, "chat_template_kwargs": {
        "enable_thinking": False}}).choices[0].message
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", off.content), off.content
