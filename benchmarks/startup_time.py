"""Time from `pagedserve serve` process start to /health 200, and the first request's latency after that, with
an empty and with a warm native-kernel cache (issue 11: ready means ready).

    python benchmarks/startup_time.py [MODEL] --runs 2 --max-tokens 16

MODEL defaults to the embedded demo model. The empty-cache run uses a fresh TORCH_EXTENSIONS_DIR (so it
compiles the kernels); the warm runs reuse it. For each run: seconds to the first /health 200 (the port
opens only when the engine is ready), then the latency of a first and a tenth identical greedy request.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(model: str | None, ext_dir: str, max_tokens: int, num_threads: int) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", *([model] if model else []),
           "--port", str(port), "--num-threads", str(num_threads), "--disable-uvicorn-access-log"]
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=ext_dir)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        body = {"prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0}
        latencies = []
        for _ in range(10):
            t = time.perf_counter()
            httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
            latencies.append(time.perf_counter() - t)
        return {"ready_s": ready, "first_request_s": latencies[0], "tenth_request_s": latencies[-1]}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--runs", type=int, default=2, help="warm-cache runs after the empty-cache one")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as ext_dir:
        rows = [("empty kernel cache", one_run(args.model, ext_dir, args.max_tokens, args.num_threads))]
        rows += [("warm kernel cache", one_run(args.model, ext_dir, args.max_tokens, args.num_threads))
                 for _ in range(args.runs)]
    print("| kernel cache | start -> /health 200 (s) | first request (s) | tenth request (s) |")
    print("| --- | --- | --- | --- |")
    for name, r in rows:
        print(f"| {name} | {r['ready_s']:.1f} | {r['first_request_s']:.3f} | {r['tenth_request_s']:.3f} |")


if __name__ == "__main__":
    main()
