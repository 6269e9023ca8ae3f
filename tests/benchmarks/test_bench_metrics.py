"""Benchmark arithmetic on hand-made timings (no engine, no server)."""
import math

import numpy as np
import pytest

from pagedserve.benchmarks.metrics import (RequestOutcome, calculate_metrics, format_result, max_concurrency_of,
                                           meets_slos, parse_goodput, result_dict, summarize, tpot)
from pagedserve.benchmarks.serve import arrival_offsets


def _outcomes():
    a = RequestOutcome(success=True, prompt_len=100, output_tokens=10, ttft=0.1, itl=[0.1] * 9, latency=1.0,
                       start_time=0.0)
    b = RequestOutcome(success=True, prompt_len=50, output_tokens=1, ttft=0.5, itl=[], latency=0.5, start_time=0.2)
    c = RequestOutcome(success=False, prompt_len=70, error="HTTP 500: boom", start_time=0.3)
    return [a, b, c]


def test_tpot_definition():
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)
    assert tpot(0.5, 0.5, 1) is None
    assert tpot(0.5, 0.5, 0) is None


def test_calculate_metrics_hand_made():
    m = calculate_metrics(_outcomes(), duration=2.0, percentiles=[50, 99])
    assert m.completed == 2 and m.failed == 1
    assert m.total_input == 150  # failed requests do not count
    assert m.total_output == 11
    assert m.output_lens == [10, 1, 0]
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(5.5)
    assert m.total_token_throughput == pytest.approx(80.5)
    assert m.request_goodput is None
    ttft = m.stats["ttft"]
    assert ttft["mean"] == pytest.approx(300.0)
    assert ttft["median"] == pytest.approx(300.0)
    assert ttft["p50"] == pytest.approx(300.0)
    assert ttft["p99"] == pytest.approx(100 + 0.99 * 400)  # numpy linear interpolation
    assert m.stats["tpot"]["mean"] == pytest.approx(100.0)  # only the request with > 1 token
    assert m.stats["itl"]["mean"] == pytest.approx(100.0)
    assert m.stats["itl"]["std"] == pytest.approx(0.0, abs=1e-9)
    assert m.stats["e2el"]["mean"] == pytest.approx(750.0)
    assert m.max_concurrent_requests == 2  # a: [0, 1.0), b: [0.2, 0.7)


def test_goodput():
    outs = _outcomes()
    assert calculate_metrics(outs, 2.0, [99], {"ttft": 200}).request_goodput == pytest.approx(0.5)  # a only
    # b has one token: TPOT counts as 0 for goodput (vLLM's rule) -> b meets tpot:50, a (100 ms) does not
    assert calculate_metrics(outs, 2.0, [99], {"tpot": 50}).request_goodput == pytest.approx(0.5)
    assert calculate_metrics(outs, 2.0, [99], {"e2el": 600}).request_goodput == pytest.approx(0.5)  # b only
    assert calculate_metrics(outs, 2.0, [99], {"ttft": 1000, "tpot": 200, "e2el": 5000}).request_goodput == 1.0
    assert calculate_metrics(outs, 2.0, [99], {"ttft": 50}).request_goodput == 0.0
    assert meets_slos(0.1, 0.02, 1.0, {"ttft": 100, "tpot": 20, "e2el": 1000})  # boundaries are inclusive
    assert not meets_slos(0.1001, 0.02, 1.0, {"ttft": 100})


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["e2el:1000,ttft:2"]) == {"e2el": 1000.0, "ttft": 2.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft=5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_summarize_empty_is_zero():
    s = summarize([], [99])
    assert s == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    assert summarize([0.001, 0.003], [50, 90.5])["p90.5"] == pytest.approx(1.0 + 0.905 * 2)


def test_all_failed():
    m = calculate_metrics([RequestOutcome(success=False, error="x")], 1.0, [99], {"ttft": 1})
    assert m.completed == 0 and m.failed == 1 and m.request_goodput == 0.0
    assert m.stats["ttft"]["mean"] == 0.0


def test_result_dict_and_block_use_vllm_names():
    outs = _outcomes()
    m = calculate_metrics(outs, 2.0, [99], {"ttft": 200})
    r = result_dict(m, outs)
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                "ttfts", "itls", "latencies", "errors", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
                "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"):
        assert key in r, key
    assert r["input_lens"] == [100, 50, 70]
    assert r["errors"] == ["", "", "HTTP 500: boom"]
    assert r["itls"][0] == [0.1] * 9
    text = format_result(m, ["ttft", "tpot", "itl", "e2el"], max_concurrency=4)
    lines = text.splitlines()
    assert lines[0] == "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                  "Request throughput (req/s):", "Request goodput (req/s):", "Output token throughput (tok/s):",
                  "Total Token throughput (tok/s):", "Maximum request concurrency:",
                  "---------------Time to First Token----------------", "Mean TTFT (ms):", "Median TTFT (ms):",
                  "P99 TTFT (ms):", "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):",
                  "---------------Inter-token Latency----------------", "P99 ITL (ms):",
                  "----------------End-to-end Latency----------------", "Mean E2EL (ms):"):
        assert any(line.startswith(label) for line in lines), label
    assert "Successful requests:                     2" in text
    assert "Mean TTFT (ms):                          300.00" in text
    # not selected -> not printed
    assert "E2EL" not in format_result(m, ["ttft"])


def test_max_concurrency():
    outs = [RequestOutcome(success=True, start_time=s, latency=l) for s, l in ((0, 1), (0.5, 1), (1.0, 1), (3, 1))]
    assert max_concurrency_of(outs) == 2  # [0,1) and [0.5,1.5); the third starts as the first ends


def test_arrival_offsets():
    assert arrival_offsets(5, float("inf")) == [0.0] * 5
    t = arrival_offsets(200, 10.0, 1.0, seed=1)
    assert len(t) == 200 and all(b >= a for a, b in zip(t, t[1:]))
    assert t[-1] == pytest.approx(20.0)  # rescaled so n requests take n / rate seconds
    assert arrival_offsets(200, 10.0, 1.0, seed=1) == t  # seeded
    cv = lambda ts: np.std(np.diff(ts)) / np.mean(np.diff(ts))
    assert cv(arrival_offsets(2000, 10.0, 0.25, seed=2)) > cv(t) > cv(arrival_offsets(2000, 10.0, 8.0, seed=2))
    assert math.isclose(cv(arrival_offsets(2000, 10.0, float("inf"))), 0.0, abs_tol=1e-9)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, 0.0)
