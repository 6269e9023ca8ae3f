"""Disaggregated prefill/decode vs one colocated instance, under bursts of long prompts (issue 16, seed 000).

    python benchmarks/pd_disagg.py [--shape smollm2-135m] [--prompt-len 1024] [--burst-size 2] [--num-bursts 3]

Setups with the same total cores (two):
  colocated         one `pagedserve serve --num-threads 2` (default --max-num-batched-tokens: a whole burst in a step)
  colocated-chunked the same with --max-num-batched-tokens `--chunk` (chunked prefill: colocated's own ITL remedy)
  P/D               `pagedserve proxy` in front of a prefill server (kv_producer, 1 thread) and a decode server
                    (kv_consumer, 1 thread) sharing a real redis-server on loopback (or, --store directory, a
                    directory under /dev/shm: files in memory)
Workload, identical for each: `--num-decoders` clients stream steadily (a short prompt, `--decode-tokens` tokens,
then the next request), and once they are decoding, `--num-bursts` bursts of `--burst-size` long prompts
(distinct random token ids, `--prompt-len` tokens, 8 tokens each) arrive `--burst-gap` seconds apart. Measured:
the inter-token latency of the steady streams while the bursts arrive and are served (p50, p99, max) and the TTFT of the burst prompts.
Setups take turns round by round (`--rounds`), medians of each round's percentile. Every server is started here,
on free loopback ports, and stopped at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from test_server_helpers import ServerProcess, free_port, metric_value, start_cli_process  # noqa: E402


def stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """One streamed completion: (TTFT in seconds, the arrival time of each token)."""
    t0 = time.perf_counter()
    arrivals = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                arrivals.append(time.perf_counter())
    return arrivals[0] - t0, arrivals


def one_round(url: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    short = [tokens(32) for _ in range(args.num_decoders)]
    bursts = [[tokens(args.prompt_len) for _ in range(args.burst_size)] for _ in range(args.num_bursts)]
    done = threading.Event()
    arrivals: list[list[float]] = []  # per steady request
    started = threading.Barrier(args.num_decoders + 1)

    def decoder(i: int) -> None:
        turn = 0
        while not done.is_set():
            # a fresh short prompt per request (a prefix-cache hit would skip the P/D prefill path)
            arrivals.append(stream(url, model, short[i] + [100 + turn], args.decode_tokens)[1])
            if turn == 0:
                started.wait()
            turn += 1

    with ThreadPoolExecutor(args.num_decoders + args.burst_size) as pool:
        decoders = [pool.submit(decoder, i) for i in range(args.num_decoders)]
        started.wait()  # every steady stream has finished one request: all are decoding now
        ttfts = []
        window_start = time.perf_counter()
        for i, burst in enumerate(bursts):
            if i:
                time.sleep(args.burst_gap)
            ttfts += [ttft for ttft, _ in pool.map(lambda p: stream(url, model, p, 8), burst)]
        window_end = time.perf_counter()
        done.set()
        for d in decoders:
            d.result()
    # the steady streams' inter-token gaps that ended while the bursts were arriving or being served
    itls = [b - a for times in arrivals for a, b in zip(times, times[1:]) if window_start < b <= window_end]
    q = statistics.quantiles(itls, n=100, method="inclusive")
    return {"itl_p50": statistics.median(itls), "itl_p99": q[98], "itl_max": max(itls),
            "ttft_p50": statistics.median(ttfts), "ttft_max": max(ttfts), "num_itls": len(itls),
            "window_s": window_end - window_start}


def start_store(kind: str, workdir: Path) -> tuple[dict, subprocess.Popen | None]:
    if kind == "directory":  # one file per block, in memory when /dev/shm is there (tmpfs: same-host transfer)
        return {"kv_connector": "directory", "path": str(workdir / "kv")}, None
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return {"kv_connector": "redis", "url": f"redis://127.0.0.1:{port}"}, proc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--burst-size", type=int, default=2)
    ap.add_argument("--num-bursts", type=int, default=3)
    ap.add_argument("--burst-gap", type=float, default=1.0)
    ap.add_argument("--num-decoders", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens of colocated-chunked")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--store", choices=["redis", "directory"], default="redis")
    args = ap.parse_args()
    from pagedserve.benchmarks.shapes import get_shape, make_model

    model_dir = Path(tempfile.gettempdir()) / f"pagedserve-bench-{args.shape}"
    if not (model_dir / "config.json").exists():
        make_model(get_shape(args.shape), str(model_dir), dtype="bfloat16")
    if args.store == "redis" and shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed; use --store directory")
    workdir = Path(tempfile.mkdtemp(prefix="pagedserve-pd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    store, redis_proc = start_store(args.store, workdir)
    max_len = args.prompt_len + 64
    blocks = (args.num_decoders + args.burst_size) * (max_len // 16 + 2) * 2
    common = ("--dtype", args.dtype, "--max-model-len", str(max_len), "--num-kv-blocks", str(blocks),
              "--max-num-seqs", "32")

    def serve(extra: tuple[str, ...]) -> ServerProcess:
        # the --num-threads of `extra` wins over ServerProcess's own (argparse: last one wins)
        return ServerProcess(model_dir, common + extra, startup_timeout=600)

    configs = {
        "colocated": ("--num-threads", "2"),
        "colocated-chunked": ("--num-threads", "2", "--max-num-batched-tokens", str(args.chunk)),
        "prefill": ("--num-threads", "1", "--kv-transfer-config", json.dumps({**store, "kv_role": "kv_producer"})),
        "decode": ("--num-threads", "1", "--kv-transfer-config", json.dumps({**store, "kv_role": "kv_consumer"})),
    }
    servers: dict[str, ServerProcess] = {}
    proxy = None
    try:
        for name, extra in configs.items():  # one at a time: start-up compiles kernels on a loaded machine
            servers[name] = serve(extra)
        proxy, proxy_url = start_cli_process("proxy", "--prefill", servers["prefill"].url,
                                             "--decode", servers["decode"].url)
        model = httpx.get(servers["decode"].url + "/v1/models").json()["data"][0]["id"]
        urls = {"colocated": servers["colocated"].url, "colocated-chunked": servers["colocated-chunked"].url,
                "P/D": proxy_url}
        load = [os.getloadavg()[0]]
        rounds: dict[str, list[dict]] = {name: [] for name in urls}
        for r in range(args.rounds):
            for name, url in urls.items():
                rounds[name].append(one_round(url, model, args, seed=1000 * r + len(rounds[name])))
                load.append(os.getloadavg()[0])
                print(f"round {r} {name}: {rounds[name][-1]}", flush=True)
        hits = metric_value(httpx.get(servers["decode"].url + "/metrics").text,
                            "pagedserve:external_prefix_cache_hits_total")
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for s in servers.values():
            s.stop()
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"\n# {args.shape} {args.dtype}; {args.num_decoders} steady streams of {args.decode_tokens} tokens; "
          f"{args.num_bursts} bursts of {args.burst_size} x {args.prompt_len}-token prompts, {args.burst_gap} s "
          f"apart; {args.rounds} rounds; store {args.store}; load average {min(load):.1f}-{max(load):.1f}")
    print("| setup | decode ITL p50 (ms) | decode ITL p99 (ms) | decode ITL max (ms) | burst TTFT p50 (ms) | "
          "burst TTFT max (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    for name, m in med.items():
        print(f"| {name} | {m['itl_p50'] * 1e3:.0f} | {m['itl_p99'] * 1e3:.0f} | {m['itl_max'] * 1e3:.0f} | "
              f"{m['ttft_p50'] * 1e3:.0f} | {m['ttft_max'] * 1e3:.0f} |")
    for base in ("colocated", "colocated-chunked"):
        print(f"ITL p99 {base} / P/D: {med[base]['itl_p99'] / med['P/D']['itl_p99']:.2f}x")
    print(f"tokens the decode server loaded from the store: {hits:.0f}")


if __name__ == "__main__":
    main()
