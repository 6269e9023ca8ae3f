"""benchmarks/cpu_peers.py without the peers (CI never has vLLM CPU or OpenVINO GenAI): argument parsing, one workload
for every engine, the precision-group flags, the driver-timings -> metrics path, the tables, the vLLM version
wrapper, and the skip path when a peer's virtualenv is missing.  No server starts, no model runs: a few seconds."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "cpu_peers.py")


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def cp():
    return load("cpu_peers", SCRIPT)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("m") / "tiny"))


def test_parse_args(cp):
    a = cp.parse_args(["--model", "m"])
    assert a.concurrencies == [1, 16, 32] and a.precision_list == ["fp32", "bf16", "int8"]
    assert a.engine_list == ["pagedserve", "pagedserve-engine", "vllm", "openvino", "llamacpp"]
    assert a.dataset == "mixed" and a.threads == 2
    a = cp.parse_args(["--model", "m", "--concurrency", "32,1,32", "--precisions", "bf16", "--engines", "openvino"])
    assert a.concurrencies == [1, 32] and a.precision_list == ["bf16"] and a.engine_list == ["openvino"]
    assert cp.parse_args(["--model", "m", "--through-server"]).engine_list == ["pagedserve", "vllm", "llamacpp"]
    for bad in (["--engines", "tgi"], ["--precisions", "fp8"], ["--concurrency", "0"],
                ["--engines", "openvino", "--through-server"], ["--gguf", "m.gguf"]):
        with pytest.raises(SystemExit):
            cp.parse_args(["--model", "m", *bad])


def test_same_workload_for_every_engine(cp, tiny):
    """The samples the script builds are the ones `pagedserve bench serve` builds from the flags it passes (the path
    of pagedserve and vLLM), and the OpenVINO driver gets exactly those token ids and output lengths."""
    import argparse

    from pagedserve.benchmarks import datasets as ds

    args = cp.parse_args(["--model", tiny, "--num-prompts", "12", "--seed", "3"])
    samples, _ = cp.build_samples(args)
    p = argparse.ArgumentParser()
    ds.add_dataset_args(p)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(cp.sbs.dataset_flags(args))  # what run_bench_serve hands to `bench serve`
    again = ds.get_samples(ns, ds.load_tokenizer(ns.tokenizer), None)
    assert [(s.prompt, s.expected_output_len) for s in samples] == [(s.prompt, s.expected_output_len) for s in again]
    drv = cp.samples_for_driver(samples)
    assert [d["prompt"] for d in drv] == [list(s.prompt) for s in samples]
    assert [d["output_len"] for d in drv] == [s.expected_output_len for s in samples]
    json.dumps(drv)  # plain JSON for the peer's interpreter
    assert len({len(s.prompt) for s in samples}) > 1  # mixed lengths


def test_kv_sizing_and_flags(cp, tiny):
    class S:
        def __init__(self, p, o):
            self.prompt_len, self.expected_output_len = p, o

    ss = [S(10, 6), S(100, 20), S(33, 1)]
    assert cp.kv_blocks_needed(ss, 1) == 8 and cp.kv_blocks_needed(ss, 2) == 8 + 3 and cp.kv_blocks_needed(ss, 9) == 12
    with open(os.path.join(tiny, "config.json")) as f:
        cfg = json.load(f)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cp.kv_bytes_per_token(tiny, 4) == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * 4

    a = cp.parse_args(["--model", tiny])
    assert cp.engine_flags("pagedserve", "bf16", a)[0] == ["--dtype", "bfloat16"]
    assert "--quantization" in cp.engine_flags("pagedserve", "int8", a)[0]
    assert cp.engine_flags("vllm", "fp32", a)[0] == ["--dtype", "float32"]
    assert cp.engine_flags("vllm", "int8", a)[0] is None
    ov32, ov8 = cp.engine_flags("openvino", "fp32", a)[0], cp.engine_flags("openvino", "int8", a)[0]
    assert ov32["weight_format"] == "fp32" and ov32["properties"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert ov32["properties"]["KV_CACHE_PRECISION"] == "f32" and ov32["properties"]["INFERENCE_NUM_THREADS"] == 2
    assert ov8["weight_format"] == "int8" and ov8["properties"]["KV_CACHE_PRECISION"] == "f32"
    assert cp.engine_flags("openvino", "bf16", a)[0]["properties"]["INFERENCE_PRECISION_HINT"] == "bf16"


def test_driver_timings_to_result_rows_and_tables(cp):
    class S:
        def __init__(self, p, o):
            self.prompt_len, self.expected_output_len = p, o

    samples = [S(5, 3), S(7, 2)]
    run = {"duration": 2.0, "requests": [
        {"success": True, "prompt_len": 5, "output_tokens": 3, "ttft": 0.1, "itl": [0.02, 0.04], "latency": 0.16,
         "start_time": 0.0, "error": ""},
        {"success": True, "prompt_len": 7, "output_tokens": 2, "ttft": 0.3, "itl": [0.05], "latency": 0.35,
         "start_time": 0.16, "error": ""}]}
    res = cp.result_from_driver(run, 1, "openvino-fp32")
    assert res["completed"] == 2 and res["total_output_tokens"] == 5 and res["output_lens"] == [3, 2]
    assert math.isclose(res["median_ttft_ms"], 200.0) and math.isclose(res["median_itl_ms"], 40.0)
    ov = cp.make_row("openvino", "fp32", 1, res, samples, notes="n")
    assert ov["exact_lengths"] and math.isclose(ov["output_tok_s"], 2.5)

    ps_res = dict(res, duration=1.0, median_ttft_ms=100.0, p99_ttft_ms=100.0, median_itl_ms=20.0, p99_itl_ms=40.0)
    ps = cp.make_row("pagedserve", "fp32", 1, ps_res, samples)
    short = dict(res, output_lens=[3, 1], total_output_tokens=4)
    vl = cp.make_row("vllm", "fp32", 1, short, samples)
    assert not vl["exact_lengths"]
    other = cp.make_row("pagedserve", "bf16", 1, ps_res, samples)
    alone = cp.make_row("pagedserve-engine", "fp32", 1, dict(ps_res, duration=0.5), samples)
    rats = cp.ratios([ov, ps, vl, other, alone])
    assert {(q["precision"], q["ours_engine"], q["vs_engine"]) for q in rats} == {
        ("fp32", "pagedserve", "openvino"), ("fp32", "pagedserve", "vllm"), ("fp32", "pagedserve-engine", "openvino"),
        ("fp32", "pagedserve-engine", "vllm")}  # ours against the peers only, never against each other
    q = next(q for q in rats if q["vs_engine"] == "openvino" and q["ours_engine"] == "pagedserve")
    assert math.isclose(q["output_tok_s"], 2.0) and math.isclose(q["ttft_p50"], 2.0)
    q = next(q for q in rats if q["vs_engine"] == "openvino" and q["ours_engine"] == "pagedserve-engine")
    assert math.isclose(q["output_tok_s"], 4.0)

    meta = {"model": "m", "threads": 2, "dataset": "mixed", "workload": "2 requests", "seed": 0, "date": "d",
            "versions": {"pagedserve": "x", "OpenVINO GenAI CB": "openvino 1"}}
    md = cp.format_report(meta, [ov, ps, vl, other], rats, {"vLLM CPU int8": "no int8"})
    assert "| fp32 | 1 | pagedserve | 2/0 | yes | 5.0 |" in md
    assert "| fp32 | 1 | OpenVINO GenAI CB | 2/0 | yes | 2.5 |" in md
    assert "| fp32 | 1 | vLLM CPU |" in md and "| NO |" in md
    assert "| fp32 | 1 | pagedserve | OpenVINO GenAI CB | 2.00x | 2.00x |" in md
    assert "Skipped: vLLM CPU int8: no int8" in md and "openvino 1" in md
    lines = md.splitlines()
    assert lines.index(next(x for x in lines if x.startswith("| fp32 | 1 | pagedserve"))) < \
        lines.index(next(x for x in lines if x.startswith("| bf16 | 1 | pagedserve")))


def test_vllm_wrapper_answers_the_version_lookup(monkeypatch):
    import importlib.metadata as md

    w = load("vllm_cpu_cli", os.path.join(REPO, "benchmarks", "peers", "vllm_cpu_cli.py"))
    real = md.version
    monkeypatch.setenv("VLLM_CPU_VERSION_OVERRIDE", "0.32.0+cpu")
    try:
        assert w.patch_version_lookup() == "0.32.0+cpu"
        assert md.version("vllm") == "0.32.0+cpu" or md.version("vllm") == real("vllm")
        assert md.version("numpy") == real("numpy")
    finally:
        md.version = real


def test_peers_missing_are_skipped(tmp_path, tiny):
    """No venvs, pagedserve left out: both peers skipped with a message, nothing to run, exit 1, files written."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, SCRIPT, "--model", tiny, "--engines", "vllm,openvino", "--vllm-venv",
           str(tmp_path / "no-vllm"), "--openvino-venv", str(tmp_path / "no-ov"), "--num-prompts", "3",
           "--dataset", "random", "--random-input-len", "8", "--random-output-len", "4", "--max-model-len", "64",
           "--output-dir", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SKIP vLLM CPU: no virtualenv" in r.stdout and "SKIP OpenVINO GenAI CB: no virtualenv" in r.stdout
    res = json.loads((out / "cpu_peers.json").read_text())
    assert set(res["skipped"]) == {"vLLM CPU", "OpenVINO GenAI CB"} and res["rows"] == []
    assert "Skipped: vLLM CPU: no virtualenv" in (out / "cpu_peers.md").read_text()


