"""`pagedserve diagnose` (the scheduler reader) on three real runs, each bound by one basic behaviour: a tiny KV
pool under many requests, long prompts arriving among running decodes under a large token budget, and a decode
batch held to a few seats. Each run's events come from the real engine; the verdict and the advice must name
the behaviour and the flag."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from server_helpers import API_KEY, REPO_ROOT, start_servers

from test_engine_boundary import prompt  # seeded random token ids

from pagedserve import SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.diagnose import read_server
from pagedserve.metrics.diagnose import Diagnosis, diagnose, format_report
from pagedserve.metrics.server_metrics import metrics_evidence, metrics_window

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_thread")]


@dataclass(frozen=True)
class Scenario:
    """One run bound by one behaviour: the tiny model, the engine's settings (EngineArgs fields, which are also the
    `serve` flags), the traffic (requests by the step they arrive at) and the verdict with the flags its advice
    must name."""
    model: dict[str, Any]
    engine: dict[str, Any]
    arrivals: dict[int, list[tuple[str, list[int], int]]]
    bottleneck: str
    advice: tuple[str, ...]

    def serve_args(self) -> tuple[str, ...]:
        args = ["--api-key", API_KEY]
        for name, value in self.engine.items():
            flag = "--" + name.replace("_", "-")
            args += [flag] if value is True else ["--no-" + flag[2:]] if value is False else [flag, str(value)]
        return tuple(args)

    def check(self, result: Diagnosis) -> None:
        assert result.bottleneck == self.bottleneck, format_report(result)
        for flag in self.advice:
            assert any(flag in a for a in result.advice), (flag, result.advice)


# A 24-block pool; each request grows to 20 of them, so any two that overlap preempt one another. (With 13 blocks
# each, as before, a loaded machine could deliver the live test's requests so far apart that none overlapped.)
TINY_KV_POOL = Scenario(
    {}, dict(num_kv_blocks=24, block_size=4, max_model_len=256, max_num_batched_tokens=64, enable_prefix_caching=False),
    {0: [(f"r{i}", prompt(30, i), 50) for i in range(10)]}, "kv_memory", ("--kv-cache-memory", "--max-num-seqs"))
# Eight requests decode; long prompts arrive now and then and, under a 2048-token budget, each is computed in one
# step with the decodes: those steps take many decode steps' time. The live test times the later arrivals by the
# first request's streamed chunks, and a lagging client gets merged chunks, so chunk 40 may come after the 60th
# token (a CI run once read "none" with no ITL spike at all, as if the long prompts had missed the decodes): they
# arrive by chunk 25 of 60. A stall must outlast two slow (p90) decode steps, and on a loaded CI machine (two
# runs at once) the p90 decode step once reached half of a 700-token mixed step's 8 ms: 1800-token prompts. Two
# stalls make the verdict; with three long prompts, a loaded run once saw too few (verdict "none"): five of them.
LONG_PROMPT_TOKENS = 1800
LONG_PROMPTS_AMONG_DECODES = Scenario(
    dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, max_position_embeddings=2048),
    dict(num_kv_blocks=512, block_size=16, max_model_len=2048, max_num_batched_tokens=2048),
    {0: [(f"d{i}", prompt(8, i), 60) for i in range(8)],
     **{step: [(f"long{k}", prompt(LONG_PROMPT_TOKENS, 100 + k), 4)] for k, step in enumerate((5, 10, 15, 20, 25))}},
    "token_budget", ("--max-num-batched-tokens", "--long-prefill-token-threshold"))
# Two seats: the verdict needs decode batches below B_sat (where step time starts to grow with the batch). B_sat
# comes from a line fitted to the step times of each batch size, which a loaded machine can skew; with 4 seats a
# CI run once measured B_sat ~ 3.8 ("compute"), with 2 it would have to read a 2-sequence step 1.5x a 1-sequence one.
FEW_SEATS = Scenario(
    {}, dict(num_kv_blocks=256, block_size=4, max_model_len=256, max_num_seqs=2),
    {0: [(f"r{i}", prompt(8, i), 30) for i in range(16)]}, "batch_size", ("raise --max-num-seqs above 2",))
SCENARIOS = {"kv_memory": TINY_KV_POOL, "token_budget": LONG_PROMPTS_AMONG_DECODES, "batch_size": FEW_SEATS}


def record(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], int]]], max_steps: int = 3000) -> list:
    """Step the engine, adding requests at the steps `arrivals` names; returns every recorded event."""
    pending = dict(arrivals)
    engine.events.subscribe()
    step = 0
    while step < max_steps:
        for rid, tokens, max_tokens in pending.pop(step, ()):
            engine.add_request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        if not engine.has_unfinished_requests() and not pending:
            break
        engine.step()
        step += 1
    engine.events.unsubscribe()
    return [json.loads(line) for _, _, line in engine.events.ring.since(0)[0]]


def run_offline(tiny_model_dir, scenario: Scenario, **kwargs) -> tuple[LLMEngine, Diagnosis]:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir("llama", **scenario.model)),
                                                   num_threads=1, dtype="float32", **scenario.engine, **kwargs))
    result = diagnose(record(engine, scenario.arrivals))
    scenario.check(result)
    return engine, result


def test_tiny_kv_pool_is_kv_memory_bound(tiny_model_dir, tmp_path):
    engine, result = run_offline(tiny_model_dir, TINY_KV_POOL, trace_file=str(tmp_path / "kv.jsonl"))
    assert result.stats.preemptions == engine.scheduler.num_preemptions > 0
    # the CLI reads the same run from its trace file, as JSON for machines (no /metrics there)
    engine.events.close()
    out = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "diagnose", "--trace",
                          str(tmp_path / "kv.jsonl"), "--json"], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bottleneck"] == "kv_memory" and report["stats"]["preemptions"] == result.stats.preemptions
    assert report["metrics"] is None


def test_long_prompts_among_decodes_are_token_budget_bound(tiny_model_dir):
    _, result = run_offline(tiny_model_dir, LONG_PROMPTS_AMONG_DECODES)
    assert result.stats.stall_steps >= 2 and result.stats.max_prefill_tokens_in_mixed_step >= LONG_PROMPT_TOKENS


def test_few_seats_saturated_decode_is_batch_size_bound(tiny_model_dir):
    _, result = run_offline(tiny_model_dir, FEW_SEATS)
    assert result.stats.seats_full_frac > 0.5 and result.stats.kv_usage_max < 0.5


def test_no_events_is_no_data_and_missing_config_is_an_error():
    with pytest.raises(ValueError, match="no config"):
        diagnose([])
    config = {"scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64}, "cache": {}}
    assert diagnose([], config).bottleneck == "no_data"


def test_metrics_window_takes_counter_and_histogram_changes():
    def scrape(preemptions: float, itl_buckets: tuple[float, float, float], waiting: float) -> str:
        lines = ["# TYPE pagedserve:num_preemptions counter",
                 f'pagedserve:num_preemptions_total{{model_name="m"}} {preemptions}',
                 "# TYPE pagedserve:num_requests_waiting gauge",
                 f'pagedserve:num_requests_waiting{{model_name="m"}} {waiting}',
                 "# TYPE pagedserve:inter_token_latency_seconds histogram"]
        lines += [f'pagedserve:inter_token_latency_seconds_bucket{{le="{le}",model_name="m"}} {n}'
                  for le, n in zip(("0.01", "0.1", "+Inf"), itl_buckets)]
        lines += [f'pagedserve:inter_token_latency_seconds_count{{model_name="m"}} {itl_buckets[-1]}',
                  f'pagedserve:inter_token_latency_seconds_sum{{model_name="m"}} {itl_buckets[-1] * 0.005}']
        return "\n".join(lines) + "\n"

    # in the window: 3 preemptions; 100 ITL observations of 5 ms each, of which 98 under 10 ms and 2 under 100 ms
    m = metrics_window(scrape(2, (10, 10, 10), 5), scrape(5, (108, 110, 110), 1))
    assert (m.preemptions, m.requests_waiting, m.prefix_cache_queries) == (3, 1, 0)
    assert m.itl_ms_mean == pytest.approx(5.0) and m.itl_ms_p99_bound == pytest.approx(100.0)
    assert m.ttft_ms_mean is None and len(metrics_evidence(m)) == 2


def test_diagnose_url_listens_to_a_running_server(server):
    """`diagnose --url` reads the served config and the steps of live traffic (the verdict depends on the load)."""
    from openai import OpenAI

    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "diagnose", "--url", server.url, "--api-key", API_KEY,
           "--duration", "3", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:  # traffic until diagnose has listened its 3 s
        client.completions.create(model=model, prompt="a b c", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["config"]["scheduler"]["max_num_seqs"] == 64 and report["config"]["cache"]["num_blocks"] == 256
    assert report["stats"]["num_steps"] >= 15 and report["stats"]["admissions"] >= 1
    assert report["metrics"]["generation_tokens"] >= 16 and "listening for 3 s" in err
    assert report["bottleneck"] in ("none", "kv_memory", "token_budget", "batch_size", "compute")
    bad = subprocess.run(cmd[:6] + ["--duration", "1"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert bad.returncode == 2 and "needs an API key" in bad.stderr


def send_traffic(url: str, arrivals: dict[int, list[tuple[str, list[int], int]]]) -> None:
    """A scenario's requests over HTTP with the openai client: those of step 0 at once, the later ones when the
    first request has streamed that many tokens (one decode step, one token)."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id

    def create(tokens: list[int], max_tokens: int, stream: bool = False):
        return client.completions.create(model=model, prompt=tokens, max_tokens=max_tokens, temperature=0,
                                         stream=stream, extra_body={"ignore_eos": True})

    later = sorted(step for step in arrivals if step)
    (_, first, first_max), *rest = arrivals[0]
    with ThreadPoolExecutor(len(rest) + sum(len(arrivals[s]) for s in later)) as pool:
        futures = [pool.submit(create, tokens, n) for _, tokens, n in rest]
        for streamed, _ in enumerate(create(first, first_max, stream=True), 1):
            while later and streamed >= later[0]:
                futures += [pool.submit(create, tokens, n) for _, tokens, n in arrivals[later.pop(0)]]
        futures += [pool.submit(create, tokens, n) for step in later for _, tokens, n in arrivals[step]]
        assert all(f.result().choices[0].finish_reason == "length" for f in futures)


