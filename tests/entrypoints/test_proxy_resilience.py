"""The router and the prefill/decode proxy as reverse proxies (issue 47, findings 5-8 and the relay's part of 13),
against real processes on loopback: stand-in upstreams that sleep, reject, stream then die, or accept and never
answer (standin_upstream.py), real `pagedserve serve` servers where the behaviour of the server matters."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from server_helpers import MAIN_ARGS, ServerProcess, auth_headers, get_server, metric_value, start_cli_process
from standin_upstream import StandinUpstream

KEY = "test-key-123"
RELAYS = ("router", "proxy")


@contextmanager
def relay_process(kind: str, upstreams: list[str], *flags: str,
                  prefill: list[str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """`pagedserve router --worker U...` or `pagedserve proxy --prefill P... --decode U...` on a free port."""
    if kind == "router":
        args = ("router", "--worker", *upstreams)
    else:
        args = ("proxy", "--prefill", *(prefill or upstreams), "--decode", *upstreams)
    proc, url = start_cli_process(*args, *flags)
    try:
        assert proc.poll() is None, f"{kind} exited with {proc.returncode}"
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def standins(*modes: str, delay: float = 0.0) -> Iterator[list[StandinUpstream]]:
    started: list[StandinUpstream] = []
    try:
        for mode in modes:
            started.append(StandinUpstream(mode, delay))
        yield started
    finally:
        for s in started:
            s.stop()


def workers(url: str) -> list[dict]:
    return httpx.get(url + "/workers", headers=auth_headers(KEY), timeout=5).json()


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def concurrent_completions(url: str, n: int, stream: bool = False, timeout: float = 60.0) -> list[httpx.Response]:
    """n completions at once, each with its own prompt (no shared prefix)."""
    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n + 8)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=auth_headers(KEY)) as client:
            return await asyncio.gather(*(client.post(url + "/v1/completions", json={
                "model": "m", "prompt": f"request number {i} " * 8, "max_tokens": 4, "stream": stream})
                for i in range(n)))

    return asyncio.run(run())


# ------------------------------------------------------------------------------------------------ finding 5
@pytest.mark.timeout(120)
def test_a_hung_prefill_instance_does_not_take_the_proxy_down():
    """A prefill instance that accepts connections and never answers: every request still gets its answer from
    the decode instance (the prefill skipped once its pool is full, once it timed out, or once marked down), and
    /health answers meanwhile: the proxy's pools are per instance and bounded in time."""
    with standins("hang", "slow") as (hung, decode), \
            relay_process("proxy", [decode.url], "--api-key", KEY, "--read-timeout", "3", "--pool-timeout", "1",
                          "--max-connections-per-upstream", "4", "--health-check-interval", "0.5",
                          prefill=[hung.url]) as (_, url):
        async def run() -> tuple[list[httpx.Response], list[float]]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100),
                                         headers=auth_headers(KEY)) as client:
                async def health_latencies() -> list[float]:
                    out = []
                    for _ in range(10):
                        t = time.monotonic()
                        assert (await client.get(url + "/health")).status_code == 200
                        out.append(time.monotonic() - t)
                        await asyncio.sleep(0.2)
                    return out

                requests = [client.post(url + "/v1/completions", json={"model": "m", "prompt": f"p{i}",
                                                                       "max_tokens": 4}) for i in range(60)]
                *answers, latencies = await asyncio.gather(*requests, health_latencies())
                return answers, latencies

        answers, health_latencies = asyncio.run(run())
        assert [a.status_code for a in answers] == [200] * 60
        assert max(health_latencies) < 2.0  # never behind the hung pool (a generous bound on a loaded machine)
        assert decode.stats()["requests"] == 60
        state = {w["role"]: w for w in workers(url)}
        assert state["prefill"]["healthy"] is False and state["prefill"]["in_flight"] == 0
        assert state["decode"]["in_flight"] == 0