def test_concurrency1_workload(cp, tiny):
    a = cp.parse_args(["--model", tiny, "--num-prompts", "6", "--c1-num-prompts", "2", "--concurrency", "1,4"])
    w, d = cp.build_workloads(a)
    assert len(w[1]) == 2 and len(w[4]) == 6 and d[1].startswith("2 requests")
    assert cp.workload_args(a, 1).num_prompts == 2 and cp.workload_args(a, 4).num_prompts == 6
    assert cp.kv_blocks_for(w) == max(cp.kv_blocks_needed(w[1], 1), cp.kv_blocks_needed(w[4], 4))
    assert cp.workload_args(a, 4).seed == 0 and cp.workload_args(a, 1).seed == 1
    a = cp.parse_args(["--model", tiny, "--num-prompts", "5", "--concurrency", "1,2"])
    w, _ = cp.build_workloads(a)
    assert len(w[1]) == len(w[2]) == 5
    assert not {tuple(s.prompt) for s in w[1]} & {tuple(s.prompt) for s in w[2]}  # fresh prompts per C
    a = cp.parse_args(["--model", tiny, "--num-prompts", "5", "--concurrency", "1,2", "--same-prompts-every-c"])
    w, _ = cp.build_workloads(a)
    assert w[1] is w[2]


