"""Streamed response bodies written straight to uvicorn's connection, past the ASGI send chain (issue 50).

Each SSE chunk handed to `await send({"type": "http.response.body", ...})` passes starlette's exception-handling
wrappers, the server-error middleware, every user middleware's wrapper and uvicorn's send (its flow-control check and
h11's Data framing, ~9 us alone) before the socket write, once per stream per engine step; skipping them took the
event loop's cost per streamed chunk from ~43 to ~32 us in a fake-engine harness (benchmarks/sse_chunk_cost.py). For
uvicorn's h11 protocol (the server's default) the body chunks between the response start and its end are plain
HTTP/1.1 chunks, so `BodyWriter` frames them itself (`<hex length>\\r\\n<data>\\r\\n`; an HTTP/1.0 client's body is
framed by h11) and writes them to the transport. The response start and the end of the body still go through ASGI
send, so every middleware sees them and h11's state machine stays consistent (a chunked body's chunks leave no state
in h11); backpressure is uvicorn's own: a write waits for the transport to drain while its buffer is over the
high-water mark (the engine side merges the outputs meanwhile), and nothing is written once the client is gone. Any
other server or protocol (httptools, test transports) gets `None` from `body_writer` and the response uses ASGI send
as before.
"""
from __future__ import annotations

from typing import Any

import h11
from fastapi import FastAPI

try:  # h11's own chunked writer: which framing h11 chose for this response (a private name: guarded)
    from h11._writers import ChunkedWriter
except ImportError:  # pragma: no cover - another h11: frame every chunk with h11 itself
    ChunkedWriter = None

# scope key: the send callable the ASGI server gave the app (before any middleware wrapped it)
SERVER_SEND = "pagedserve.server_send"


class DirectWriteApp(FastAPI):
    """FastAPI that keeps the server's own send callable in each HTTP scope, for `body_writer`."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class BodyWriter:
    """Writes one streamed response's body chunks to a uvicorn h11 connection (after its start was sent)."""

    __slots__ = ("_cycle", "_transport", "_flow", "_conn", "_chunked")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow
        self._conn: h11.Connection = cycle.conn
        self._chunked = ChunkedWriter is not None and isinstance(getattr(self._conn, "_writer", None), ChunkedWriter)

    async def write(self, data: bytes) -> None:
        cycle = self._cycle
        if self._flow.write_paused and not cycle.disconnected:
            await self._flow.drain()  # a slow reader: wait as uvicorn's send would
        if cycle.disconnected or not data or self._transport.is_closing():
            return  # an empty chunk would end a chunked body
        if self._chunked:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:  # whatever framing h11 chose (HTTP/1.0: until the connection closes)
            self._transport.write(self._conn.send(h11.Data(data=data)))


def body_writer(scope: dict) -> BodyWriter | None:
    """A direct writer for this response's body, or None where the server is not uvicorn's h11 protocol (call after
    the response start was sent)."""
    cycle = getattr(scope.get(SERVER_SEND), "__self__", None)
    conn = getattr(cycle, "conn", None)
    if (not isinstance(conn, h11.Connection) or conn.our_state is not h11.SEND_BODY or scope.get("method") == "HEAD"
            or not all(hasattr(cycle, name) for name in ("transport", "flow", "disconnected"))):
        return None
    return BodyWriter(cycle)