@pytest.mark.timeout(120)
def test_a_hung_replica_costs_the_router_only_its_own_requests():
    """Router over a replica that never answers and a good one: requests sent to the hung one end with a 504
    after --read-timeout (none hangs), the hung one is marked down, and the good one serves the rest."""
    with standins("hang", "slow") as (hung, good), \
            relay_process("router", [hung.url, good.url], "--api-key", KEY, "--read-timeout", "2",
                          "--health-check-interval", "0.5") as (_, url):
        first = concurrent_completions(url, 20, timeout=30)
        assert {a.status_code for a in first} <= {200, 504}
        assert any(a.status_code == 200 for a in first)
        assert wait_for(lambda: not {w["url"]: w for w in workers(url)}[hung.url]["healthy"])
        assert [a.status_code for a in concurrent_completions(url, 20, timeout=30)] == [200] * 20
        assert all(w["in_flight"] == 0 for w in workers(url))


# ------------------------------------------------------------------------------------------------ finding 6
@pytest.mark.timeout(120)
def test_in_flight_is_counted_at_dispatch_so_concurrent_requests_spread():
    """40 concurrent non-streamed requests (no shared prefix) over two replicas that take 1 s to answer: each
    replica gets its half, because a request counts as in flight from the moment it is sent."""
    with standins("slow", "slow", delay=1.0) as (a, b), \
            relay_process("router", [a.url, b.url], "--api-key", KEY) as (_, url):
        answers = concurrent_completions(url, 40)
        assert [r.status_code for r in answers] == [200] * 40
        counts = sorted([a.stats()["requests"], b.stats()["requests"]])
        assert counts[0] >= 18 and sum(counts) == 40, counts
        assert all(w["in_flight"] == 0 for w in workers(url))


@pytest.mark.parametrize("kind", RELAYS)
def test_requests_in_flight_are_not_capped_by_a_default_pool(kind):
    """150 concurrent requests to one upstream all reach it at once (its pool is sized by the flag, not httpx's
    default 100), and the relay's /workers shows them in flight while they are: the upstream holds every request
    until the test has read /workers (no timing window on a loaded machine: the watch waits for all 150 to arrive,
    however long; a capped pool never gets there and fails on the suite's timeout)."""
    with standins("hold") as (upstream,), \
            relay_process(kind, [upstream.url], "--api-key", KEY, "--max-connections-per-upstream", "200") \
            as (_, url):
        seen_in_flight = []

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=90, limits=httpx.Limits(max_connections=200),
                                         headers=auth_headers(KEY)) as client:
                async def watch() -> None:
                    try:
                        while (await client.get(upstream.url + "/stats")).json()["in_flight"] < 150:
                            await asyncio.sleep(0.05)
                        seen_in_flight.append(max(w["in_flight"]
                                                  for w in (await client.get(url + "/workers")).json()))
                    finally:
                        await client.post(upstream.url + "/release")

                *answers, _ = await asyncio.gather(*(client.post(url + "/v1/completions", json={
                    "model": "m", "prompt": f"p{i}", "max_tokens": 2}) for i in range(150)), watch())
                return answers

        answers = asyncio.run(run())
        assert [a.status_code for a in answers] == [200] * 150
        assert upstream.stats()["peak_in_flight"] == 150
        assert seen_in_flight == [150]
        assert all(w["in_flight"] == 0 for w in workers(url))


