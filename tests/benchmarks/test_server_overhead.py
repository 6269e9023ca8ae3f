"""benchmarks/server_overhead.py without a server or a model: --variant parsing, per-step breakdown and the report
(ratios paired within a round). The server side of its numbers (GET /metrics) is tested in
tests/entrypoints/test_server_profile.py, the driver side in tests/benchmarks/test_cpu_peers.py."""
import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")


@pytest.fixture(scope="module")
def so():
    sys.path.insert(0, BENCH)  # it imports cpu_peers and side_by_side from beside it
    spec = importlib.util.spec_from_file_location("server_overhead", os.path.join(BENCH, "server_overhead.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def profile(steps, step, forward, chunks=0, loop_cpu=0.0):
    from pagedserve.metrics.server_profile import COUNTS, SECONDS

    p = dict.fromkeys((*SECONDS, *COUNTS), 0.0)
    p.update(steps=steps, step=step, forward=forward, output=0.1 * (step - forward), step_cpu=0.9 * step,
             between_steps=0.01 * step, chunks=chunks, deliveries=steps, loop_thread_cpu=loop_cpu,
             engine_thread_cpu=step, process_cpu=2 * step + loop_cpu, encode=chunks * 5e-6, send=chunks * 50e-6,
             client_cpu=3.0, client_run_cpu=0.55)
    return p


def row(variant, k, tok_s, prof):
    engine = "pagedserve-engine" if variant == "engine" else "pagedserve"
    return {"engine": engine, "variant": variant, "round": k, "precision": "fp32", "concurrency": 16,
            "output_tok_s": tok_s, "total_output_tokens": 1000, "duration_s": 1000 / tok_s, "profile": prof}


def test_variants_parse(so):
    rest, variants = so.parse_variants(["--model", "m", "--variant", "a=/x", "--variant=b=/y:/z"])
    assert rest == ["--model", "m"] and variants == {"a": "/x", "b": "/y:/z"}
    assert so.parse_variants(["--model", "m"])[1] == {"server": so.sbs.REPO}
    for bad in (["--variant", "engine=/x"], ["--variant", "nolabel"]):
        with pytest.raises(SystemExit):
            so.parse_variants(bad)


def test_report_pairs_rounds_and_breaks_steps_down(so):
    rows = []
    for k, (e, a, b) in enumerate([(100.0, 90.0, 95.0), (80.0, 76.0, 78.0)]):
        rows += [row("engine", k, e, profile(100, 10.0, 9.0)), row("a", k, a, profile(110, 11.0, 9.5, 1600, 0.8)),
                 row("b", k, b, profile(105, 10.5, 9.2, 1600, 0.4))]
    meta = {"model": "m", "threads": 2, "workload": "w", "date": "d", "version": "v", "variants": {"a": "/x", "b": "/y"}}
    text = so.format_report(rows, meta)
    assert "| fp32 | 16 | 0 | 100.0 | 90.0 | 0.900 | 95.0 | 0.950 |" in text
    assert "fp32 C=16 a / engine **0.925** [0.900-0.950]" in text  # the median of 0.90 and 0.95
    assert "fp32 C=16 b / a **1.041**" in text  # b over a, paired within each round: 95/90 and 78/76
    s = so.per_step(rows[1])
    assert s["steps"] == 110 and abs(s["step"] - 100.0) < 1e-9 and abs(s["forward"] - 1e3 * 9.5 / 110) < 1e-9
    assert abs(s["client_run_cpu"] - 5.0) < 1e-9  # 0.55 s of client CPU over 110 steps
    assert abs(s["loop_cpu_us_per_chunk"] - 500.0) < 1e-9 and abs(s["encode_us_per_chunk"] - 5.0) < 1e-9
    assert "event-loop CPU us / chunk | 500.00 / 250.00 / -" in text


def test_peers_parse(so):
    rest, peers = so.parse_peers(["--model", "m", "--peers", "openvino", "--peers=vllm,openvino"])
    assert rest == ["--model", "m"] and peers == ["openvino", "vllm", "openvino"]
    with pytest.raises(SystemExit):
        so.parse_peers(["--peers", "llamacpp"])


def test_peer_table_takes_the_best_peer_per_round(so):
    def lat(r, ttft, itl):
        return dict(r, ttft_p99_ms=ttft, itl_p99_ms=itl)

    rows = []
    # round 0: openvino is the best peer (120 > 100); round 1: vllm is (90 > 80)
    for k, (srv, eng, ov, vl) in enumerate([(132.0, 150.0, 120.0, 100.0), (99.0, 110.0, 80.0, 90.0)]):
        rows += [lat(row("server", k, srv, None), 1000.0, 100.0), lat(row("engine", k, eng, None), 900.0, 90.0),
                 lat(dict(row("server", k, ov, None), engine="openvino", variant="openvino"), 1100.0, 80.0),
                 lat(dict(row("server", k, vl, None), engine="vllm", variant="vllm"), 2000.0, 200.0)]
    meta = {"variants": {"server": "/x"}, "peers": ["openvino", "vllm"]}
    text = "\n".join(so.peer_table(rows, meta))
    # server / best peer: 132/120 = 1.10, 99/90 = 1.10; TTFT p99 best peer / ours: 1100/1000, 2000/1000
    assert "| fp32 | 16 | 2 | 100.0 [80.0-120.0] | 95.0 [90.0-100.0] | 115.5 [99.0-132.0] | 1.10 [1.10-1.10] " \
           "| 1.55 [1.10-2.00] | 1.40 [0.80-2.00] |" in text
    assert "| 130.0 [110.0-150.0] | 1.24 [1.22-1.25] |" in text  # the engine: 150/120, 110/90
    assert so.peer_table(rows, {"variants": {"server": "/x"}, "peers": []}) == []
