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

import time
from typing import TYPE_CHECKING, Any, Callable

import h11
from fastapi import FastAPI

if TYPE_CHECKING:
    from pagedserve.engine.request_stream import RequestStream
    from pagedserve.metrics.server_profile import ServerProfile
    from pagedserve.outputs import RequestOutput

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
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()  # a slow reader: wait as uvicorn's send would
        self.write_now(data)

    def ready(self) -> bool:
        """Whether `write_now` would put bytes on the wire now: the client is there and its buffer is not full."""
        return not (self._flow.write_paused or self._cycle.disconnected or self._transport.is_closing())

    def write_now(self, data: bytes) -> None:
        """Frame and write `data` without waiting (the caller checked `ready`, or `write` drained first)."""
        if self._cycle.disconnected or not data or self._transport.is_closing():
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


class ChunkPush:
    """Writes a stream's SSE chunks from the engine's per-step delivery callback (`RequestStream.push_to`).

    Through the response's task, every token of every stream cost a task wake-up, the async generators between the
    output and the write and a loop iteration of its own; at batch 1 that was most of the event loop's ~0.2 ms per
    token, and every loop iteration lets go of the GIL (the selector's poll), so the rest of the work waited for the
    engine thread's next GIL-free forward and ran inside it. Pushed, one callback per step renders and writes all of
    that step's chunks. The response's task still writes what comes before the first output and the end (the final
    output, usage, [DONE]), and takes over whenever the writer cannot write at once (a slow reader: merged outputs
    are waited for as before) or the client is gone. Set up by SSEResponse (the writer exists once the response
    start went out) and used by the response's generator (it owns the rendering state)."""

    def __init__(self, profile: "ServerProfile") -> None:
        self.writer: BodyWriter | None = None  # None: not uvicorn's h11 (or not started): the task writes everything
        self._profile = profile

    def attach(self, stream: "RequestStream", render: Callable[["RequestOutput"], list[str]]) -> None:
        """Push `stream`'s outputs, rendered to SSE events by `render`, while the writer can take them. Call from the
        response's generator, between its yields (everything it yielded before is written by then)."""
        writer, profile = self.writer, self._profile
        if writer is None:
            return

        def sink(out: "RequestOutput") -> bool:
            if not writer.ready():
                return False
            for data in render(out):
                t = time.perf_counter()
                writer.write_now(data.encode())
                profile.record_send(time.perf_counter() - t)
            return True

        stream.push_to(sink)