def test_vllm_preload(cp, tmp_path):
    assert cp.vllm_preload("none", str(tmp_path)) == "" and cp.vllm_preload("/a.so:/b.so", str(tmp_path)) == "/a.so:/b.so"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    auto = cp.vllm_preload("auto", str(tmp_path)).split(":")
    assert auto[-1] == str(tmp_path / "lib" / "libiomp5.so") and all(os.path.isfile(p) for p in auto)


def test_report_only_rebuilds_tables(cp, tiny, tmp_path):
    a = cp.parse_args(["--model", tiny, "--num-prompts", "2", "--concurrency", "2", "--precisions", "fp32",
                       "--engines", "pagedserve,openvino", "--output-dir", str(tmp_path)])
    w, _ = cp.build_workloads(a)
    run = {"duration": 1.0, "requests": [
        {"success": True, "prompt_len": s.prompt_len, "output_tokens": s.expected_output_len, "ttft": 0.1,
         "itl": [0.01] * (s.expected_output_len - 1), "latency": 0.5, "start_time": 0.0} for s in w[2]]}
    (tmp_path / cp.result_name("openvino", "fp32", 2)).write_text(json.dumps(cp.result_from_driver(run, 2, "x")))
    rows, skipped = [], {}
    cp.collect_results(a, w, str(tmp_path), rows, skipped)
    assert [(r["engine"], r["exact_lengths"]) for r in rows] == [("openvino", True)]
    assert list(skipped) == ["pagedserve fp32 C=2"]


