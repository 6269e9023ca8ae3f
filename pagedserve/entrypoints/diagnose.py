"""`pagedserve diagnose`: which basic behaviour bounds a server, and what to change (pagedserve/metrics/diagnose.py).

    pagedserve diagnose --url http://127.0.0.1:8000 --api-key KEY --duration 20   # listen to a running server
    pagedserve diagnose --trace trace.jsonl                                         # a --trace-file recording

From a server it reads the event stream (/v1/events: the served config in its snapshot, then every step) for
`--duration` seconds, and /metrics at both ends of that window (counters as their change: preemptions,
prefix-cache hits, the latency histograms): recording starts when diagnose connects, so send the traffic while
it listens.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any, Callable

from pagedserve.metrics.diagnose import diagnose, format_report
from pagedserve.metrics.server_metrics import ServerMetrics, metrics_window


def read_stream(url: str, api_key: str | None, duration: float, on_connect: Callable[[], None] | None = None,
                stop: threading.Event | None = None) -> list[dict[str, Any]]:
    """The events a server sends in `duration` seconds (its backlog first); `on_connect` runs once the server
    records for this reader (its hello came), which is when traffic starts to count. A caller that knows when its
    traffic ended sets `stop`: reading then ends at the server's next keep-alive (sent after a second without
    events), so every event of that traffic is in."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + duration
    timeout = httpx.Timeout(10.0, read=max(duration, 1.0) + 20.0)
    with httpx.stream("GET", url.rstrip("/") + "/v1/events", headers=headers, timeout=timeout) as resp:
        if resp.status_code == 401:
            raise ValueError(f"{url} needs an API key (--api-key).")
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if event["type"] != "hello":
                    events.append(event)
                elif on_connect is not None:
                    on_connect()
            elif line.startswith(":") and stop is not None and stop.is_set():
                break
            if time.monotonic() >= deadline:
                break
    return events


def read_server(url: str, api_key: str | None, duration: float, on_connect: Callable[[], None] | None = None,
                stop: threading.Event | None = None) -> tuple[list[dict[str, Any]], ServerMetrics]:
    """The event stream of `duration` seconds (or until `stop`: read_stream), and what /metrics says over the same
    window."""
    import httpx

    def scrape() -> str:
        resp = httpx.get(url.rstrip("/") + "/metrics", timeout=10.0)
        resp.raise_for_status()
        return resp.text

    before = scrape()
    events = read_stream(url, api_key, duration, on_connect, stop)
    return events, metrics_window(before, scrape())


def _announce(duration: float) -> Callable[[], None]:
    return lambda: print(f"listening for {duration:g} s: send the traffic now", file=sys.stderr, flush=True)


def add_diagnose_parser(subparsers) -> None:
    p = subparsers.add_parser("diagnose", help="say which basic behaviour bounds a server and what to change",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="a running `pagedserve serve` (base URL)")
    source.add_argument("--trace", help="a JSONL trace written by --trace-file")
    p.add_argument("--api-key", default=None, help="the server's --api-key")
    p.add_argument("--duration", type=float, default=15.0, help="seconds to listen to the server (--url)")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(func=run_diagnose)


def run_diagnose(args: argparse.Namespace) -> int:
    if args.trace is not None:
        from pagedserve.entrypoints.dashboard.replay import load_trace

        events = load_trace(args.trace)
        metrics = None
    else:
        events, metrics = read_server(args.url, args.api_key, args.duration, _announce(args.duration))
    result = diagnose(events, metrics=metrics)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_report(result))
    return 0
