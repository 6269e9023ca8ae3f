"""Closed-loop driver for pagedserve's engine in-process: the like-for-like row next to OpenVINO GenAI's driver.

OpenVINO GenAI has no HTTP server, so benchmarks/cpu_peers.py measures it in-process (peers/openvino_cb_driver.py):
no HTTP, no SSE, no benchmark client sharing the cores. pagedserve is measured through `pagedserve serve` and
`bench serve`, which on a 2-core machine also pay for the server's HTTP/SSE work and the client's. This driver runs
pagedserve's `LLMEngine` the way the OpenVINO driver runs its pipeline - keep C requests in flight, `step()`, count
each request's new tokens after every step (one "chunk"), add the next request as soon as one finishes - and writes
the same OUT.json, so the two engines compare without either serving path. Like the OpenVINO driver (which reads
token ids from its handles), it asks for token ids only (SamplingParams(detokenize=False)): no text is built. Until
2026-12-03 it detokenized every new token (output processing 0.56 ms of a 32-sequence bf16 step, 0.31 ms
without).

    python benchmarks/peers/pagedserve_engine_driver.py SPEC.json OUT.json

SPEC.json: {"engine_flags": [the `pagedserve serve` engine flags, e.g. "--dtype", "bfloat16"], "model": path,
            "requests": [{"prompt": [ids], "output_len": n}, ...], "concurrencies": [C, ...],
            "requests_by_concurrency": {"C": [...]} (optional), "warmup": bool (default true)}
OUT.json:  as peers/openvino_cb_driver.py ({"versions", "runs": {"C": {"duration", "requests": [...]}}}).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # closed_loop.py, beside this file
from closed_loop import ClosedLoop  # noqa: E402


def log(msg: str) -> None:
    print(f"[pagedserve engine driver] {msg}", flush=True)


def build_engine(model: str, flags: list[str]):
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine

    p = argparse.ArgumentParser()
    p.add_argument("model")
    EngineArgs.add_cli_args(p)
    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(p.parse_args([model, *flags])))


def run_closed_loop(engine, requests: list[dict], conc: int, id_base: int) -> dict:
    """The run's result, with "profile": the server's per-step totals (pagedserve/metrics/server_profile.py) for the
    same workload in-process, to compare part by part (benchmarks/server_overhead.py)."""
    from pagedserve.metrics.server_profile import ServerProfile
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams

    loop = ClosedLoop(requests, conc)
    profile = ServerProfile()
    profile.engine_thread = threading.get_ident()  # this thread steps the engine: its CPU clock from the start
    start = profile.snapshot()
    while loop.running():
        for i in loop.to_submit():
            n = int(requests[i]["output_len"])
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                                    output_kind=RequestOutputKind.DELTA)
            t = time.perf_counter()
            engine.add_request(str(id_base + i), list(requests[i]["prompt"]), params)
            loop.submitted(i, t)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        now = time.perf_counter()
        it = engine.last_iteration
        profile.record_step(now - t0, time.thread_time() - cpu0, it.forward_time, it.output_time, now)
        for out in outputs:
            i = int(out.request_id) - id_base
            loop.new_tokens(i, len(out.outputs[0].token_ids) if out.outputs else 0, now)
            if out.finished:
                loop.finished(i, out.error is None, out.error or "")
    end = profile.snapshot()
    return dict(loop.result(), profile={k: end[k] - start.get(k, 0.0) for k in end})


def main(argv: list[str]) -> int:
    spec_path, out_path = argv[1], argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    from pagedserve.envs import set_openmp_defaults

    set_openmp_defaults()  # what `pagedserve serve` runs with; before torch
    import pagedserve
    import torch

    versions = {"pagedserve": getattr(pagedserve, "__version__", "?"), "torch": torch.__version__}
    t = time.perf_counter()
    engine = build_engine(spec["model"], spec["engine_flags"])
    log(f"engine ready in {time.perf_counter() - t:.1f} s (flags {' '.join(spec['engine_flags'])})")
    runs = {}
    id_base = 0
    for c in spec["concurrencies"]:
        requests = spec.get("requests_by_concurrency", {}).get(str(c), spec["requests"])
        id_base += 100_000
        if spec.get("warmup", True) and requests:  # as bench serve and the OpenVINO driver: one request alone first
            run_closed_loop(engine, requests[:1], 1, id_base + 50_000)
        runs[str(c)] = run_closed_loop(engine, requests, c, id_base)
        log(f"C={c}: {len(requests)} requests in {runs[str(c)]['duration']:.1f} s")
        with open(out_path, "w") as f:  # after every C: a later failure keeps the earlier runs
            json.dump({"versions": versions, "runs": runs}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