def test_engine_driver_runs_the_closed_loop_in_process(cp, tiny, tmp_path):
    """peers/pagedserve_engine_driver.py on a tiny model: the real engine, C requests in flight, every request its
    exact output length, per-token timings in the OpenVINO driver's format (so the same rows and ratios follow)."""
    a = cp.parse_args(["--model", tiny, "--num-prompts", "5", "--concurrency", "1,2", "--precisions", "fp32",
                       "--engines", "pagedserve-engine", "--dataset", "random", "--random-input-len", "12",
                       "--random-output-len", "6", "--random-range-ratio", "0.5", "--max-model-len", "64",
                       "--output-dir", str(tmp_path)])
    w, _ = cp.build_workloads(a)
    rows, skipped = [], {}
    cp.run_pagedserve_engine(a, "fp32", w, str(tmp_path), rows, skipped)
    assert not skipped and [(r["engine"], r["concurrency"]) for r in rows] == [("pagedserve-engine", 1),
                                                                               ("pagedserve-engine", 2)]
    for r in rows:
        assert r["completed"] == 5 and r["failed"] == 0 and r["exact_lengths"], r
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0
    spec = json.loads((tmp_path / "pagedserve-engine-fp32-spec.json").read_text())
    assert "--num-kv-blocks" in spec["engine_flags"] and spec["engine_flags"][-2:] == ["--dtype", "float32"]
    # the server's per-step account, filled in-process (benchmarks/server_overhead.py compares the two)
    runs = json.loads((tmp_path / "pagedserve-engine-fp32-raw.json").read_text())["runs"]
    for c in ("1", "2"):
        prof = runs[c]["profile"]
        assert prof["steps"] > 0 and prof["step"] >= prof["forward"] > 0 and prof["output"] > 0
        assert prof["engine_thread_cpu"] > 0 and prof["chunks"] == 0