# ------------------------------------------------------------------------------------------- findings 7, 13
def raw_post(url: str, path: str, headers: dict[str, str], total: int, chunked: bool,
             piece: int = 1 << 20) -> tuple[int, bytes]:
    """POST `total` bytes of body over a plain socket, declared (Content-Length) or chunked; stops sending when
    the peer stops reading or closes. Returns (bytes of body sent, what came back)."""
    host, port = url.removeprefix("http://").split(":")
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}",
             *(f"{k}: {v}" for k, v in headers.items())]
    sent = 0
    with socket.create_connection((host, int(port)), timeout=2.0) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b"x" * piece
        try:
            while sent < total:
                n = min(piece, total - sent)
                sock.sendall(b"%x\r\n%s\r\n" % (n, data[:n]) if chunked else data[:n])
                sent += n
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:  # the relay answered and closed, or stopped reading: the rest is never taken
            pass
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and len(answer) > 200:
                    break
        except OSError:
            pass
    return sent, answer


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", RELAYS)
def test_the_api_key_and_the_body_limit_come_before_the_body(kind):
    """Without the key, 256 MiB (declared or chunked) are refused before they are read: the relay stops taking
    bytes after a few MiB and its peak memory does not grow; with the key, a body over --max-request-body-bytes
    gets 413 (declared: before reading; chunked: as it passes the limit); under it, a chunked body reaches the
    upstream intact."""
    limit = 1 << 20
    with standins("slow") as (upstream,), \
            relay_process(kind, [upstream.url], "--api-key", KEY, "--max-request-body-bytes", str(limit)) \
            as (proc, url):
        httpx.post(url + "/v1/completions", headers=auth_headers(KEY), json={"model": "m", "prompt": "warm"}, timeout=60)
        rss_before = peak_rss_mib(proc.pid)
        for chunked in (False, True):
            sent, answer = raw_post(url, "/v1/completions", {}, 256 << 20, chunked)
            assert sent < 64 << 20, f"the relay read {sent} bytes of an unauthenticated body"
            assert not answer or answer.startswith(b"HTTP/1.1 401"), answer[:100]
        assert peak_rss_mib(proc.pid) - rss_before < 48
        answer = httpx.post(url + "/v1/completions", content=b"x" * (limit + 1),
                            headers={"content-type": "application/json"}, timeout=60).json()
        assert answer["error"]["code"] == "invalid_api_key"  # the key first, even for a body over the limit

        def chunked_body(size: int) -> Iterator[bytes]:
            prompt = json.dumps({"model": "m", "prompt": "y" * (size - 40), "max_tokens": 1}).encode()
            for i in range(0, len(prompt), 4096):
                yield prompt[i:i + 4096]

        over = httpx.post(url + "/v1/completions", headers=auth_headers(KEY), content=b"x" * (2 * limit), timeout=60)
        assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
        sent, answer = raw_post(url, "/v1/completions", auth_headers(KEY), 2 * limit, chunked=True, piece=65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
        under = httpx.post(url + "/v1/completions", headers=auth_headers(KEY), content=chunked_body(limit - 4096), timeout=60)
        assert under.status_code == 200, under.text
        assert upstream.stats()["last_body_bytes"] == len(b"".join(chunked_body(limit - 4096)))
        assert all(w["in_flight"] == 0 for w in workers(url))


# ------------------------------------------------------------------------------------------------ finding 8
def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", RELAYS)
def test_an_upstream_dying_mid_stream_ends_the_stream_with_an_error_event(kind):
    """The upstream streams two events and dies: the client gets them, then an OpenAI error event and [DONE]
    (the official client raises an APIError), and the in-flight count goes back to 0. Dying before answering a
    non-streamed request: a 502."""
    openai = pytest.importorskip("openai")
    with standins("die", "die", "slow") as (dies_streaming, dies_before_answering, prefill):
        with relay_process(kind, [dies_streaming.url], "--api-key", KEY, prefill=[prefill.url]) as (_, url):
            r = httpx.post(url + "/v1/completions", headers=auth_headers(KEY), timeout=30,
                           json={"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True})
            events = sse_events(r)
            assert r.status_code == 200 and len(events) == 4, events
            assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["part0 ", "part1 "]
            assert json.loads(events[2])["error"]["code"] == "upstream_failed" and events[3] == "[DONE]"
            assert all(w["in_flight"] == 0 for w in workers(url))
            assert not [w for w in workers(url) if w["url"] == dies_streaming.url][-1]["healthy"]
        with relay_process(kind, [dies_before_answering.url], "--api-key", KEY, prefill=[prefill.url]) as (_, url):
            client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.InternalServerError) as err:
                client.completions.create(model="m", prompt="hi", max_tokens=4)
            assert err.value.status_code == 502
            assert all(w["in_flight"] == 0 for w in workers(url))


@pytest.mark.timeout(120)
def test_the_official_client_sees_the_mid_stream_error():
    openai = pytest.importorskip("openai")
    with standins("die") as (upstream,), relay_process("router", [upstream.url], "--api-key", KEY) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        got = []
        with pytest.raises(openai.APIError, match="upstream server failed mid-stream"):
            for chunk in client.completions.create(model="m", prompt="hi", max_tokens=4, stream=True):
                got.append(chunk.choices[0].text)
        assert got == ["part0 ", "part1 "]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", RELAYS)
def test_a_client_that_leaves_releases_its_in_flight_count(kind):
    """A client that disconnects while its upstream is still working (before its answer started) releases the
    count at once and closes the upstream request."""
    with standins("slow", delay=5.0) as (upstream,), relay_process(kind, [upstream.url], "--api-key", KEY) \
            as (_, url):
        for stream in (False, True):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", headers=auth_headers(KEY), timeout=1.0,
                           json={"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream})
            assert wait_for(lambda: all(w["in_flight"] == 0 for w in workers(url)), timeout=3.0)


@pytest.mark.timeout(240)
def test_a_prefill_4xx_is_not_ignored(tiny_model_dir):
    """P/D with min_tokens: the prefill request drops min_tokens (it would conflict with max_tokens=1), so the
    prefill server really computes it (two successful requests on a server that plays both roles); a prefill 4xx
    the proxy cannot avoid is relayed to the client and the decode server never sees the request."""
    server = get_server(tiny_model_dir("llama"))
    with relay_process("proxy", [server.url], "--api-key", KEY) as (_, url):
        def successes() -> float:
            return metric_value(httpx.get(server.url + "/metrics", timeout=60).text, "pagedserve:request_success_total")

        before = successes()
        r = httpx.post(url + "/v1/completions", headers=auth_headers(KEY), timeout=60,
                       json={"model": str(tiny_model_dir("llama")), "prompt": "hello there", "max_tokens": 6,
                             "min_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["text"]) > 0
        assert wait_for(lambda: successes() - before == 2, timeout=10), successes() - before
    with standins("reject", "slow") as (prefill, decode), \
            relay_process("proxy", [decode.url], "--api-key", KEY, prefill=[prefill.url]) as (_, url):
        r = httpx.post(url + "/v1/completions", headers=auth_headers(KEY), timeout=30,
                       json={"model": "m", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["message"] == "rejected by the stand-in"
        assert decode.stats()["requests"] == 0


def replica_pids(launcher_pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], check=False, capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def running(pid: int) -> bool:
    try:
        state = re.search(r"State:\s+(\w)", Path(f"/proc/{pid}/status").read_text()).group(1)
    except (FileNotFoundError, AttributeError):
        return False
    return state != "Z"


@pytest.mark.timeout(600)
def test_data_parallel_replicas_are_restarted_and_die_with_the_launcher(tiny_model_dir):
    """`serve -dp 2`: a replica killed with SIGKILL is logged and restarted (the router routes around it, then
    back); SIGKILL to the launcher itself leaves no replica running (PR_SET_PDEATHSIG)."""
    server = ServerProcess(tiny_model_dir("llama"), MAIN_ARGS + ("--data-parallel-size", "2"))
    try:
        first = replica_pids(server.proc.pid)
        assert len(first) == 2
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        assert wait_for(lambda: len(replica_pids(server.proc.pid) - first) == 1, timeout=30), server.log()[-2000:]
        assert wait_for(lambda: all(w["healthy"] for w in workers(server.url)), timeout=240), server.log()[-3000:]
        assert "restarting it in" in server.log() and "restarted (pid" in server.log()
        r = httpx.post(server.url + "/v1/completions", headers=auth_headers(KEY), timeout=60,
                       json={"model": str(tiny_model_dir("llama")), "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        replicas = replica_pids(server.proc.pid)
        server.proc.kill()
        server.proc.wait()
        assert wait_for(lambda: not any(running(p) for p in replicas), timeout=60)
    finally:
        server.stop()
