"""The engine events over HTTP: /v1/events on a real server (behind the API key, real clients), `pagedserve replay`
on a trace of a real run, and /dashboard in a real browser (headless Debian Chromium driven by Playwright) while
real traffic runs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from server_helpers import API_KEY, REPO_ROOT, auth_headers, start_replay

from pagedserve import SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.server

ARTIFACTS = Path(os.environ.get("PAGEDSERVE_TEST_ARTIFACTS", REPO_ROOT / "test-artifacts"))


class EventReader:
    """Reads /v1/events on a thread until stopped (the server's keep-alive lets it notice within a second)."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.events: list[dict] = []
        self.status: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, headers), daemon=True)
        self._thread.start()

    def _run(self, url: str, headers: dict[str, str]) -> None:
        with httpx.stream("GET", url + "/v1/events", headers=headers, timeout=30) as resp:
            self.status = resp.status_code
            self.content_type = resp.headers.get("content-type", "")
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    self.events.append(json.loads(line[5:]))
                if self._stop.is_set():
                    return

    def wait_for(self, predicate, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(predicate(e) for e in list(self.events)):
            assert time.monotonic() < deadline, f"no such event in {len(self.events)} events"
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()


def test_events_stream_needs_the_key_and_shows_a_real_request(server):
    r = httpx.get(server.url + "/v1/events", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    page = httpx.get(server.url + "/dashboard", timeout=10)  # the page itself carries no data: open
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="block-grid"' in page.text and "cdn" not in page.text.lower()
    assert httpx.get(server.url + "/dashboard/dashboard.js", timeout=10).status_code == 200
    assert httpx.get(server.url + "/dashboard/secrets.txt", timeout=10).status_code == 404
    assert "/v1/events" not in httpx.get(server.url + "/openapi.json", headers=auth_headers(), timeout=10).json()["paths"]

    reader = EventReader(server.url, auth_headers())
    reader.wait_for(lambda e: e["type"] == "snapshot")
    assert reader.status == 200 and reader.content_type.startswith("text/event-stream")
    assert reader.events[0] == {"v": 1, "type": "hello", "mode": "live", "listeners": 1, "view": "redacted"}
    snapshot = next(e for e in reader.events if e["type"] == "snapshot")
    assert snapshot["config"]["cache"]["num_blocks"] == 256 and len(snapshot["blocks"]) == 256

    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="hello world", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    reader.wait_for(lambda e: e["type"] == "step" and [out.id, "length"] in e["finished"])
    reader.stop()
    deadline = time.monotonic() + 15  # the first reader's subscription ends with its connection
    while True:
        again = EventReader(server.url, auth_headers())
        again.wait_for(lambda e: e["type"] == "hello")
        again.stop()
        if again.events[0]["listeners"] == 1:
            break
        assert time.monotonic() < deadline, "a closed stream still counts as a listener (recording stays on)"
        time.sleep(0.2)
    steps = [e for e in reader.events if e["type"] == "step"]
    assert [a[0] for e in steps for a in e["admitted"]].count(out.id) == 1
    prompt_len = out.usage.prompt_tokens
    assert sum(p[1] for e in steps for p in e["prefill"] if p[0] == out.id) == prompt_len
    assert sum(e["decode"].count(out.id) for e in steps) == 7  # the first token came with the prefill
    assert all(e["tokens"] <= e["budget"] == 1024 for e in steps)


def test_replay_serves_a_recorded_trace(tiny_model_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir("llama")), num_threads=1,
                                                   num_kv_blocks=64, max_model_len=256, trace_file=str(trace)))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * (9 + i), params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.events.close()
    recorded = [json.loads(line) for line in trace.read_text().splitlines()]

    proc, url = start_replay(trace)
    try:
        with httpx.stream("GET", url + "/v1/events", timeout=30) as resp:  # ends with the trace
            data = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]
        assert data[0] == {"v": 1, "type": "hello", "mode": "replay", "source": "trace.jsonl",
                           "events": len(recorded)}
        assert data[1:] == recorded
    finally:
        proc.terminate()
        proc.wait(10)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"v": 99, "type": "step", "t": 0}\n')
    out = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "replay", str(bad)],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert out.returncode == 2 and "version 99" in out.stderr


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="Debian's chromium is not installed (apt-get install chromium); "
                                                "the dashboard's browser test needs it")
def test_dashboard_in_a_real_browser_follows_live_traffic(server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (pip) drives the browser")
    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    stop = threading.Event()

    def traffic(seed: int) -> None:
        while not stop.is_set():
            client.completions.create(model=model, prompt=f"request {seed}", max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True})

    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server.url}/dashboard#key={API_KEY}")
        page.wait_for_function("document.getElementById('mode').textContent === 'live'", timeout=30000)
        page.wait_for_function("document.getElementById('block-grid').dataset.blocks === '256'", timeout=30000)
        threads = [threading.Thread(target=traffic, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        try:
            page.wait_for_function("Number(document.getElementById('running-count').textContent) > 0", timeout=30000)
            first = int(page.inner_text("#step-count"))
            page.wait_for_function(f"Number(document.getElementById('step-count').textContent) > {first + 20}",
                                   timeout=30000)
            page.wait_for_function("Number(document.getElementById('lanes').dataset.lanes) >= 8", timeout=30000)
            assert int(page.get_attribute("#steps", "data-steps")) > 0
            assert page.locator("#config td").first.inner_text() == "model"
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        browser.close()
    assert errors == []
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
