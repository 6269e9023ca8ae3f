"""Soak: `pagedserve router` in front of 2 real replicas and a hung upstream, under chaos, on loopback (issue 47).

    python benchmarks/router_soak.py [--duration 600] [--model DIR] [--concurrency 6] [--kill-every 40] [--redis]

Setup: two `pagedserve serve` replicas (the tiny llama test checkpoint unless --model; greedy, seed 0) and a
stand-in upstream whose /health answers 200 but which never answers a generation (tests/entrypoints/
standin_upstream.py, mode slow with an endless delay), all three behind `pagedserve router --api-key ...
--read-timeout R`. Client threads send, at random (fixed seed): greedy completions of a fixed prompt set,
non-streamed and streamed, compared with reference outputs taken from one replica before the chaos starts;
streams abandoned after their first event; bodies over --max-request-body-bytes with the key (413 expected);
64 MiB chunked bodies without the key (401 or a closed connection expected, never read). Every --kill-every
seconds a replica (alternately) is SIGKILLed and restarted on its port after --down-for seconds. With --redis the
replicas share KV through a real redis-server on loopback (`--kv-transfer-config` redis store, blocks MAC'd with a
shared secret, a small maxmemory with LRU eviction), so a restarted replica loads the other's prefix blocks; the
Redis server itself is SIGKILLed and restarted once, half-way through (a store that is down is a miss, never a
wrong output).

Report (a markdown table): requests by outcome, wrong outputs (a 200 whose text differs from the reference),
hung clients (no answer within read timeout + 30 s), leaked in-flight counts (the router's /workers once every
client is done), the router's peak and final RSS. Failures during kills (502/503/504, an SSE error event) are
expected outcomes, counted apart; anything else is "unexpected".
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "entrypoints")]
from server_helpers import free_port
from standin_upstream import StandinUpstream
from test_proxy_resilience import raw_post

KEY = "soak-key"
PROMPTS = [f"{topic} " * 6 + "and then" for topic in
           ("the pirate ship sailed", "a quiet poem about rain", "numbers one two three", "the cat sat on",
            "once upon a time", "hello world from the", "red green blue yellow", "the market opened at")]


class Replica:
    """A `pagedserve serve` process on a fixed port, killed and restarted by the chaos thread."""

    def __init__(self, model: str | None, port: int, log_dir: Path, redis_url: str | None = None) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", *([model] if model else []),
                    "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY, "--num-threads", "1", "--seed", "0",
                    "--max-num-seqs", "16", "--disable-uvicorn-access-log", "--disable-log-stats"]
        self.env = None
        if redis_url:
            self.cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "redis", "url": redis_url,
                                                             "kv_role": "kv_both"})]
            self.env = os.environ | {"PAGEDSERVE_KV_TRANSFER_SECRET": "soak-secret"}
        self.log = open(log_dir / f"replica-{port}.log", "ab")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.url} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"replica {self.url} not healthy in {timeout} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisServer:
    """A real redis-server on a loopback port with a small maxmemory (LRU), killed and restarted by the chaos."""

    def __init__(self, port: int, log_dir: Path) -> None:
        self.port, self.url = port, f"redis://127.0.0.1:{port}/0"
        self.cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]
        self.log = open(log_dir / "redis.log", "ab")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(100):
            if subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout == b"PONG\n":
                return
            time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def info(self, field: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), "info"], capture_output=True, text=True).stdout
        match = re.search(rf"^{field}:(\S+)", out, re.M)
        return match.group(1) if match else "?"


def rss_mib(pid: int, field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, model: str, reference: dict[str, str]) -> None:
        self.args, self.url, self.model, self.reference = args, url, model, reference
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.client_timeout = args.read_timeout + 30

    def count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def one(self, rng: random.Random, client: httpx.Client) -> str:
        kind = rng.choices(["complete", "stream", "abandon", "too_large", "no_key"], [45, 35, 10, 5, 5])[0]
        headers = {"Authorization": f"Bearer {KEY}"}
        prompt = rng.choice(PROMPTS)
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0}
        try:
            if kind == "complete":
                r = client.post(self.url + "/v1/completions", json=body, headers=headers)
                if r.status_code != 200:
                    return f"complete: {r.status_code} {r.json()['error'].get('code')}"
                return "complete: ok" if r.json()["choices"][0]["text"] == self.reference[prompt] else "WRONG OUTPUT"
            if kind in ("stream", "abandon"):
                text, error = "", None
                with client.stream("POST", self.url + "/v1/completions", json=body | {"stream": True},
                                   headers=headers) as r:
                    if r.status_code != 200:
                        r.read()
                        return f"{kind}: {r.status_code} {r.json()['error'].get('code')}"
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line.removeprefix("data: "))
                        if "error" in event:
                            error = event["error"].get("code")
                            continue
                        if kind == "abandon":
                            return "abandon: left mid-stream"
                        text += event["choices"][0]["text"]
                if error:
                    return f"stream: error event {error}"
                return "stream: ok" if text == self.reference[prompt] else "WRONG OUTPUT"
            if kind == "too_large":
                r = client.post(self.url + "/v1/completions", headers=headers | {"content-type": "application/json"},
                                content=b" " * (self.args.max_request_body_bytes + 1))
                return f"too_large: {r.status_code}"
            sent, answer = raw_post(self.url, "/v1/completions", {}, 64 << 20, chunked=True)
            if sent >= 64 << 20:
                return "no_key: BODY READ WITHOUT KEY"
            return "no_key: 401" if answer.startswith(b"HTTP/1.1 401") else "no_key: closed before reading"
        except httpx.TimeoutException:
            return "HUNG CLIENT"
        except httpx.HTTPError as exc:
            return f"{kind}: {type(exc).__name__}"

    def client_loop(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=self.client_timeout) as client:
            while time.monotonic() < until:
                self.count(self.one(rng, client))


def redis_chaos(redis: RedisServer, at: float, down_for: float, log: list[str]) -> None:
    time.sleep(max(0.0, at - time.monotonic()))
    redis.kill()
    log.append("killed redis")
    time.sleep(down_for)
    redis.start()
    log.append("restarted redis")


def chaos(replicas: list[Replica], every: float, down_for: float, until: float, log: list[str]) -> None:
    turn = 0
    while time.monotonic() + every < until:
        time.sleep(every)
        victim = replicas[turn % len(replicas)]
        turn += 1
        victim.kill()
        log.append(f"killed {victim.url}")
        time.sleep(down_for)
        victim.start()
        log.append(f"restarted {victim.url}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (the chaos runs meanwhile)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny llama test checkpoint)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kill-every", type=float, default=40.0)
    p.add_argument("--down-for", type=float, default=5.0)
    p.add_argument("--read-timeout", type=float, default=10.0, help="the router's --read-timeout")
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument("--redis", action="store_true", help="the replicas share KV through a real redis-server")
    p.add_argument("--output", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="router-soak-"))
    model = args.model
    if model is None:
        from tiny_models import build_tiny_tokenizer, make_tiny_checkpoint

        model = str(make_tiny_checkpoint("llama", log_dir / "tiny_llama", tokenizer=build_tiny_tokenizer()))
    redis = None
    if args.redis:
        if shutil.which("redis-server") is None:
            p.error("--redis needs redis-server (Debian package redis-server)")
        redis = RedisServer(free_port(), log_dir)
        redis.start()
    replicas = [Replica(model, free_port(), log_dir, redis.url if redis else None) for _ in range(2)]
    hung = StandinUpstream("slow", 1e9)  # /health 200, generations never answered
    router = None
    try:
        for r in replicas:
            r.start()
        reference = {}
        for prompt in PROMPTS:
            r = httpx.post(replicas[0].url + "/v1/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0})
            r.raise_for_status()
            reference[prompt] = r.json()["choices"][0]["text"]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        router = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "router", "--worker",
                                   replicas[0].url, replicas[1].url, hung.url, "--api-key", KEY, "--port", str(port),
                                   "--read-timeout", str(args.read_timeout), "--health-check-interval", "1",
                                   "--max-request-body-bytes", str(args.max_request_body_bytes)],
                                  cwd=str(ROOT), stdout=open(log_dir / "router.log", "ab"), stderr=subprocess.STDOUT)
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        soak = Soak(args, url, model, reference)
        start = time.monotonic()
        until = start + args.duration
        chaos_log: list[str] = []
        threads = [threading.Thread(target=soak.client_loop, args=(i, until)) for i in range(args.concurrency)]
        threads.append(threading.Thread(target=chaos, args=(replicas, args.kill_every, args.down_for, until,
                                                            chaos_log)))
        if redis is not None:
            threads.append(threading.Thread(target=redis_chaos, args=(redis, start + args.duration / 2,
                                                                      args.down_for, chaos_log)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        headers = {"Authorization": f"Bearer {KEY}"}
        settle = time.monotonic() + 15  # answers still closing on the router side
        while (leaked := sum(w["in_flight"] for w in httpx.get(url + "/workers", headers=headers).json())) and \
                time.monotonic() < settle:
            time.sleep(0.5)
        results = {
            "duration_s": round(elapsed), "requests": sum(soak.outcomes.values()), "outcomes": dict(soak.outcomes),
            "wrong_outputs": soak.outcomes["WRONG OUTPUT"], "hung_clients": soak.outcomes["HUNG CLIENT"],
            "leaked_in_flight": leaked, "router_peak_rss_mib": round(rss_mib(router.pid, "VmHWM"), 1),
            "router_final_rss_mib": round(rss_mib(router.pid, "VmRSS"), 1),
            "kills": sum(1 for e in chaos_log if e.startswith("killed http")), "chaos": chaos_log,
            "workers": httpx.get(url + "/workers", headers=headers).json(), "redis": None,
        }
        if redis is not None:
            results["redis"] = {"used_memory": redis.info("used_memory_human"), "keys": redis.info("db0"),
                                "evicted_keys": redis.info("evicted_keys")}
            results["kv_connector"] = connector_counters(replicas)
        print_table(results)
        if args.output:
            args.output.write_text(json.dumps(results, indent=2))
        bad = results["wrong_outputs"] or results["hung_clients"] or results["leaked_in_flight"] or \
            soak.outcomes["no_key: BODY READ WITHOUT KEY"]
        return 1 if bad else 0
    finally:
        if router is not None:
            router.terminate()
            router.wait(15)
        for r in replicas:
            r.stop()
        hung.stop()
        if redis is not None:
            redis.kill()


def connector_counters(replicas: list[Replica]) -> dict[str, float]:
    """The replicas' KV-connector counters, summed (each since its last restart)."""
    totals: Counter[str] = Counter()
    for replica in replicas:
        text = httpx.get(replica.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
        for line in text.splitlines():
            if line.startswith(("pagedserve:kv_connector_", "pagedserve:external_prefix_cache_")):
                name, value = line.rsplit(" ", 1)
                totals[name.split("{")[0].removeprefix("pagedserve:")] += float(value)
    return dict(totals)


def print_table(results: dict) -> None:
    store = ", a shared redis-server killed once" if results["redis"] else ""
    print(f"\nrouter soak: {results['duration_s']} s, 2 replicas + 1 hung upstream{store}, {results['kills']} "
          "replica kills\n")
    print("| measure | value |\n|---|---|")
    for key in ("requests", "wrong_outputs", "hung_clients", "leaked_in_flight", "router_peak_rss_mib",
                "router_final_rss_mib"):
        print(f"| {key.replace('_', ' ')} | {results[key]} |")
    print("\n| outcome | count |\n|---|---|")
    for outcome, n in sorted(results["outcomes"].items()):
        print(f"| {outcome} | {n} |")
    if results["redis"]:
        print("\n| redis / KV connector (replicas since their last restart) | value |\n|---|---|")
        for key, value in {**results["redis"], **results["kv_connector"]}.items():
            print(f"| {key} | {value} |")


if __name__ == "__main__":
    sys.exit(main())
