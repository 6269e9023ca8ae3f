"""HTTP side of the engine events: SSE framing, the live `/v1/events` stream, and the `/dashboard` static files.

The page and its assets carry no data and no secret, so they are served without the API key (the page asks for
the key, keeps it for the browser tab only, and sends it with its own request for `/v1/events`, which is behind
the key). Neither route is in the OpenAPI schema: an endless stream is no API operation to fuzz.

What a reader sees depends on its key (engine/events.py): the redacted view for any key, the full view (the
vLLM KV-cache events, with other clients' token ids) only for the admin key (`--admin-api-key`).

DNS rebinding: a web page on an attacker's domain that re-resolves to 127.0.0.1 would let the victim's browser read
a server on loopback as if same-origin. Such a request carries the attacker's name in its Host header, so these
routes answer only requests whose Host is an IP address, `localhost`, the configured `--host`, or a name given in
`--allowed-hosts` ("*" turns the check off).
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from pagedserve.engine.events import EVENTS_VERSION, EngineEventRecorder

STATIC_DIR = Path(__file__).resolve().parent / "static"
DASHBOARD_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
POLL_INTERVAL_S = 0.1  # how often a stream looks for new events: the page redraws at most this often anyway
KEEPALIVE_S = 1.0  # also lets a reader with a deadline (diagnose --duration) stop on time
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})  # bind addresses that name no host


class HostCheck:
    """Which Host headers the dashboard and event routes answer (see the module docstring)."""

    def __init__(self, bind_host: str | None = None, allowed_hosts: Iterable[str] = ()) -> None:
        names = {"localhost", *(h.strip().lower() for h in allowed_hosts if h.strip())}
        if bind_host and bind_host.lower() not in WILDCARD_HOSTS:
            names.add(bind_host.lower().strip("[]"))
        self.allow_all = "*" in names
        self.names = frozenset(names)

    def allows(self, host_header: str | None) -> bool:
        if self.allow_all or host_header is None:  # no Host (HTTP/1.0): no browser sent it
            return True
        host = host_header.strip().lower()
        if host.startswith("["):  # [v6]:port
            host = host[1:host.find("]")] if "]" in host else host
        elif host.count(":") == 1:
            host = host.rsplit(":", 1)[0]
        if host in self.names:
            return True
        try:
            ipaddress.ip_address(host)  # an address literal cannot be re-resolved
            return True
        except ValueError:
            return False

    def refusal(self, request: Request) -> Response | None:
        if self.allows(request.headers.get("host")):
            return None
        message = (f"Host {request.headers.get('host')!r} is not allowed for this route (DNS-rebinding "
                   f"protection); start the server with --allowed-hosts NAME to open it to that name.")
        return JSONResponse({"error": {"message": message, "type": "permission_error", "param": None,
                                       "code": "host_not_allowed"}}, status_code=403)


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
                      backlog: bool = True, private: bool = False) -> AsyncIterator[str]:
    """Events of a running engine, while `serving()`, in the full view if `private` (the admin key) else the
    redacted one. Starts with what lets a reader rebuild the state: the events after `since` if the ring still has
    them (a reconnect), else the ring's backlog from its oldest snapshot, else a snapshot shared by the readers
    arriving together, built off the event loop."""
    recorder.subscribe(private)
    try:
        yield hello("live", listeners=recorder.num_subscribers,  # this reader included
                    view="full" if private else "redacted")
        ring = recorder.ring
        items, missed = ring.since(since, private) if since is not None and since <= ring.last_seq else ([], True)
        last = items[-1][0] if items else ring.last_seq
        if missed:
            items = ring.from_oldest_snapshot(private) if backlog else []
            if items:
                last = items[-1][0]
            else:
                last, line = await asyncio.to_thread(recorder.shared_snapshot)
                yield sse("snapshot", line, last)
                items, _ = ring.since(last, private)  # what happened since the shared snapshot was taken
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
            items, missed = ring.since(last, private)
            if missed:  # this reader fell behind the ring: the blocks it holds may be stale until a snapshot
                recorder.request_snapshot()
    finally:
        recorder.unsubscribe(private)


def add_dashboard_routes(app: FastAPI, hosts: HostCheck) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        return hosts.refusal(request) or FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_asset(request: Request, name: str) -> Response:
        media_type = DASHBOARD_FILES.get(name)
        if media_type is None:
            return Response(status_code=404)
        return hosts.refusal(request) or FileResponse(STATIC_DIR / name, media_type=media_type)


def add_live_event_routes(app: FastAPI, recorder: EngineEventRecorder, serving: Callable[[], bool], hosts: HostCheck,
                          admin_api_key: str | None = None) -> None:
    """`/v1/events` (behind the API key, if any: the server's middleware) and the dashboard page."""
    admin = f"Bearer {admin_api_key}".encode() if admin_api_key else None

    @app.get("/v1/events", include_in_schema=False)
    async def events(request: Request, since: int | None = None, backlog: bool = True) -> Response:
        refused = hosts.refusal(request)
        if refused is not None:
            return refused
        last_id = request.headers.get("last-event-id")
        if since is None and last_id is not None and last_id.isdigit():
            since = int(last_id)
        private = admin is not None and secrets.compare_digest(
            request.headers.get("authorization", "").encode(), admin)
        return event_stream_response(live_events(recorder, serving, since, backlog, private))

    add_dashboard_routes(app, hosts)
