"""`pagedserve replay TRACE.jsonl`: the dashboard on a recorded trace (`--trace-file`), with the trace's own timing.

The page is the live one: it reads `/v1/events`, which here streams the trace's events, spaced as they were
recorded (divided by `--speed`; `--speed 0` sends everything at once). Idle stretches longer than `--max-gap`
seconds are shortened to it, so a trace with long pauses does not replay them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from pagedserve.engine.events import EVENTS_VERSION
from pagedserve.entrypoints.dashboard.routes import HostCheck, add_dashboard_routes, event_stream_response, hello, sse


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file; ValueError naming the line for anything that is not one of ours."""
    events = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror}.") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg}).") from None
        if not isinstance(event, dict) or "type" not in event or "t" not in event:
            raise ValueError(f"{path}:{number}: not an engine event (no 'type' and 't').")
        if event.get("v") != EVENTS_VERSION:
            raise ValueError(f"{path}:{number}: event version {event.get('v')!r}; this pagedserve reads "
                             f"version {EVENTS_VERSION}.")
        events.append(event)
    if not events:
        raise ValueError(f"{path}: no events.")
    return events


async def replay_events(events: list[dict[str, Any]], speed: float, max_gap: float, source: str) -> AsyncIterator[str]:
    yield hello("replay", source=source, events=len(events))
    start, offset, previous = time.monotonic(), 0.0, events[0]["t"]
    for event in events:
        if speed > 0:
            offset += min(max(event["t"] - previous, 0.0), max_gap) / speed
            previous = event["t"]
            delay = offset - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
        yield sse(event["type"], json.dumps(event, separators=(",", ":")), event.get("seq"))


def build_replay_app(path: str | Path, speed: float = 1.0, max_gap: float = 2.0,
                     hosts: HostCheck | None = None) -> FastAPI:
    """No API key here (the trace is the operator's own file): the Host check is what keeps other web pages
    from reading it through the browser (DNS rebinding)."""
    events = load_trace(path)
    hosts = hosts or HostCheck()
    app = FastAPI(title="pagedserve replay", openapi_url=None)

    @app.get("/v1/events", include_in_schema=False)
    async def replay(request: Request):
        return hosts.refusal(request) or event_stream_response(replay_events(events, speed, max_gap, Path(path).name))

    add_dashboard_routes(app, hosts)
    return app


def add_replay_parser(subparsers) -> None:
    p = subparsers.add_parser("replay", help="open the dashboard on a recorded trace (--trace-file)",
                              description="Serve /dashboard on a JSONL trace of engine events.")
    p.add_argument("trace", help="a JSONL file written by --trace-file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--speed", type=float, default=1.0, help="replay speed; 0 sends the whole trace at once")
    p.add_argument("--max-gap", type=float, default=2.0, help="longest pause (trace seconds) replayed as is")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated host names the page may be opened under besides IP addresses, localhost "
                        "and --host ('*': any; DNS-rebinding protection)")
    p.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    import uvicorn

    if args.speed < 0 or args.max_gap <= 0:
        raise ValueError("--speed must be >= 0 and --max-gap > 0.")
    app = build_replay_app(args.trace, args.speed, args.max_gap,
                           HostCheck(args.host, args.allowed_hosts.split(",")))
    print(f"Replaying {args.trace}: open http://{args.host}:{args.port}/dashboard", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
