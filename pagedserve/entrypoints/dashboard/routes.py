"""HTTP side of the engine events: SSE framing, the live `/v1/events` stream, and the `/dashboard` static files.

The page and its assets carry no data and no secret, so they are served without the API key (the page asks for
the key and sends it with its own request for `/v1/events`, which is behind the key). Neither route is in the
OpenAPI schema: an endless stream is no API operation to fuzz.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from pagedserve.engine.events import EVENTS_VERSION, EngineEventRecorder

STATIC_DIR = Path(__file__).resolve().parent / "static"
DASHBOARD_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
POLL_INTERVAL_S = 0.1  # how often a stream looks for new events: the page redraws at most this often anyway
KEEPALIVE_S = 1.0  # also lets a reader with a deadline (diagnose --duration) stop on time


def sse(event_type: str, data: str, seq: int | None = None) -> str:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {event_type}\ndata: {data}\n\n"


def hello(mode: str, **extra) -> str:
    """The first message of every stream: what is talking (a live engine or a replayed trace)."""
    return sse("hello", json.dumps({"v": EVENTS_VERSION, "type": "hello", "mode": mode, **extra}))


def event_stream_response(content: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def live_events(recorder: EngineEventRecorder, serving: Callable[[], bool], since: int | None = None,
                      backlog: bool = True) -> AsyncIterator[str]:
    """Events of a running engine, while `serving()`. Starts with what lets a reader rebuild the state: the
    events after `since` if the ring still has them (a reconnect), else the ring's backlog from its oldest
    snapshot, else a snapshot read now (the engine then adds an exact one at its next step)."""
    recorder.subscribe()
    try:
        yield hello("live", listeners=recorder.num_subscribers)  # this reader included
        ring = recorder.ring
        items, missed = ring.since(since) if since is not None and since <= ring.last_seq else ([], True)
        if missed:
            items = ring.from_oldest_snapshot() if backlog else []
            if not items:
                snapshot = recorder.snapshot(exact=False)
                snapshot["seq"] = ring.last_seq
                yield sse("snapshot", json.dumps(snapshot, separators=(",", ":")), ring.last_seq)
        last = items[-1][0] if items else ring.last_seq
        idle = 0.0
        while True:
            for seq, event_type, line in items:
                yield sse(event_type, line, seq)
            if items:
                last, idle = items[-1][0], 0.0
            elif idle >= KEEPALIVE_S:
                yield ": keep-alive\n\n"
                idle = 0.0
            if not serving():
                return
            await asyncio.sleep(POLL_INTERVAL_S)
            idle += POLL_INTERVAL_S
            items, missed = ring.since(last)
            if missed:  # this reader fell behind the ring: the blocks it holds may be stale until a snapshot
                recorder.request_snapshot()
    finally:
        recorder.unsubscribe()


def add_dashboard_routes(app: FastAPI) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        media_type = DASHBOARD_FILES.get(name)
        if media_type is None:
            return Response(status_code=404)
        return FileResponse(STATIC_DIR / name, media_type=media_type)


def add_live_event_routes(app: FastAPI, recorder: EngineEventRecorder, serving: Callable[[], bool]) -> None:
    @app.get("/v1/events", include_in_schema=False)
    async def events(request: Request, since: int | None = None, backlog: bool = True) -> Response:
        last_id = request.headers.get("last-event-id")
        if since is None and last_id is not None and last_id.isdigit():
            since = int(last_id)
        return event_stream_response(live_events(recorder, serving, since, backlog))

    add_dashboard_routes(app)
