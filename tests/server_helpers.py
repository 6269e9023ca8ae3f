"""Helpers for the server tests: start `pagedserve serve` in a subprocess on a free port, wait for
/health, stop it with SIGTERM (and check that it exits cleanly).

Servers are cached per configuration for the whole pytest session (several test modules share the
main one; pytest would otherwise build one per importing module).  No tests live here.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

API_KEY = "test-key-123"
REPO_ROOT = Path(__file__).resolve().parent.parent

# The main server: shared by test_server_openai / test_server_errors / test_server_load.
MAIN_ARGS = ("--num-kv-blocks", "256", "--max-model-len", "512", "--max-num-seqs", "64",
             "--max-num-batched-tokens", "1024", "--api-key", API_KEY)
# float32 (compared with HF transformers) and prompts prefilled in chunks of 8 tokens, no API key: shared by
# test_server_prompt_logprobs and test_lm_eval (lm_eval's local-* models send no key).
FP32_CHUNKED_ARGS = ("--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "512",
                     "--max-num-batched-tokens", "8")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: str | Path, args: tuple[str, ...] = (), startup_timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="pagedserve-server-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--num-threads", "1", "--seed", "0",
               "--disable-uvicorn-access-log", "--log-stats-interval", "2", *args]
        # the test process's own TRITON_INTERPRET (conftest: Triton's interpreter for the in-process kernel tests)
        # is not the server's: a server runs what a user's would unless the test asks for it
        inherited = {k: v for k, v in os.environ.items() if k not in ("PAGEDSERVE_API_KEY", "TRITON_INTERPRET")}
        env = dict(inherited, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT))
        self.exit_code: int | None = None
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become healthy in {startup_timeout} s:\n{self.log()}")
            time.sleep(0.25)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the server and wait for it; returns the exit code (kills it after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        self._log.flush()
        return self.exit_code


def start_servers(*configs: tuple[str | Path, tuple[str, ...]]) -> list[ServerProcess]:
    """ServerProcess(model_dir, args) for each config, started at once: a start is mostly one core's imports and
    loading, so two cores start two in about the time of one. If one fails to start, the others are stopped."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(configs)) as pool:
        starts = [pool.submit(ServerProcess, model_dir, args) for model_dir, args in configs]
    failed = [start.exception() for start in starts if start.exception() is not None]
    if failed:
        for start in starts:
            if start.exception() is None:
                start.result().stop()
        raise failed[0]
    return [start.result() for start in starts]


_SERVERS: dict[tuple, ServerProcess] = {}


def get_server(model_dir: str | Path, args: tuple[str, ...] = MAIN_ARGS) -> ServerProcess:
    """One live server per (model, args) for the session."""
    key = (str(model_dir), tuple(args))
    server = _SERVERS.get(key)
    if server is None or not server.alive():
        server = _SERVERS[key] = ServerProcess(model_dir, args)
    return server


def stop_all() -> dict[str, int]:
    """Stops the session's servers; returns each one's exit code by its URL."""
    codes = {server.url: server.stop() for server in _SERVERS.values()}
    _SERVERS.clear()
    return codes


atexit.register(stop_all)


def start_cli_process(*args: str) -> tuple[subprocess.Popen, str]:
    """`pagedserve ARGS --port P` (a proxy or a router) in a subprocess; returns it and its URL once /health is 200,
    or after 60 s if it answers but stays unhealthy (a test may give it no healthy upstream). One that never answers
    (it exited, or did not bind) fails the test here, not later with a confusing connection error."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", *args, "--port", str(port)],
                            cwd=str(REPO_ROOT))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    answered = False
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            answered = True
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                break
        except httpx.HTTPError:
            answered = False
        time.sleep(0.1)
    if not answered:
        proc.kill()
        raise RuntimeError(f"pagedserve {' '.join(args)} did not answer on {url} (exit code {proc.wait()})")
    return proc, url


def auth_headers(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (exact metric name) whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"metric {name} {labels} not found")
    return total


def stops_ending_with_last_token(text_before: str, text: str) -> list[str]:
    """Stop strings that end `text`, occur nowhere earlier in it, and are completed only by the characters
    the last token added (`text_before` is the text one token earlier): shortest first."""
    cut = len(text_before)
    if len(text) <= cut:
        return []
    return [text[i:] for i in range(cut - 1, -1, -1) if text.find(text[i:]) == i and text[i:].strip()]


def start_replay(trace: str | Path, *args: str) -> tuple[subprocess.Popen, str]:
    """`pagedserve replay TRACE --speed 0 ARGS` on a free port; returns it and its URL once /dashboard is 200. Its
    output goes to a temporary file (a pipe nobody reads could fill and stall it), shown if it never answers."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "replay", str(trace), "--port",
                             str(port), "--speed", "0", *args], cwd=str(REPO_ROOT), stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/dashboard", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            proc.wait()
            log.seek(0)
            raise AssertionError(f"replay did not start on {url}:\n{log.read()}")
        time.sleep(0.2)
