"""What the server tells whom (issue 47, findings 9 and 13), against a real `pagedserve serve` process and real
clients: /v1/events gives other clients' token ids (the vLLM KV-cache events) to the admin key only, the trace file
is the owner's alone and redacted, the dashboard routes refuse foreign Host headers (DNS rebinding), the page keeps
no key on disk, new event readers share snapshots instead of forcing one each, a chunked body without the key is
refused before it is read, and /detokenize has a size limit."""
from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time

import httpx
import pytest
from openai import OpenAI

from server_helpers import API_KEY, REPO_ROOT, ServerProcess, auth_headers, start_replay
from test_dashboard import EventReader

from pagedserve.config import EngineArgs, KVCacheConfig
from pagedserve.engine.events import config_dict
from pagedserve.engine.redaction import redact_secrets, redact_url

ADMIN_KEY = "admin-key-456"
# a prompt nobody else sends: a run of token ids that would show verbatim in a BlockStored event
SECRET_PROMPT = [7 + (i * 37) % 700 for i in range(48)]  # the tiny model has 768 tokens


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    # the usual umask, which the server process inherits: a plain open() would make the trace 0644. pytest's own
    # umask is given back after the module (every file later tests and pytest write would get this one)
    umask = os.umask(0o022)
    yield tmp_path_factory.mktemp("privacy") / "trace.jsonl"
    os.umask(umask)


@pytest.fixture(scope="module")
def private_server(tiny_model_dir, trace_path):
    server = ServerProcess(tiny_model_dir("llama"), (
        "--num-kv-blocks", "256", "--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
        "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--trace-file", str(trace_path)))
    yield server
    assert server.stop() == 0


def _run_secret_request(url: str) -> None:
    client = OpenAI(base_url=url + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt=SECRET_PROMPT, max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})


def _shows_secret(event: dict) -> bool:
    return ",".join(map(str, SECRET_PROMPT[:16])) in json.dumps(event, separators=(",", ":"))


def test_token_ids_reach_the_admin_key_only(private_server):
    user = EventReader(private_server.url, auth_headers())
    admin = EventReader(private_server.url, auth_headers(ADMIN_KEY))
    try:
        user.wait_for(lambda e: e["type"] == "hello")
        admin.wait_for(lambda e: e["type"] == "hello")
        assert user.events[0]["view"] == "redacted" and admin.events[0]["view"] == "full"
        _run_secret_request(private_server.url)
        # the admin's view has vLLM's BlockStored with the prompt's tokens (what a KV-aware router needs)
        admin.wait_for(lambda e: any(k["type"] == "BlockStored" and k["token_ids"][:16] == SECRET_PROMPT[:16]
                                     for k in e.get("kv_events", ())))
        user.wait_for(lambda e: e["type"] == "step" and e["finished"])
        steps = [e for e in user.events if e["type"] == "step"]
        assert steps and all("kv_events" not in e for e in steps)
        assert not any(_shows_secret(e) for e in user.events)
    finally:
        user.stop()
        admin.stop()


def test_trace_file_is_the_owners_and_redacted(private_server, trace_path):
    _run_secret_request(private_server.url)
    deadline = time.monotonic() + 60
    while not any(e["type"] == "step" for e in _lines(trace_path)):  # flushed once the engine is idle
        assert time.monotonic() < deadline, "the trace got no step"
        time.sleep(0.2)
    assert stat.S_IMODE(trace_path.stat().st_mode) == 0o600
    lines = _lines(trace_path)
    assert not any("kv_events" in e or _shows_secret(e) for e in lines)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_config_secrets_never_leave():
    """The config the dashboard, `diagnose` and traces show: URL credentials and secret-named fields are hidden."""
    assert redact_url("redis://user:pa55@db:6379/0 and redis://tok@h") == "redis://***@db:6379/0 and redis://***@h"
    assert redact_secrets({"kv_transfer": {"url": "rediss://:pw@h:1", "secret": "s3", "max_num_batched_tokens": 8},
                           "path": "/srv/model"}) == \
        {"kv_transfer": {"url": "rediss://***@h:1", "secret": "***", "max_num_batched_tokens": 8}, "path": "/srv/model"}
    config = EngineArgs(kv_transfer_config={"kv_connector": "redis",
                                            "url": "redis://default:hunter2@127.0.0.1:6379"}).create_engine_config()
    shown = json.dumps(config_dict(config, KVCacheConfig(num_blocks=8, block_size=16, bytes_per_block=1)))
    assert "hunter2" not in shown and "redis://***@127.0.0.1:6379" in shown


