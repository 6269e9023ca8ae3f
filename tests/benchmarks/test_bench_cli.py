"""Every `pagedserve bench` subcommand end to end on a tiny random model: a few requests, well-formed JSON."""
import argparse
import json
import os

import pytest

from pagedserve.benchmarks.cli import add_bench_parser

pytestmark = pytest.mark.slow

ENGINE = ["--num-threads", "1", "--num-kv-blocks", "256", "--max-model-len", "512", "--dtype", "float32"]


def run_bench(argv):
    parser = argparse.ArgumentParser(prog="pagedserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("bench_model") / "tiny")
    assert run_bench(["make-model", "--shape", "tiny-llama", "--out", d, "--override", "num_layers=1"]) == 0
    return d


def test_make_model(model):
    cfg = json.load(open(os.path.join(model, "config.json")))
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == 64 and cfg["vocab_size"] == 512
    assert os.path.exists(os.path.join(model, "model.safetensors"))


def test_roofline(tmp_path, capsys):
    out = tmp_path / "roof.json"
    assert run_bench(["roofline", "--shape", "smollm2-135m", "--sizes", "64,128", "--repeats", "1", "--bw-mib", "4",
                      "--threads", "1", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["machine"]["matmul_flops"] > 0 and r["roofline"]["b_sat"] > 0
    assert r["roofline"]["params"] == 134_515_008
    assert "B_sat" in capsys.readouterr().out


def test_throughput(model, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert run_bench(["throughput", "--model", model, *ENGINE, "--num-prompts", "5", "--input-len", "16",
                      "--output-len", "4", "--output-json", str(out), "--disable-tqdm"]) == 0
    r = json.loads(out.read_text())
    assert r["num_requests"] == 5 and r["total_input_tokens"] == 80 and r["total_output_tokens"] == 20
    assert r["total_num_tokens"] == 100
    assert r["requests_per_second"] > 0 and r["tokens_per_second"] > r["output_tokens_per_second"] > 0
    assert "Throughput:" in capsys.readouterr().out


def test_throughput_mixed_dataset(model, tmp_path):
    out = tmp_path / "t.json"
    assert run_bench(["throughput", "--model", model, *ENGINE, "--max-model-len", "2048", "--num-kv-blocks", "1024",
                      "--dataset-name", "mixed", "--num-prompts", "3", "--output-json", str(out),
                      "--disable-tqdm"]) == 0
    r = json.loads(out.read_text())
    assert r["num_requests"] == 3 and r["dataset_name"] == "mixed"


def test_latency(model, tmp_path):
    out = tmp_path / "l.json"
    assert run_bench(["latency", "--model", model, *ENGINE, "--batch-size", "3", "--input-len", "8", "--output-len",
                      "4", "--num-iters", "2", "--num-iters-warmup", "1", "--output-json", str(out),
                      "--disable-tqdm"]) == 0
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 2 and r["avg_latency"] > 0
    assert set(r["percentiles"]) == {"10", "25", "50", "75", "90", "99"}


def test_latency_batch_sweep(model, tmp_path, capsys):
    roof = tmp_path / "roof.json"
    roof.write_text(json.dumps({"machine": {"threads": 1, "matmul_flops": 5e10, "matmul_size": 1024,
                                            "copy_bandwidth": 1e10, "sum_bandwidth": 1e10, "gemv_bandwidth": 1e10}}))
    out = tmp_path / "sweep.json"
    assert run_bench(["latency", "--model", model, *ENGINE, "--batch-sizes", "1,2,4", "--input-len", "8",
                      "--output-len", "6", "--roofline-json", str(roof), "--output-json", str(out),
                      "--disable-tqdm"]) == 0
    r = json.loads(out.read_text())
    assert [row["batch_size"] for row in r["rows"]] == [1, 2, 4]
    for row in r["rows"]:
        assert row["num_decode_steps"] > 0 and row["step_ms_median"] > 0 and row["roofline_step_ms"] > 0
    assert r["b_sat_roofline"] == pytest.approx(5e10 * 4 / (2 * 1e10))  # fp32 CPU
    assert r["b_sat_measured"] in (1, 2, 4)
    assert os.path.getsize(r["plot"]) > 1000
    assert "B_sat" in capsys.readouterr().out


def test_compare(model, tmp_path):
    out = tmp_path / "cmp"
    assert run_bench(["compare", "--model", model, *ENGINE, "--dataset-name", "random", "--num-prompts", "6",
                      "--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "0.5",
                      "--random-prefix-len", "16", "--static-batch-size", "3", "--output-dir", str(out),
                      "--disable-tqdm"]) == 0
    r = json.loads((out / "compare.json").read_text())
    # a workload with a shared prefix also gets the prefix-caching row; HF baselines by default
    assert r["modes"] == ["naive", "static", "continuous", "chunked", "prefix", "hf-naive", "hf-static"]
    for mode, s in r["summaries"].items():
        assert s["completed"] == 6, mode
        assert s["total_output_tokens"] == sum(len(q["token_times"]) for q in r["traces"][mode]["requests"])
        for key in ("output_throughput", "total_token_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms",
                    "p99_itl_ms", "kv_waste_paged", "kv_waste_contiguous_max_len"):
            assert key in s, (mode, key)
        assert 0.0 <= s["kv_waste_paged"] < 1.0
    eng = r["summaries"]["chunked"]
    assert eng["kv_waste_paged"] < eng["kv_waste_contiguous_max_len"]  # paging wastes at most the last block
    assert r["summaries"]["prefix"]["prefix_cache_hit_rate"] > 0
    assert r["summaries"]["continuous"]["prefix_cache_hit_rate"] == 0
    assert r["traces"]["chunked"]["steps"][0]["budget"] == 2048
    table = (out / "compare.md").read_text()
    for label in ("NAIVE", "STATIC", "CONTINUOUS", "CONTINUOUS+CHUNKED", "+PREFIX-CACHING", "HF generate"):
        assert f"| {label}" in table
    for png in ("throughput.png", "latency_cdf.png", "timeline_chunked.png", "timeline_static.png"):
        assert (out / png).stat().st_size > 1000


def test_compare_static_waits_for_the_whole_batch(model, tmp_path):
    out = tmp_path / "cmp"
    assert run_bench(["compare", "--model", model, *ENGINE, "--dataset-name", "random", "--num-prompts", "4",
                      "--random-input-len", "8", "--random-output-len", "8", "--random-range-ratio", "0.9",
                      "--modes", "static", "--static-batch-size", "2", "--output-dir", str(out),
                      "--disable-tqdm"]) == 0
    r = json.loads((out / "compare.json").read_text())
    reqs = r["traces"]["static"]["requests"]
    first, second = reqs[:2], reqs[2:]
    end_first = max(q["token_times"][-1] for q in first)
    assert all(q["token_times"][0] > end_first for q in second)  # the next batch starts after the slowest
    assert max(s["running"] for s in r["traces"]["static"]["steps"]) <= 2
    # padding is computed but not counted: each batch prefills 2 x its longest prompt and decodes to its longest
    # output, while every request reports exactly its own output length
    steps = r["traces"]["static"]["steps"]
    assert all(len(q["token_times"]) == q["max_tokens"] for q in reqs)
    computed = sum(st["scheduled_tokens"] for st in steps)
    own = sum(q["prompt_len"] + q["max_tokens"] for q in reqs)
    assert computed > own - len(reqs)


def test_chunked_itl(model, tmp_path):
    out = tmp_path / "citl"
    assert run_bench(["chunked-itl", "--model", model, *ENGINE, "--budgets", "32,64", "--long-prompt-len", "100",
                      "--num-long", "2", "--decode-output-len", "30", "--insert-after", "5", "--long-output-len", "2",
                      "--output-dir", str(out)]) == 0
    r = json.loads((out / "chunked_itl.json").read_text())
    rows = {row["config"]: row for row in r["rows"]}
    assert set(rows) == {"chunked 32", "chunked 64", "unchunked"}
    assert rows["chunked 32"]["max_num_batched_tokens"] == 32
    # 2 x 100 prompt tokens in 32-token chunks take >= 7 prefill steps; unchunked does them in one
    assert rows["chunked 32"]["prefill_steps_in_window"] >= 7
    assert rows["unchunked"]["prefill_steps_in_window"] == 1
    for row in rows.values():
        assert row["max_itl_window_ms"] > 0 and row["long_ttft_max_ms"] >= row["long_ttft_min_ms"] > 0
    assert (out / "chunked_itl.png").stat().st_size > 1000
    assert "| unchunked |" in (out / "chunked_itl.md").read_text()
