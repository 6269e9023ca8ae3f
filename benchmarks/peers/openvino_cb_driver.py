"""Closed-loop driver for OpenVINO GenAI's ContinuousBatchingPipeline (run with the OpenVINO venv's python).

OpenVINO GenAI has no HTTP server, so benchmarks/cpu_peers.py runs this script in the peer's own virtualenv and
drives the pipeline in-process, the way a server loop would: keep C requests in flight, call ``step()``, read what
every request's GenerationHandle has produced since the last read, and add the next request as soon as one
finishes.  Each read that yields new tokens is one "chunk" (as one streamed SSE chunk is for an HTTP server), so
TTFT = add_request -> first chunk and ITL = gap between consecutive chunks of a request, the definitions of
pagedserve/benchmarks/metrics.py.  No HTTP, no JSON, no detokenization: this is the engine alone, a (small)
advantage over the engines measured through their servers.

This file imports only openvino, openvino_genai, numpy and the standard library (not pagedserve), so it runs in
the peer's venv.  Usage:

    /work/peers/openvino/bin/python benchmarks/peers/openvino_cb_driver.py SPEC.json OUT.json

SPEC.json: {"model_dir", "device", "properties": {...}, "scheduler": {...SchedulerConfig fields...},
            "requests": [{"prompt": [ids], "output_len": n}, ...], "concurrencies": [C, ...],
            "requests_by_concurrency": {"C": [...]} (optional: another request list for that C),
            "warmup": bool (default true: before every C, the first request alone, unmeasured, as bench serve does)}
OUT.json:  {"versions": {...}, "properties_in_effect": {...}, "runs": {"C": {"duration": s, "requests": [
            {"success", "prompt_len", "output_tokens", "ttft", "itl": [...], "latency", "start_time", "error"}]}}}
(times in seconds from time.perf_counter, per request in the order of "requests").
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # closed_loop.py, beside this file
from closed_loop import ClosedLoop  # noqa: E402


def log(msg: str) -> None:
    print(f"[openvino driver] {msg}", flush=True)


def generation_config(ov_genai, n: int):
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = n
    cfg.min_new_tokens = n
    cfg.ignore_eos = True
    cfg.do_sample = False  # greedy
    return cfg


def make_pipeline(ov_genai, spec: dict):
    sc = ov_genai.SchedulerConfig()
    for k, v in spec.get("scheduler", {}).items():
        if not hasattr(sc, k):
            raise SystemExit(f"SchedulerConfig has no field {k!r} in this openvino_genai")
        setattr(sc, k, v)
    props = dict(spec.get("properties", {}))
    return ov_genai.ContinuousBatchingPipeline(spec["model_dir"], sc, spec.get("device", "CPU"), props), sc


def run_closed_loop(ov, ov_genai, pipe, requests: list[dict], conc: int, id_base: int) -> dict:
    import numpy as np

    running = ov_genai.GenerationStatus.RUNNING
    finished = ov_genai.GenerationStatus.FINISHED
    loop = ClosedLoop(requests, conc)
    handles = {}
    while loop.running():
        for i in loop.to_submit():
            r = requests[i]
            ids = ov.Tensor(np.asarray([r["prompt"]], dtype=np.int64))
            t = time.perf_counter()
            handles[i] = pipe.add_request(id_base + i, ids, generation_config(ov_genai, int(r["output_len"])))
            loop.submitted(i, t)
        pipe.step()
        now = time.perf_counter()
        for i in list(loop.active):
            h = handles[i]
            new = 0
            while h.can_read():
                outs = h.read()
                vals = outs.values() if hasattr(outs, "values") else outs
                for o in vals:
                    new += len(o.generated_ids)
            loop.new_tokens(i, new, now)
            status = h.get_status()
            if status != running:
                loop.finished(i, status == finished, f"status {status}")
                del handles[i]
    return loop.result()


def main(argv: list[str]) -> int:
    spec_path, out_path = argv[1], argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    import openvino as ov
    import openvino_genai as ov_genai

    versions = {"openvino": ov.get_version(), "openvino_genai": getattr(ov_genai, "__version__", "?")}
    log(f"versions {versions}; loading {spec['model_dir']} with properties {spec.get('properties')} "
        f"and scheduler {spec.get('scheduler')}")
    t = time.perf_counter()
    pipe, _ = make_pipeline(ov_genai, spec)
    log(f"pipeline ready in {time.perf_counter() - t:.1f} s")
    in_effect = {}
    try:
        core = ov.Core()
        for k in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION",
                  "DYNAMIC_QUANTIZATION_GROUP_SIZE", "INFERENCE_NUM_THREADS"):
            try:
                in_effect[f"CPU default {k}"] = str(core.get_property(spec.get("device", "CPU"), k))
            except Exception:
                pass
    except Exception:
        pass
    id_base = 0
    runs = {}
    for c in spec["concurrencies"]:
        requests = spec.get("requests_by_concurrency", {}).get(str(c), spec["requests"])
        id_base += 100_000
        if spec.get("warmup", True) and requests:
            # what `pagedserve bench serve` does before every run ("initial single prompt test run"): the first
            # request of the workload, alone, unmeasured
            run_closed_loop(ov, ov_genai, pipe, requests[:1], 1, id_base + 50_000)
            log(f"C={c}: warm-up request done")
        log(f"C={c}: {len(requests)} requests, closed loop ...")
        res = run_closed_loop(ov, ov_genai, pipe, requests, int(c), id_base)
        out_tok = sum(r["output_tokens"] for r in res["requests"])
        log(f"C={c}: {res['duration']:.1f} s, {out_tok / res['duration']:.1f} output tok/s")
        runs[str(c)] = res
        with open(out_path, "w") as f:  # after every C, so a later crash keeps what was measured
            json.dump({"versions": versions, "properties_in_effect": in_effect, "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
