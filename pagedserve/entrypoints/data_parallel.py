"""`pagedserve serve --data-parallel-size N`: N replicas of the server, each its own process with its own engine
and KV pool, on free loopback ports, behind the cache-aware router (entrypoints/router.py) on --host/--port.

The replicas get the command line as given (minus the data-parallel flag, with their own host and port); unless
the command line says otherwise, each gets 1/N of the cores (--num-threads) and of the KV cache memory fraction,
so that N engines on one machine do not each size themselves for all of it. The router binds only once every
replica answers /health (ready means ready); one that dies during start-up stops the launch. A replica that dies
later is routed around and restarted with back-off (ReplicaSupervisor, logged). SIGINT/SIGTERM stop the router,
then the replicas (each drains as `serve` does); if the launcher dies any other way (SIGKILL, OOM) the kernel
SIGTERMs the replicas (PR_SET_PDEATHSIG), so none is left running. The router checks the API key and
--max-request-body-bytes of the command line before any body is read (entrypoints/http_relay.py).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pagedserve.entrypoints.http_relay import RelayConfig
from pagedserve.entrypoints.router import Router, build_app

logger = logging.getLogger("pagedserve")

DP_FLAGS = ("--data-parallel-size", "-dp")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
    config = RelayConfig.from_args(args)  # the replicas' API key and body limit, checked by the router first
    # a SIGTERM before the router runs (it installs its own handlers) must still stop the replicas: finally below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ports = [free_loopback_port() for _ in range(args.data_parallel_size)]
    replicas = [Replica(f"http://127.0.0.1:{p}", [sys.executable, "-m", "pagedserve.entrypoints.cli",
                                                   *replica_argv(argv, args, p)]) for p in ports]
    supervisor = ReplicaSupervisor(replicas)
    try:
        for r in replicas:
            r.start()
        if not wait_until_healthy(replicas):
            return 1
        urls = [r.url for r in replicas]
        logger.info("%d replicas ready (%s); router on http://%s:%d", len(urls), " ".join(urls), args.host, args.port)
        supervisor.start()
        import uvicorn

        # uvicorn handles SIGINT/SIGTERM while it runs, then raises the signal again for the previous handler:
        # ignore that one, the replicas are stopped below either way
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        uvicorn.run(build_app(Router(urls), config), host=args.host, port=args.port, log_level="warning")
    finally:
        supervisor.stop()  # first: nothing is restarted while the replicas are stopped
        stop(replicas, args.shutdown_timeout + 10)
    return 0


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel SIGTERM the child when this process dies, however it dies (SIGKILL
    included): no orphaned replica. Linux only (prctl PR_SET_PDEATHSIG); looked up here, so the forked child
    only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call: nobody would signal us
            os._exit(1)

    return set_signal


@dataclass(eq=False)
class Replica:
    url: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0

    def start(self) -> None:
        # the death signal fires when the thread that forked exits: replicas are forked by the main thread or the
        # supervisor's, both of which live as long as the launcher (ReplicaSupervisor.stop)
        self.proc = subprocess.Popen(self.argv, preexec_fn=_parent_death_signal())
        self.started_at = time.monotonic()


class ReplicaSupervisor:
    """Restarts a replica that exited, after a back-off that doubles with each quick death (from 1 s, at most
    MAX_BACKOFF_S) and resets once a replica has stayed up STABLE_AFTER_S; every exit and restart is logged. The
    router routes around the replica meanwhile (its health check) and back once it is healthy."""

    POLL_S = 0.5
    MAX_BACKOFF_S = 30.0
    STABLE_AFTER_S = 60.0

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self._stopping, self._stopped = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No restart after this returns. The thread itself stays parked until the launcher exits: the replicas it
        forked get their death signal when it ends, and a second SIGTERM would cut their drain short."""
        self._stopping.set()
        if self._thread.is_alive():
            self._stopped.wait()

    def _run(self) -> None:
        self._supervise()
        self._stopped.set()
        threading.Event().wait()

    def _supervise(self) -> None:
        backoff = {id(r): 1.0 for r in self.replicas}
        restart_at: dict[int, float] = {}
        while not self._stopping.wait(self.POLL_S):
            now = time.monotonic()
            for r in self.replicas:
                assert r.proc is not None
                if r.proc.poll() is None:
                    if now - r.started_at > self.STABLE_AFTER_S:
                        backoff[id(r)] = 1.0
                    continue
                if id(r) not in restart_at:
                    restart_at[id(r)] = now + backoff[id(r)]
                    logger.error("replica %s (pid %d) exited with %d; restarting it in %.0f s", r.url, r.proc.pid,
                                 r.proc.returncode, backoff[id(r)])
                    backoff[id(r)] = min(2 * backoff[id(r)], self.MAX_BACKOFF_S)
                elif now >= restart_at[id(r)]:
                    del restart_at[id(r)]
                    r.restarts += 1
                    r.start()
                    logger.warning("replica %s restarted (pid %d, restart %d)", r.url, r.proc.pid, r.restarts)


def wait_until_healthy(replicas: list[Replica]) -> bool:
    """True once every replica answers /health 200; False as soon as one exits (start-up failed)."""
    pending = list(replicas)
    while pending:
        for r in list(pending):
            assert r.proc is not None
            if r.proc.poll() is not None:
                logger.error("replica %s exited with %d during start-up", r.url, r.proc.returncode)
                return False
            try:
                if httpx.get(r.url + "/health", timeout=2.0).status_code == 200:
                    pending.remove(r)
            except httpx.HTTPError:
                pass
        time.sleep(0.25)
    return True


def stop(replicas: list[Replica], timeout: float) -> None:
    procs = [r.proc for r in replicas if r.proc is not None]
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
