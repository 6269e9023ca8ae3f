"""Speculative decoding through the real server and the official `openai` client: `--speculative-config`,
outputs equal to the plain server's (streamed and not), the spec_decode metrics, and `bench serve`'s summary."""
from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import MAIN_ARGS, get_server, metric_value

from pagedserve.benchmarks.serve import format_spec_decode, scrape_spec_decode_counters, spec_decode_summary

pytestmark = pytest.mark.server

openai = pytest.importorskip("openai")

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    plain = get_server(model_dir)
    spec = get_server(model_dir, MAIN_ARGS + ("--speculative-config", json.dumps(SPEC)))
    return plain, spec


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test-key-123")


def test_server_with_ngram_speculation_returns_the_plain_servers_tokens(servers, tiny_tokenizer):
    plain, spec = servers
    prompts = ["a b c d a b c d a b", "the cat sat on the mat and the cat sat on the", "1 2 3 1 2 3 1 2"]
    before = scrape_spec_decode_counters(spec.url)
    for prompt in prompts:
        args = dict(prompt=prompt, max_tokens=24, temperature=0, logprobs=1)
        want = _client(plain).completions.create(**{**args, "model": _model(plain)})
        got = _client(spec).completions.create(**{**args, "model": _model(spec)})
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
        assert got.usage.completion_tokens == want.usage.completion_tokens == 24
        stream = _client(spec).completions.create(**{**args, "model": _model(spec)}, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.choices[0].text
    summary = spec_decode_summary(before, scrape_spec_decode_counters(spec.url))
    assert summary["num_drafts"] > 0 and summary["num_draft_tokens"] >= summary["num_drafts"]
    assert 1.0 <= summary["mean_acceptance_length"] <= 1 + SPEC["num_speculative_tokens"]
    assert "Acceptance rate" in format_spec_decode(summary)
    text = httpx.get(spec.url + "/metrics", timeout=60).text
    assert metric_value(text, "pagedserve:spec_decode_num_accepted_tokens_total") == summary["num_accepted_tokens"] \
        + (before or {}).get("spec_decode_num_accepted_tokens", 0)
    assert not any((scrape_spec_decode_counters(plain.url) or {}).values())  # no speculation, nothing counted


def _model(server) -> str:
    return httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer test-key-123"}, timeout=60).json()["data"][0]["id"]


def test_bad_speculative_config_fails_startup_with_a_clear_message(tiny_model_dir):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(tiny_model_dir("llama")),
                           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "num_speculative_tokens" in proc.stderr + proc.stdout