@pytest.fixture(scope="module")
def scenario_servers(tiny_model_dir):
    """The three runs' servers, started together (a start is mostly one core's imports and loading: two cores
    start three in about the time of two); idle, a server waits on a condition, so the others cost the running
    scenario nothing. Each test stops its own when done."""
    servers = dict(zip(SCENARIOS, start_servers(*((tiny_model_dir("llama", **scenario.model), scenario.serve_args())
                                                  for scenario in SCENARIOS.values()))))
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.parametrize("name", SCENARIOS)
def test_diagnose_url_names_the_bottleneck_of_a_live_server(scenario_servers, name):
    """The same three runs on live `pagedserve serve` processes: diagnose listens (events and /metrics) while
    the openai client sends the traffic."""
    scenario = SCENARIOS[name]
    server = scenario_servers[name]
    try:
        connected, traffic_done = threading.Event(), threading.Event()
        with ThreadPoolExecutor(1) as pool:  # listens until the traffic is over (the bound is for a hang)
            listening = pool.submit(read_server, server.url, API_KEY, 120.0, connected.set, traffic_done)
            assert connected.wait(30)
            try:
                send_traffic(server.url, scenario.arrivals)
            finally:
                traffic_done.set()
            events, metrics = listening.result()
    finally:
        server.stop()
    result = diagnose(events, metrics=metrics)
    scenario.check(result)
    assert result.to_dict()["metrics"]["generation_tokens"] > 0 and result.stats.num_steps > 0
    assert any(line.startswith("/metrics over the window") for line in result.evidence)
    if name == "kv_memory":
        assert metrics.preemptions >= result.stats.preemptions > 0
    else:
        assert metrics.itl_ms_mean is not None and metrics.ttft_ms_mean is not None
