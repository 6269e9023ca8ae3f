"""What one valid request may cost (issue 47, findings 11 and 12): stop_token_ids and n x max_tokens x logprobs
are bounded before any work, and a structured-output grammar is compiled once per request (not once per
sequence), on the compiler's own thread (never the engine's nor the event loop's), within a size and a time limit,
into a cache bounded in bytes. Real engine, real llguidance; the limits also over HTTP with the official client."""
from __future__ import annotations

import threading

import httpx
import llguidance
import openai
import pytest
from openai import OpenAI

from server_helpers import API_KEY, ServerProcess, auth_headers

from pagedserve import LLM, SamplingParams
from pagedserve.config import RequestLimits
from pagedserve.engine.grammar_compiler import GrammarCompiler
from pagedserve.sampling_params import StructuredOutputsParams as SO

pytestmark = pytest.mark.usefixtures("one_thread")

CHOICES = [f"option {i}" for i in range(40)]


class MatcherConstructions:
    """Stands in for llguidance.LLMatcher: builds the real one, noting the thread that built it."""
    threads: list[str] = []

    def __new__(cls, *args, **kwargs):
        cls.threads.append(threading.current_thread().name)
        return REAL_MATCHER(*args, **kwargs)


REAL_MATCHER = llguidance.LLMatcher
MatcherConstructions.validate_grammar = staticmethod(REAL_MATCHER.validate_grammar)


def test_n16_compiles_the_grammar_once_off_the_callers_thread(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(llguidance, "LLMatcher", MatcherConstructions)
    MatcherConstructions.threads = []
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=128, max_model_len=256, num_threads=1)
    try:
        params = SamplingParams(n=16, temperature=1.0, seed=3, max_tokens=8, structured_outputs=SO(choice=CHOICES))
        out = llm.generate(["pick one:"], params, use_tqdm=False)[0]
        assert {c.text for c in out.outputs} <= set(CHOICES) and len(out.outputs) == 16
        assert len(MatcherConstructions.threads) == 1, MatcherConstructions.threads  # not 16
        assert MatcherConstructions.threads[0].startswith("pagedserve-grammar-compile")
        llm.generate(["again:"], params, use_tqdm=False)  # the same constraint: from the cache
        assert len(MatcherConstructions.threads) == 1
    finally:
        llm.llm_engine.shutdown()


def test_grammar_cache_is_bounded_in_bytes(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=128, num_threads=1)
    try:
        compiler = GrammarCompiler(llm.llm_engine.structured_output, RequestLimits(grammar_cache_bytes=20_000))
        sizes = []
        for i in range(12):
            compiled = compiler.compile(SO(choice=[f"word{i}-{j}" for j in range(60)]))
            sizes.append(compiled.nbytes)
            assert compiler.cache_bytes <= 20_000
        assert 0 < len(compiler) < 12 and compiler.num_compiled == 12
        assert compiler.cache_bytes == sum(sizes[-len(compiler):])  # the most recent ones, counted in bytes
        with pytest.raises(ValueError, match="grammar-bytes"):
            GrammarCompiler(llm.llm_engine.structured_output, RequestLimits(max_grammar_bytes=100)).compile(
                SO(choice=CHOICES))
    finally:
        llm.llm_engine.shutdown()


# ----------------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def limited_server(tiny_model_dir):
    server = ServerProcess(tiny_model_dir("llama"), (
        "--num-kv-blocks", "256", "--max-model-len", "512", "--max-num-seqs", "16", "--api-key", API_KEY,
        "--max-logprob-entries", "1000", "--grammar-compile-timeout", "0.05", "--max-grammar-bytes", "2000000"))
    yield server
    assert server.stop() == 0


def _client(server) -> tuple[OpenAI, str]:
    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    return client, client.models.list().data[0].id


def test_stop_token_ids_and_logprob_entries_are_bounded(limited_server):
    client, model = _client(limited_server)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"stop_token_ids": [5] * 257})
    assert err.value.body["param"] == "stop_token_ids" and err.value.body["code"] == "too_many_stop_token_ids"
    client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"stop_token_ids": [5] * 256})

    with pytest.raises(openai.BadRequestError) as err:  # 2 x 100 x (5 + 1) = 1200 > 1000
        client.completions.create(model=model, prompt="hi", n=2, logprobs=5, max_tokens=100)
    assert err.value.body["param"] == "logprobs" and "--max-logprob-entries" in err.value.body["message"]
    out = client.completions.create(model=model, prompt="hi", n=1, logprobs=5, max_tokens=100,
                                    extra_body={"ignore_eos": True})  # 600: fine
    assert len(out.choices[0].logprobs.tokens) == 100


def test_grammar_compile_time_and_size_are_bounded(limited_server):
    client, model = _client(limited_server)
    slow = [f"choice number {i} abc" for i in range(20000)]  # ~0.5 s to compile here, far past 0.05 s
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="pick", max_tokens=4, n=16,
                                  extra_body={"structured_outputs": {"choice": slow}})
    assert err.value.body["code"] == "grammar_compile_timeout" and err.value.body["param"] == "structured_outputs.choice"
    assert httpx.get(limited_server.url + "/health", timeout=30).status_code == 200
    huge = [f"a rather long choice value number {i}" for i in range(60000)]  # > 2 MB
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="pick", max_tokens=4, extra_body={"structured_outputs": {"choice": huge}})
    assert err.value.body["code"] == "grammar_too_large"
    out = client.completions.create(model=model, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"  # the server serves on
    r = httpx.get(limited_server.url + "/metrics", headers=auth_headers(), timeout=30)
    assert r.status_code == 200
