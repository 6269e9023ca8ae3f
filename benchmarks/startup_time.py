"""Ready in seconds (issues 11 and 49): from `pagedserve serve` process start to /health 200, the server's own
stage-by-stage account of that time, and the first request's latency against the tenth's.

    python benchmarks/startup_time.py [MODEL ...] --runs 2 --max-tokens 16
    python benchmarks/startup_time.py --wheel dist/pagedserve-*.whl [MODEL ...]   # as a new user: a fresh venv

MODEL: checkpoint dirs, or `demo` for the embedded demo model (the default). Every run starts with an empty TORCH_EXTENSIONS_DIR (so a
build that has no usable prebuilt kernels compiles them and shows it), then --runs more reuse it. With --wheel, a
fresh venv is made first and the wheel installed into it with pip's cache off (timed), and the servers run from
that venv, so nothing of this checkout is used. For each model, the weights' read speed: the safetensors files read
once cold (page cache dropped, where this process may: root on Linux) and once warm, so that the "model load" stage
can be set against the disk.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_helpers import free_port  # noqa: E402


def one_run(python: str, model: str | None, ext_dir: str, max_tokens: int, num_threads: int,
            log_path: Path) -> dict:
    port = free_port()
    cmd = [python, "-m", "pagedserve.entrypoints.cli", "serve", *([model] if model else []),
           "--port", str(port), "--num-threads", str(num_threads), "--disable-uvicorn-access-log"]
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=ext_dir)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
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
    finally:
        proc.terminate()
        proc.wait(60)
    stages = re.search(r"Start-up stages: (.*)", log_path.read_text())
    return {"ready_s": ready, "first_request_s": latencies[0], "tenth_request_s": latencies[-1],
            "stages": stages.group(1) if stages else "(no stage line)"}


def weights_read_speed(model_dir: Path) -> tuple[float, float | None, float]:
    """GiB of safetensors, and the GB/s of reading them cold (None where the page cache cannot be dropped), warm."""
    files = sorted(model_dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)

    def read_all() -> float:
        t = time.perf_counter()
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
        return size / (time.perf_counter() - t) / 1e9

    cold = None
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        cold = read_all()
    except OSError:
        pass
    return size / 2**30, cold, read_all()


def fresh_venv_with(wheel: str, work: Path) -> tuple[str, float]:
    """A new venv with the wheel installed (pip's cache off); returns its python and the seconds it took."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
    python = str(work / "venv" / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-cache-dir", wheel], check=True)
    return python, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", default=["demo"], help="checkpoint dirs, or demo (the default)")
    p.add_argument("--wheel", default=None, help="install this wheel into a fresh venv and serve from it")
    p.add_argument("--runs", type=int, default=2, help="runs after the first, reusing its kernel cache")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        python = sys.executable
        if args.wheel:
            python, install_s = fresh_venv_with(args.wheel, work)
            print(f"fresh venv + `pip install {Path(args.wheel).name}` (no pip cache): {install_s:.1f} s\n")
        print("| model | run | start -> /health 200 (s) | first request (s) | tenth request (s) | the server's stages |")
        print("| --- | --- | ---: | ---: | ---: | --- |")
        models = [None if m == "demo" else m for m in args.models]
        for model in models:
            name = Path(model).name if model else "demo (embedded)"
            ext_dir = work / f"ext-{name}"
            for run in range(1 + args.runs):
                r = one_run(python, model, str(ext_dir), args.max_tokens, args.num_threads, work / "serve.log")
                label = "empty kernel cache" if run == 0 else "again"
                print(f"| {name} | {label} | {r['ready_s']:.1f} | {r['first_request_s']:.3f} | "
                      f"{r['tenth_request_s']:.3f} | {r['stages']} |")
        print()
        for model in models:
            if model:
                gib, cold, warm = weights_read_speed(Path(model))
                cold_text = "n/a (cannot drop the page cache)" if cold is None else f"{cold:.2f} GB/s"
                print(f"{Path(model).name}: {gib:.2f} GiB of safetensors read cold {cold_text}, warm {warm:.2f} GB/s")


if __name__ == "__main__":
    main()