def test_dashboard_and_events_refuse_foreign_host_headers(private_server):
    port = private_server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        assert httpx.get(private_server.url + "/dashboard", headers={"Host": host}, timeout=10).status_code == 200
    for path, headers in (("/dashboard", {}), ("/dashboard/dashboard.js", {}), ("/v1/events", auth_headers(ADMIN_KEY))):
        r = httpx.get(private_server.url + path, headers={"Host": f"rebind.attacker.example:{port}", **headers},
                      timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", path


def test_replay_answers_allowed_hosts_only(private_server, trace_path):
    _run_secret_request(private_server.url)  # the trace has a step to replay
    proc, url = start_replay(trace_path, "--allowed-hosts", "dash.internal")
    try:
        assert httpx.get(url + "/v1/events", headers={"Host": "dash.internal"}, timeout=30).status_code == 200
        assert httpx.get(url + "/v1/events", headers={"Host": "other.example"}, timeout=30).status_code == 403
    finally:
        proc.terminate()
        proc.wait(30)


def test_dashboard_page_keeps_the_key_in_the_tab_only():
    """localStorage would keep the key on disk for every later visitor of the page; sessionStorage ends with the
    tab (the browser test in test_dashboard.py drives the page itself)."""
    script = (REPO_ROOT / "pagedserve/entrypoints/dashboard/static/dashboard.js").read_text()
    assert "localStorage.setItem" not in script and "localStorage.getItem" not in script
    assert "sessionStorage.setItem" in script and "history.replaceState" in script


def test_new_event_readers_force_no_snapshot_each(private_server):
    """Ten readers connecting while traffic runs get the ring's backlog; a long-lived reader sees no extra whole-pool
    snapshot per newcomer (each one cost O(blocks) on the engine thread)."""
    watcher = EventReader(private_server.url, auth_headers())
    stop = threading.Event()

    def traffic() -> None:
        client = OpenAI(base_url=private_server.url + "/v1", api_key=API_KEY)
        model = client.models.list().data[0].id
        while not stop.is_set():
            client.completions.create(model=model, prompt="traffic", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})

    thread = threading.Thread(target=traffic, daemon=True)
    try:
        watcher.wait_for(lambda e: e["type"] in ("snapshot", "step"))
        thread.start()
        watcher.wait_for(lambda e: e["type"] == "step")
        for _ in range(10):
            with httpx.stream("GET", private_server.url + "/v1/events", headers=auth_headers(), timeout=30) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:") and json.loads(line[5:])["type"] == "snapshot":
                        break
            seen = len([e for e in watcher.events if e["type"] == "step"])
            watcher.wait_for(lambda e, seen=seen: e["type"] == "step" and
                             len([x for x in watcher.events if x["type"] == "step"]) > seen + 2)
    finally:
        stop.set()
        thread.join(60)
        watcher.stop()
    steps = [e for e in watcher.events if e["type"] == "step"]
    snapshots = [e for e in watcher.events if e["type"] == "snapshot"]
    # its own start (one exact snapshot, or a shared one) plus one every SNAPSHOT_EVERY steps
    assert len(snapshots) <= 2 + len(steps) // 512, (len(snapshots), len(steps))


def test_chunked_body_without_the_key_is_refused_before_it_is_read(private_server):
    """The key is checked before any of the body is read: the 401 comes while the body is still unsent (the old
    order waited for the whole chunked body, buffered with a quadratic +=)."""
    sock = socket.create_connection(("127.0.0.1", private_server.port), timeout=60)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (65536, b"x" * 65536))
        answer = sock.recv(4096)  # the body never ends: only an answer that did not wait for it arrives
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_chunked_body_over_the_limit_is_413_with_the_key(private_server):
    def body():
        yield b'{"model": "m", "prompt": "'
        for _ in range(17):
            yield b"y" * (1 << 20)
        yield b'"}'

    r = httpx.post(private_server.url + "/v1/completions", content=body(),
                   headers={**auth_headers(), "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(private_server.url + "/health", timeout=10).status_code == 200


def test_detokenize_is_bounded(private_server):
    """At most max(max_model_len, vocabulary, 65536) tokens: 4M used to hold the event loop (and /health) 1.5 s."""
    r = httpx.post(private_server.url + "/detokenize", json={"tokens": [5] * 65537}, headers=auth_headers(),
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens"
    r = httpx.post(private_server.url + "/detokenize", json={"tokens": list(range(768))}, headers=auth_headers(),
                   timeout=30)  # the whole vocabulary is fine
    assert r.status_code == 200
    r = httpx.post(private_server.url + "/detokenize", json={"tokens": SECRET_PROMPT}, headers=auth_headers(),
                   timeout=30)
    assert r.status_code == 200 and r.json()["prompt"]
