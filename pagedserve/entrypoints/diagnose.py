"""`pagedserve diagnose`: which basic behaviour bounds a server, and what to change (pagedserve/metrics/diagnose.py).

    pagedserve diagnose --url http://127.0.0.1:8000 --api-key KEY --duration 20   # listen to a running server
    pagedserve diagnose --trace trace.jsonl                                         # a --trace-file recording

From a server it reads the event stream (/v1/events: the served config in its snapshot, then every step) for
`--duration` seconds: recording starts when diagnose connects, so send the traffic while it listens.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagedserve.metrics.diagnose import diagnose, format_report


def read_stream(url: str, api_key: str | None, duration: float) -> list[dict[str, Any]]:
    """The events a server sends in `duration` seconds (its backlog first)."""
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
            if time.monotonic() >= deadline:
                break
    return events


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
    else:
        events = read_stream(args.url, args.api_key, args.duration)
    result = diagnose(events)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_report(result))
    return 0
