"""The event loop's CPU per streamed SSE chunk, the model taken out: `build_app` around AsyncLLM with the tests' fake
engine (one token per step per request, a fixed sleep as the step), served by uvicorn in a subprocess; this process
streams C concurrent /v1/completions requests, W waves, and reads the server's account (GET /metrics,
`pagedserve:server_profile_*`) before and after. What is left per chunk is the server's own path: delivering the
step's outputs, the SSE generator, JSON, the HTTP send and the socket write (issue 50).

    python benchmarks/sse_chunk_cost.py --tree before=/work/main --tree after=. --rounds 3

Several --tree LABEL=PYTHONPATH run in alternating rounds (A B, B A, ...): the CPU clocks of one thread move less with
a busy machine than wall time, but still move, so compare only within a round. Prints one JSON line per run and
the medians per tree.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def serve(port: int, step_sleep: float) -> None:
    """The server side (run with the tree's PYTHONPATH, the tree as working directory)."""
    sys.path.insert(0, os.getcwd())
    from types import SimpleNamespace

    import uvicorn

    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.entrypoints.openai.api_server import build_app
    from tests.entrypoints.test_server_async_llm import FakeEngine

    llm = AsyncLLM(FakeEngine(step_sleep=step_sleep), log_stats=False)
    app = build_app(llm, SimpleNamespace(api_key=None), shutdown_engine_on_exit=False)
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        llm.shutdown()


async def load(port: int, concurrency: int, tokens: int, waves: int) -> dict[str, float]:
    import httpx

    from pagedserve.metrics.server_profile import profile_from_metrics

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        async def one() -> None:
            body = {"prompt": "hi", "max_tokens": tokens, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_raw():
                    pass

        await one()  # the account knows the event-loop thread from its first delivery on
        before = profile_from_metrics((await c.get("/metrics")).text)
        for _ in range(waves):
            await asyncio.gather(*[one() for _ in range(concurrency)])
        after = profile_from_metrics((await c.get("/metrics")).text)
    return {k: after[k] - before[k] for k in after}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(label: str, tree: str, args: argparse.Namespace) -> dict:
    import httpx

    port = free_port()
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", str(port), str(args.step_sleep)],
                              cwd=tree, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"{label}: the server never answered")
                time.sleep(0.2)
        d = asyncio.run(load(port, args.concurrency, args.tokens, args.waves))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    chunks = max(d["chunks"], 1.0)
    per_chunk = {name: round(d[key] / chunks * 1e6, 1) for name, key in (
        ("loop_cpu_us", "loop_thread_cpu"), ("process_cpu_us", "process_cpu"), ("send_us", "send"),
        ("encode_us", "encode"), ("deliver_us", "deliver"))}
    return {"tree": label, "chunks": d["chunks"], **per_chunk, "load_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=PYTHONPATH",
                   help="a checkout to serve from (repeatable); default: this one")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=50, help="max_tokens per request (the fake's model length is 64)")
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.03, help="the fake engine's step, seconds")
    p.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(int(args.serve[0]), float(args.serve[1]))
        return 0
    trees = [t.split("=", 1) for t in args.tree] or [["this", os.path.dirname(HERE)]]
    results: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for k in range(args.rounds):
        for label, tree in (trees if k % 2 == 0 else trees[::-1]):
            r = run(label, os.path.abspath(tree), args)
            print(json.dumps({"round": k, **r}), flush=True)
            results[label].append(r)
    for label, rows in results.items():
        med = {key: statistics.median(r[key] for r in rows) for key in ("loop_cpu_us", "send_us", "encode_us")}
        print(f"{label}: median over {len(rows)} rounds, us per chunk: event-loop CPU {med['loop_cpu_us']:.1f}, "
              f"send {med['send_us']:.1f} (wall), encode {med['encode_us']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