def test_rounds_alternate_and_pair_within_a_round(cp, tmp_path):
    """--rounds: the engines' order flips every round, each round writes its own directory, ratios pair runs of the
    same round only, and the report gives the median [min-max] of the paired ratios."""
    a = cp.parse_args(["--model", "m", "--rounds", "3"])
    assert a.rounds == 3
    with pytest.raises(SystemExit):
        cp.parse_args(["--model", "m", "--rounds", "0"])
    assert [cp.engine_order(["a", "b"], k) for k in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert cp.round_dir("out", 0, 1) == "out" and cp.round_dir("out", 2, 3) == os.path.join("out", "round2")

    def row(engine, k, tok_s, ttft_p99):
        return {"engine": engine, "label": cp.LABELS[engine], "precision": "bf16", "concurrency": 16, "round": k,
                "completed": 4, "failed": 0, "exact_lengths": True, "output_tok_s": tok_s, "ttft_p50_ms": 10.0,
                "ttft_p99_ms": ttft_p99, "itl_p50_ms": 5.0, "itl_p99_ms": 9.0, "tpot_p50_ms": 5.0, "notes": ""}

    # round 1's OpenVINO run was slow for the machine, not for OpenVINO: pairing by round keeps that out of round 0/2
    rows = [row("pagedserve-engine", 0, 120.0, 100.0), row("openvino", 0, 100.0, 110.0),
            row("pagedserve-engine", 1, 90.0, 100.0), row("openvino", 1, 60.0, 90.0),
            row("pagedserve-engine", 2, 130.0, 100.0), row("openvino", 2, 100.0, 100.0)]
    rats = cp.ratios(rows)
    assert [(q["round"], round(q["output_tok_s"], 2)) for q in rats] == [(0, 1.2), (1, 1.5), (2, 1.3)]
    (s,) = cp.summarize_ratios(rats)
    assert s["per_round"] == pytest.approx([1.2, 1.5, 1.3])
    assert s["output_tok_s"] == pytest.approx({"median": 1.3, "min": 1.2, "max": 1.5, "n": 3})
    assert s["ttft_p99"]["min"] == pytest.approx(0.9) and s["ttft_p99"]["median"] == pytest.approx(1.0)
    by_engine = {g["engine"]: g for g in cp.summarize_rows(rows)}
    assert by_engine["openvino"]["output_tok_s"]["median"] == 100.0 and by_engine["openvino"]["runs"] == 3
    assert cp.spread([2.0, float("nan"), 4.0])["median"] == 3.0 and cp.spread([])["n"] == 0

    meta = {"model": "m", "threads": 2, "dataset": "mixed", "workload": "w", "seed": 0, "date": "d",
            "versions": {}, "rounds": 3}
    md = cp.format_report(meta, rows, rats, {})
    assert "| bf16 | 16 | pagedserve engine (in-process) | OpenVINO GenAI CB | 1.30x [1.20-1.50] | 1.20, 1.50, 1.30 |" \
        in md
    assert "| bf16 | 16 | OpenVINO GenAI CB | 3 | yes | 100.0 [60.0-100.0] |" in md
    assert "| bf16 | 16 | 1 | OpenVINO GenAI CB | 4/0 | yes | 60.0 |" in md  # every run, with its round


def test_report_only_reads_every_round(cp, tiny, tmp_path):
    a = cp.parse_args(["--model", tiny, "--num-prompts", "2", "--concurrency", "2", "--precisions", "fp32",
                       "--engines", "openvino", "--rounds", "2", "--output-dir", str(tmp_path)])
    w, _ = cp.build_workloads(a)
    run = {"duration": 1.0, "requests": [
        {"success": True, "prompt_len": s.prompt_len, "output_tokens": s.expected_output_len, "ttft": 0.1,
         "itl": [0.01] * (s.expected_output_len - 1), "latency": 0.5, "start_time": 0.0} for s in w[2]]}
    (tmp_path / "round1").mkdir()
    (tmp_path / "round1" / cp.result_name("openvino", "fp32", 2)).write_text(
        json.dumps(cp.result_from_driver(run, 2, "x")))
    rows, skipped = [], {}
    cp.collect_results(a, w, str(tmp_path), rows, skipped)
    assert [(r["engine"], r["round"]) for r in rows] == [("openvino", 1)]
    assert list(skipped) == ["OpenVINO GenAI CB fp32 C=2 round 0"]


def test_llamacpp_one_server_per_concurrency(cp, tiny, tmp_path, monkeypatch):
    """llama.cpp: the group's GGUF and KV type, -np C slots of --max-model-len each, the shared token budget, one
    server per C loaded by the same `bench serve` path as ours; a group without a GGUF is a skip, not a failure."""
    gguf = tmp_path / "m-q8_0.gguf"
    gguf.write_bytes(b"")
    server_bin = tmp_path / "llama-server"
    server_bin.write_text("#!/bin/sh\n")
    server_bin.chmod(0o755)
    a = cp.parse_args(["--model", tiny, "--num-prompts", "2", "--concurrency", "1,4", "--precisions", "int8,bf16",
                       "--engines", "llamacpp", "--gguf", f"int8={gguf}", "--gguf", "bf16=/nowhere-bf16.gguf",
                       "--llama-server", str(server_bin),
                       "--max-model-len", "64", "--max-num-batched-tokens", "512", "--dataset", "random",
                       "--random-input-len", "8", "--random-output-len", "4", "--output-dir", str(tmp_path)])
    assert a.gguf_by_precision == {"int8": str(gguf), "bf16": "/nowhere-bf16.gguf"} and a.gguf_files == {}
    assert a.precision_list == ["int8", "bf16"]
    assert cp.engine_flags("llamacpp", "fp32", a)[0] is None
    assert cp.engine_flags("llamacpp", "bf16", a)[0][2:] == ["--cache-type-k", "bf16", "--cache-type-v", "bf16"]
    assert cp.model_source("int8", a) == tiny  # pagedserve keeps the checkpoint in a precision group
    started = []

    class FakeServer:
        def __init__(self, name, cmd, port, log_path, env=None):
            self.cmd, self.base_url = cmd, f"http://127.0.0.1:{port}"

        def start(self, timeout):
            started.append(self.cmd)

        def stop(self):
            pass

    w, _ = cp.build_workloads(a)
    res = {c: {"duration": 1.0, "completed": 2, "failed": 0, "errors": ["", ""], "output_lens": [4, 4],
               "input_lens": [8, 8], "total_input_tokens": 16, "total_output_tokens": 8, "median_ttft_ms": 1.0,
               "p99_ttft_ms": 2.0, "median_itl_ms": 1.0, "p99_itl_ms": 2.0} for c in (1, 4)}
    monkeypatch.setattr(cp.sbs, "Server", FakeServer)
    monkeypatch.setattr(cp, "run_bench_serve", lambda engine, prec, url, name, c, *rest: res[c])
    rows, skipped = [], {}
    cp.run_llamacpp(a, "int8", w, str(tmp_path), rows, skipped)
    cp.run_llamacpp(a, "bf16", w, str(tmp_path), rows, skipped)
    assert list(skipped) == ["llama.cpp bf16"] and "not found" in skipped["llama.cpp bf16"]
    assert [(r["engine"], r["precision"], r["concurrency"]) for r in rows] == [("llamacpp", "int8", 1),
                                                                              ("llamacpp", "int8", 4)]
    for c, cmd in zip((1, 4), started):
        def flag(name):
            return cmd[cmd.index(name) + 1]

        assert cmd[0] == str(server_bin) and flag("-m") == str(gguf) and flag("--cache-type-k") == "f32"
        assert flag("-np") == str(c) and flag("-c") == str(c * 64) and flag("-b") == "512" and flag("-t") == "2"
def test_gguf_groups_run_every_engine_on_the_file(cp, tmp_path):
    """--gguf LABEL=FILE: a group per file; pagedserve and llama-server load the file, OpenVINO the NNCF IR of the
    same width, vLLM is skipped; --gguf alone keeps only the GGUF groups."""
    a = cp.parse_args(["--model", "m", "--gguf", "Q4_0=/f/m-Q4_0.gguf", "--gguf", "Q8_0=/f/m-Q8_0.gguf"])
    assert a.precision_list == ["Q4_0", "Q8_0"] and "llamacpp" in a.engine_list
    assert cp.parse_args(["--model", "m", "--precisions", "int8", "--gguf", "Q4_K_M=x"]).precision_list == [
        "int8", "Q4_K_M"]
    assert cp.parse_args(["--model", "m", "--through-server", "--gguf", "Q4_0=x"]).engine_list == [
        "pagedserve", "vllm", "llamacpp"]
    for bad in (["--gguf", "Q4_0"], ["--gguf", "int8=x", "--gguf", "int8=y"], ["--gguf", "Q4_0=x", "--gguf", "Q4_0=y"],
                ["--gguf", "fp32+regex=x"]):
        with pytest.raises(SystemExit):
            cp.parse_args(["--model", "m", *bad])
    assert cp.model_source("Q4_0", a) == "/f/m-Q4_0.gguf" and cp.model_source("int8", a) == "m"
    assert cp.engine_flags("pagedserve", "Q4_0", a)[0] == ["--dtype", "float32"]
    assert cp.engine_flags("llamacpp", "Q8_0", a)[0] == ["-m", "/f/m-Q8_0.gguf", "--cache-type-k", "f32",
                                                          "--cache-type-v", "f32"]
    assert cp.engine_flags("llamacpp", "int8", a)[0] is None  # no --gguf int8=FILE
    assert cp.engine_flags("vllm", "Q4_0", a)[0] is None
    assert cp.engine_flags("openvino", "Q4_0", a)[0]["weight_format"] == "int4"
    assert cp.engine_flags("openvino", "Q8_0", a)[0]["weight_format"] == "int8"
    assert cp.ov_weight_format_for_gguf("Q5_K_M") is None
    assert sorted(["Q4_0", "bf16", "fp32+regex"], key=cp.precision_order) == ["fp32+regex", "bf16", "Q4_0"]
    cmd = cp.llama_server_cmd("/bin/llama-server", cp.llama_gguf_flags("/f/m-Q4_0.gguf", "f32"), 8000, 16, "n",
                              cp.parse_args(["--model", "m", "--max-model-len", "320", "--gguf", "Q4_0=x"]))
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["-m"] == "/f/m-Q4_0.gguf" and flags["-np"] == "16" and "-cb" in cmd
    assert cmd[cmd.index("-c") + 1] == str(16 * 320) and cmd[cmd.index("-t") + 1] == "2"
    # no binary: the group's llama.cpp runs are skipped with a reason, nothing else happens
    skipped = {}
    a = cp.parse_args(["--model", "m", "--gguf", "Q4_0=x", "--llama-server", str(tmp_path / "none")])
    cp.run_llamacpp(a, "Q4_0", {}, str(tmp_path), [], skipped)
    assert list(skipped) == ["llama.cpp Q4_0"] and "no llama-server" in skipped["llama.cpp Q4_0"]
