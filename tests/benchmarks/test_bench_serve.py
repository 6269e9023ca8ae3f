"""`bench serve`: the streaming client against a scripted fake server (exact timings), and end to end
against our own OpenAI-compatible server."""
import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedserve.benchmarks.cli import add_bench_parser

pytestmark = pytest.mark.server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_args(argv):
    parser = argparse.ArgumentParser(prog="pagedserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams max_tokens chunks of one token each, GAP seconds apart; usage in the last chunk.
    A prompt starting with 999 gets HTTP 500."""
    GAP = 0.05
    FIRST = 0.1
    bodies: list = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "fake-model", "root": "fake-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if body["prompt"][0] == 999:
            msg = b'{"error": {"message": "boom"}}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        time.sleep(self.FIRST)
        for i in range(n):
            if i:
                time.sleep(self.GAP)
            chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()


@pytest.fixture()
def fake_server():
    _FakeOpenAI.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("http_client", ["httpx", "aiohttp"])
def test_serve_client_timings_against_fake_server(fake_server, tmp_path, capsys, http_client):
    out = tmp_path / "r.json"
    args = bench_args(["serve", "--http-client", http_client, "--base-url", fake_server, "--dataset-name", "random", "--num-prompts", "4",
                       "--random-input-len", "8", "--random-output-len", "5", "--vocab-size", "500",
                       "--ignore-eos", "--goodput", "ttft:50", "tpot:1000", "--metric-percentiles", "50,99",
                       "--percentile-metrics", "ttft,tpot,itl,e2el", "--result-filename", str(out),
                       "--disable-tqdm", "--max-concurrency", "2"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in text
    assert "Successful requests:                     4" in text
    assert "Maximum request concurrency:             2" in text
    r = json.loads(out.read_text())
    assert r["model_id"] == "fake-model"  # from GET /v1/models
    assert r["http_client"] == http_client
    assert r["completed"] == 4 and r["failed"] == 0
    assert r["total_input_tokens"] == 32 and r["total_output_tokens"] == 20
    assert r["output_lens"] == [5, 5, 5, 5]
    assert all(len(itl) == 4 for itl in r["itls"])
    # the fake server sleeps FIRST before the first token and GAP between tokens: every request's first token and
    # end come no sooner (a loaded machine only delays them; single gaps can shrink when a late read finds two
    # chunks, so they are not bounded); each request's TPOT is its mean ITL
    assert all(ttft >= 0.99 * _FakeOpenAI.FIRST for ttft in r["ttfts"])
    assert all(lat >= 0.99 * (_FakeOpenAI.FIRST + 4 * _FakeOpenAI.GAP) for lat in r["latencies"])
    assert all(lat - ttft == pytest.approx(sum(itl), abs=1e-6)
               for lat, ttft, itl in zip(r["latencies"], r["ttfts"], r["itls"]))
    assert r["request_goodput"] == 0.0  # every TTFT >= 100 ms > the 50 ms SLO
    assert r["max_concurrent_requests"] <= 2
    assert r["p50_ttft_ms"] == pytest.approx(r["median_ttft_ms"])
    # the client's CPU while it ran the load (start-up excluded): some, and no more than this process has used
    assert 0.0 < r["client_cpu_s"] <= time.process_time()
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "p99_ttft_ms", "p99_tpot_ms",
                "p99_itl_ms", "p99_e2el_ms", "input_lens", "ttfts", "errors"):
        assert key in r
    # what went over the wire (1 ready-check request + 4)
    bodies = _FakeOpenAI.bodies
    assert len(bodies) == 5
    b = bodies[-1]
    assert isinstance(b["prompt"], list) and all(isinstance(t, int) for t in b["prompt"])
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["ignore_eos"] is True and b["max_tokens"] == 5 and b["model"] == "fake-model"
    assert len({tuple(b["prompt"]) for b in bodies[1:]}) == 4  # distinct prompts


@pytest.mark.parametrize("http_client", ["httpx", "aiohttp"])
def test_serve_client_records_errors(fake_server, http_client):
    import asyncio

    from pagedserve.benchmarks.datasets import SampleRequest
    from pagedserve.benchmarks.serve import benchmark

    samples = [SampleRequest([1, 2, 3], 3, 2), SampleRequest([999, 2], 2, 2)]
    model, outs, dur = asyncio.run(benchmark(base_url=fake_server, api_url=fake_server + "/v1/completions",
                                             backend="openai", model="m", samples=samples, disable_tqdm=True,
                                             ready_check_timeout_sec=0, verbose=False, http_client=http_client))
    assert outs[0].success and outs[0].output_tokens == 2
    assert not outs[1].success and outs[1].error.startswith("HTTP 500")
    # a dead server: every request fails, nothing raises
    _, outs, _ = asyncio.run(benchmark(base_url="http://127.0.0.1:9", api_url="http://127.0.0.1:9/v1/completions",
                                       backend="openai", model="m", samples=samples[:1], disable_tqdm=True,
                                       ready_check_timeout_sec=0, verbose=False, http_client=http_client))
    assert not outs[0].success and outs[0].error


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    from pagedserve.benchmarks.shapes import get_shape, make_model

    return make_model(get_shape("tiny-llama"), str(tmp_path_factory.mktemp("bench_tiny")), verbose=False)


def args_list(port: int, model: str, out) -> list[str]:
    return ["serve", "--port", str(port), "--tokenizer", model, "--dataset-name", "mixed", "--num-prompts", "6",
            "--ignore-eos", "--request-rate", "50", "--seed", "1", "--result-filename", str(out), "--disable-tqdm",
            "--ready-check-timeout-sec", "120"]


def test_serve_against_our_server(bench_model, tmp_path):
    pytest.importorskip("pagedserve.entrypoints.openai.api_server")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", bench_model, "--port",
                             str(port), "--num-threads", "1", "--num-kv-blocks", "256", "--max-model-len", "512",
                             "--served-model-name", "tiny"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        out = tmp_path / "ours.json"
        args = bench_args(args_list(port, bench_model, out))
        # the mixed workload's long prompts would not fit max_model_len 512: shrink it for the smoke test
        from pagedserve.benchmarks import datasets as ds

        old = ds.MIXED_PROMPT_RANGE, ds.MIXED_OUTPUT_RANGE
        ds.MIXED_PROMPT_RANGE, ds.MIXED_OUTPUT_RANGE = (8, 64), (4, 16)
        constrained_out = tmp_path / "json_schema.json"
        constrained = bench_args([*args_list(port, bench_model, constrained_out), "--structured-output", "json_schema"])
        try:
            assert args.func(args) == 0
            assert constrained.func(constrained) == 0  # same workload, every request JSON-schema constrained
        finally:
            ds.MIXED_PROMPT_RANGE, ds.MIXED_OUTPUT_RANGE = old
        r = json.loads(out.read_text())
        assert r["model_id"] == "tiny"
        assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
        assert r["total_output_tokens"] == sum(r["output_lens"]) > 0
        assert all(0 < t for t in r["ttfts"])
        assert r["mean_ttft_ms"] > 0 and r["request_throughput"] > 0
        c = json.loads(constrained_out.read_text())
        assert c["structured_output"] == "json_schema" and c["completed"] == 6 and c["failed"] == 0, c["errors"]
        assert c["output_lens"] == r["output_lens"]  # the schema cannot be complete before max_tokens
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
