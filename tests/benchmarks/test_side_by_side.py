"""benchmarks/side_by_side.py end to end on a tiny model: pagedserve (server + `bench serve` + batch-1 decode via
`bench latency`), the three transformers baselines (naive, static, continuous batching), the roofline block;
llama-server absent, so it must be skipped with a message (CI never needs llama.cpp). Also the two smaller scripts
of benchmarks/: the CPU-path A/B and the alternating batch-1 comparison."""
import json
import os
import subprocess
import sys

import pytest
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "side_by_side.py")


def test_side_by_side_tiny_without_llama_cpp(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path / "tiny")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LLAMA_SERVER", None)
    cmd = [sys.executable, SCRIPT, "--model", str(model), "--llama-server", str(tmp_path / "no-such-llama-server"),
           "--dataset", "random", "--random-input-len", "16", "--random-output-len", "6", "--num-prompts", "4",
           "--concurrency", "2", "--threads", "1", "--max-model-len", "128",
           "--roofline-sizes", "64", "--roofline-bw-mib", "4", "--roofline-repeats", "1",
           "--batch1-input-len", "8", "--batch1-output-len", "6", "--output-dir", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SKIP llama.cpp: llama-server not found" in r.stdout

    res = json.loads((out / "side_by_side.json").read_text())
    assert "llama.cpp" in res["skipped"]
    rows = {(x["engine"], x["concurrency"]): x for x in res["rows"]}
    assert set(rows) == {("pagedserve", 2), ("hf-naive", 1), ("hf-static", 2), ("hf-cb", 2)}
    assert "closed loop C=2" in rows[("hf-cb", 2)]["notes"]
    for row in rows.values():
        assert row["completed"] == 4 and row["failed"] == 0
        assert row["exact_lengths"], row  # ignore_eos + max_tokens honoured: 6 tokens each
        assert row["total_output_tokens"] == 24 and row["total_input_tokens"] == 64
        assert row["output_tok_s"] > 0 and row["ttft_p50_ms"] > 0
        assert 0 < row["fraction_of_matmul_peak"] and row["achieved_flops"] > 0
    assert (out / "pagedserve-c2.json").is_file()  # the `bench serve --save-result` JSON
    vs = {q["vs_engine"] for q in res["ratios"]}
    assert vs == {"hf-naive", "hf-static", "hf-cb"}
    assert res["machine"]["matmul_flops"] > 0 and res["batch1_bound_ms"] > 0
    assert res["batch1_decode"]["pagedserve"]["ms_per_token"] > 0
    md = (out / "side_by_side.md").read_text()
    assert "| engine | C |" in md and "output tok/s" in md and "Roofline" in md and "batch-1 decode" in md
    assert "| HF continuous batching | 2 |" in md
    assert "params, float32); 1 threads per engine;" in md and "(float32 GEMM n=64)" in md  # the run's dtype


def run_script(name: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", name), *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=str(cwd))


def test_cpu_path_ab_tiny(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path / "tiny")
    r = run_script("cpu_path_ab.py", ["--model", str(model), "--batch-sizes", "1,3", "--context", "20", "--rounds", "1",
                                      "--steps", "2", "--threads", "1"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 7  # B, five variants, the ratio
        assert all(float(c) > 0 for c in cells[1:6]) and cells[6].endswith("x")


def test_batch1_alternating_without_llama_server(tmp_path):
    r = run_script("batch1_alternating.py", ["--model", str(tmp_path), "--gguf", str(tmp_path / "x.gguf"),
                                             "--llama-server", str(tmp_path / "no-such-llama-server")], tmp_path)
    assert r.returncode != 0 and "llama-server not found" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
