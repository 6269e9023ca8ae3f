"""`pagedserve diagnose` (the scheduler reader) on three real runs, each bound by one basic behaviour: a tiny KV
pool under many requests, long prompts arriving among running decodes under a large token budget, and a decode
batch held to a few seats. Each run's events come from the real engine; the verdict and the advice must name
the behaviour and the flag."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from test_server_helpers import API_KEY, REPO_ROOT

from test_engine_boundary import prompt  # seeded random token ids

from pagedserve import SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.metrics.diagnose import diagnose, format_report

pytestmark = pytest.mark.usefixtures("one_thread")


def record(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], int]]], max_steps: int = 3000) -> list:
    """Step the engine, adding requests at the steps `arrivals` names; returns every recorded event."""
    engine.events.subscribe()
    step = 0
    while step < max_steps:
        for rid, tokens, max_tokens in arrivals.pop(step, ()):
            engine.add_request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        if not engine.has_unfinished_requests() and not arrivals:
            break
        engine.step()
        step += 1
    engine.events.unsubscribe()
    return [json.loads(line) for _, _, line in engine.events.ring.since(0)[0]]


def make_engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), num_threads=1, dtype="float32", **kwargs))


def test_tiny_kv_pool_is_kv_memory_bound(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir("llama"), num_kv_blocks=24, block_size=4, max_model_len=256,
                         max_num_batched_tokens=64, enable_prefix_caching=False,
                         trace_file=str(tmp_path / "kv.jsonl"))
    events = record(engine, {0: [(f"r{i}", prompt(30, i), 20) for i in range(10)]})
    result = diagnose(events)
    assert result.bottleneck == "kv_memory", format_report(result)
    assert result.stats.preemptions == engine.scheduler.num_preemptions > 0
    assert any("--kv-cache-memory" in a for a in result.advice) and any("--max-num-seqs" in a for a in result.advice)
    # the CLI reads the same run from its trace file, as JSON for machines
    engine.events.close()
    out = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "diagnose", "--trace",
                          str(tmp_path / "kv.jsonl"), "--json"], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bottleneck"] == "kv_memory" and report["stats"]["preemptions"] == result.stats.preemptions


def test_long_prompts_among_decodes_are_token_budget_bound(tiny_model_dir):
    """Eight requests decode; 700-token prompts arrive now and then and, under a 2048-token budget, each is
    computed in one step with the decodes: those steps take many decode steps' time."""
    model = tiny_model_dir("llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
    engine = make_engine(model, num_kv_blocks=512, block_size=16, max_model_len=1024, max_num_batched_tokens=2048)
    arrivals = {0: [(f"d{i}", prompt(8, i), 60) for i in range(8)]}
    for k, step in enumerate((10, 25, 40)):
        arrivals[step] = [(f"long{k}", prompt(700, 100 + k), 4)]
    result = diagnose(record(engine, arrivals))
    assert result.bottleneck == "token_budget", format_report(result)
    assert result.stats.stall_steps >= 2 and result.stats.max_prefill_tokens_in_mixed_step >= 700
    assert any("--max-num-batched-tokens" in a for a in result.advice)
    assert any("--long-prefill-token-threshold" in a for a in result.advice)


def test_few_seats_saturated_decode_is_batch_size_bound(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), num_kv_blocks=256, block_size=4, max_model_len=256,
                         max_num_seqs=4)
    result = diagnose(record(engine, {0: [(f"r{i}", prompt(8, i), 30) for i in range(16)]}))
    assert result.bottleneck == "batch_size", format_report(result)
    assert result.stats.seats_full_frac > 0.5 and result.stats.kv_usage_max < 0.5
    assert any("raise --max-num-seqs above 4" in a for a in result.advice)


def test_no_events_is_no_data_and_missing_config_is_an_error():
    with pytest.raises(ValueError, match="no config"):
        diagnose([])
    config = {"scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64}, "cache": {}}
    assert diagnose([], config).bottleneck == "no_data"


def test_diagnose_url_listens_to_a_running_server(server):
    """`diagnose --url` reads the served config and the steps of live traffic (the verdict depends on the load)."""
    from openai import OpenAI

    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "diagnose", "--url", server.url, "--api-key", API_KEY,
           "--duration", "6", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:  # traffic until diagnose has listened its 6 s
        client.completions.create(model=model, prompt="a b c", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["config"]["scheduler"]["max_num_seqs"] == 64 and report["config"]["cache"]["num_blocks"] == 256
    assert report["stats"]["num_steps"] >= 15 and report["stats"]["admissions"] >= 1
    assert report["bottleneck"] in ("none", "kv_memory", "token_budget", "batch_size", "compute")
    bad = subprocess.run(cmd[:6] + ["--duration", "1"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert bad.returncode == 2 and "needs an API key" in bad.stderr
