"""`pagedserve serve --data-parallel-size N`: N replicas of the server, each its own process with its own engine
and KV pool, on free loopback ports, behind the cache-aware router (entrypoints/router.py) on --host/--port.

The replicas get the command line as given (minus the data-parallel flag, with their own host and port); unless
the command line says otherwise, each gets 1/N of the cores (--num-threads) and of the KV cache memory fraction,
so that N engines on one machine do not each size themselves for all of it. The router binds only once every
replica answers /health (ready means ready); a replica that dies later is routed around, one that dies during
start-up stops the launch. SIGINT/SIGTERM stop the router, then the replicas (each drains as `serve` does).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from pagedserve.entrypoints.router import Router, build_app

logger = logging.getLogger("pagedserve")

DP_FLAGS = ("--data-parallel-size", "-dp")


def add_data_parallel_arg(serve_parser: argparse.ArgumentParser) -> None:
    serve_parser.add_argument(*DP_FLAGS, type=int, default=1, dest="data_parallel_size",
                              help="run N replicas of this server behind the cache-aware router (vLLM's name)")


def replica_argv(argv: list[str], args: argparse.Namespace, port: int) -> list[str]:
    """The `serve` command line of one replica: argv without the data-parallel flag, bound to loopback:port."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in DP_FLAGS:
            skip = True  # its value follows
        elif not arg.startswith(tuple(f + "=" for f in DP_FLAGS)):
            out.append(arg)
    n = args.data_parallel_size
    if args.num_threads is None:
        out += ["--num-threads", str(max(1, (os.cpu_count() or 1) // n))]
    if args.num_kv_blocks is None and args.kv_cache_memory_bytes is None:
        out += ["--kv-cache-memory-fraction", str(args.kv_cache_memory_fraction / n)]
    return out + ["--host", "127.0.0.1", "--port", str(port)]  # argparse: the last --host/--port win


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_data_parallel(args: argparse.Namespace, argv: list[str]) -> int:
    if args.data_parallel_size < 2:
        raise ValueError(f"data_parallel_size must be >= 2 to launch replicas, got {args.data_parallel_size}.")
    # a SIGTERM before the router runs (it installs its own handlers) must still stop the replicas: finally below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ports = [free_loopback_port() for _ in range(args.data_parallel_size)]
    replicas = [subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", *replica_argv(argv, args, p)])
                for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        if not wait_until_healthy(replicas, urls):
            return 1
        logger.info("%d replicas ready (%s); router on http://%s:%d", len(urls), " ".join(urls), args.host, args.port)
        import uvicorn

        # uvicorn handles SIGINT/SIGTERM while it runs, then raises the signal again for the previous handler:
        # ignore that one, the replicas are stopped below either way
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        uvicorn.run(build_app(Router(urls)), host=args.host, port=args.port, log_level="warning")
    finally:
        stop(replicas, args.shutdown_timeout + 10)
    return 0


def wait_until_healthy(replicas: list[subprocess.Popen], urls: list[str]) -> bool:
    """True once every replica answers /health 200; False as soon as one exits (start-up failed)."""
    pending = set(range(len(urls)))
    while pending:
        for i in list(pending):
            if replicas[i].poll() is not None:
                logger.error("replica %s exited with %d during start-up", urls[i], replicas[i].returncode)
                return False
            try:
                if httpx.get(urls[i] + "/health", timeout=2.0).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        time.sleep(0.25)
    return True


def stop(replicas: list[subprocess.Popen], timeout: float) -> None:
    for proc in replicas:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in replicas:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
