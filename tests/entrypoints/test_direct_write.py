"""Streamed bodies written straight to uvicorn's connection (pagedserve/entrypoints/openai/direct_write.py): the bytes
on the wire are those the ASGI send path gives, a slow reader is waited for (not buffered without bound), a client
that goes away mid-stream aborts its request, an HTTP/1.0 client gets h11's own framing, and other servers fall back
to ASGI send. A real uvicorn server in a thread of this process, around the fake engine (no model)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from types import SimpleNamespace

import h11
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai import direct_write, serving_engine
from pagedserve.entrypoints.openai.api_server import build_app
from tests.entrypoints.test_server_async_llm import FakeEngine


@contextlib.contextmanager
def uvicorn_server(step_sleep: float = 0.002):
    """(engine, port): build_app around a fake engine, served by uvicorn's h11 protocol in a thread."""
    engine = FakeEngine(step_sleep=step_sleep)
    llm = AsyncLLM(engine, log_stats=False)
    app = build_app(llm, SimpleNamespace(api_key=None), shutdown_engine_on_exit=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http="h11", log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn never started"
            time.sleep(0.01)
        yield engine, sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        llm.shutdown()
        sock.close()


def post(port: int, body: dict, version: str = "1.1", path: str = "/v1/completions") -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_all(s: socket.socket, until: bytes = b"0\r\n\r\n") -> bytes:
    out = b""
    while not out.endswith(until):
        got = s.recv(65536)
        if not got:
            break
        out += got
    s.close()
    return out


def events_of(raw: bytes) -> list[bytes]:
    """The SSE events of a chunked response, one per HTTP chunk (asserted), each request's id and time made equal."""
    body, events = raw.split(b"\r\n\r\n", 1)[1], []
    while True:
        size, rest = body.split(b"\r\n", 1)
        if int(size, 16) == 0:
            assert rest == b"\r\n"
            return events
        event, body = rest[:int(size, 16)], rest[int(size, 16) + 2:]
        assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"data: ") == 1
        events.append(re.sub(rb'"created":\d+', b'"created":0', re.sub(rb"cmpl-[0-9a-f]{32}", b"cmpl-X", event)))


def merged(events: list[bytes]) -> tuple[dict, list[bytes]]:
    """Each choice's text, and every event with its text left out: what stays when the engine side merges the
    outputs of several steps into one chunk while a consumer lags (timing decides where that happens)."""
    texts: dict[int, str] = {}
    shapes = []
    for event in events[:-1]:
        chunk = json.loads(event[6:])
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        shapes.append(re.sub(rb'"text":"[^"]*"', b'"text":""', event))
    return texts, sorted(set(shapes)) + events[-1:]


def count_direct_writes(monkeypatch) -> list[int]:
    writes: list[int] = []
    original = direct_write.BodyWriter.write

    async def counting(self, data):
        writes.append(len(data))
        await original(self, data)

    monkeypatch.setattr(direct_write.BodyWriter, "write", counting)
    return writes


def test_stream_bytes_are_those_of_the_asgi_send_path(monkeypatch):
    writes = count_direct_writes(monkeypatch)
    request = {"prompt": "hi", "max_tokens": 6, "stream": True, "n": 2,
               "stream_options": {"include_usage": True}}
    with uvicorn_server() as (_, port):
        direct = read_all(post(port, request))
        assert writes, "the direct path was not taken"
        monkeypatch.setattr(serving_engine, "body_writer", lambda scope: None)
        n_direct = len(writes)
        via_send = read_all(post(port, request))
        assert len(writes) == n_direct  # this one went through ASGI send
    assert direct.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in direct.lower()
    assert merged(events_of(direct)) == merged(events_of(via_send))
    assert merged(events_of(direct))[0] == {0: "fghijk", 1: "fghijk"}
    assert b'"usage":{"prompt_tokens"' in direct and direct.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


def check_client_gone_mid_stream_aborts_its_request(events_before_close: int) -> None:
    """A client that closes its socket after some events: the engine drops the request, the next one is served."""
    with uvicorn_server(step_sleep=0.02) as (engine, port):
        s = post(port, {"prompt": "hi", "max_tokens": 50, "stream": True})
        got = b""
        while got.count(b"data: ") < events_before_close:
            got += s.recv(65536)
        s.close()
        deadline = time.monotonic() + 60
        while not engine.aborted:
            assert time.monotonic() < deadline, "the request was never aborted"
            time.sleep(0.01)
        assert not engine.requests  # the engine dropped it
        again = read_all(post(port, {"prompt": "hi", "max_tokens": 3, "stream": True}))
        assert again.count(b'"finish_reason":"length"') == 1 and again.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


def test_client_gone_mid_stream_aborts_its_request_and_the_server_goes_on(monkeypatch):
    writes = count_direct_writes(monkeypatch)
    check_client_gone_mid_stream_aborts_its_request(events_before_close=3)
    assert writes


def test_http_1_0_client_gets_h11s_framing(monkeypatch):
    writes = count_direct_writes(monkeypatch)
    with uvicorn_server() as (_, port):
        raw = read_all(post(port, {"prompt": "hi", "max_tokens": 4, "stream": True}, version="1.0"), until=b"\0")
    assert raw.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in raw.lower()
    body = raw.split(b"\r\n\r\n", 1)[1]
    assert body.startswith(b"data: {") and body.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in body
    assert writes


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing


class FakeCycle:
    """What body_writer reads of uvicorn's RequestResponseCycle, after the response start was sent."""

    def __init__(self, http_version: str = "1.1") -> None:
        self.conn = h11.Connection(h11.SERVER)
        self.conn.receive_data(f"GET / HTTP/{http_version}\r\nHost: x\r\n\r\n".encode())
        self.conn.next_event(), self.conn.next_event()
        self.conn.send(h11.Response(status_code=200, headers=[]))
        self.transport = FakeTransport()
        self.flow = FlowControl(self.transport)
        self.disconnected = False

    async def send(self, message):  # the server's send: body_writer finds the cycle as its __self__
        raise AssertionError("not called")

    def writer(self, method: str = "POST"):
        return direct_write.body_writer({direct_write.SERVER_SEND: self.send, "method": method})


def test_chunks_are_framed_as_h11_frames_them():
    cycle, reference = FakeCycle(), FakeCycle()
    chunks = [b"data: {}\n\n", "data: {\"text\":\"\u00e9\u4e2d\"}\n\n".encode(), b"x" * 70000]
    for chunk in chunks:
        asyncio.run(cycle.writer().write(chunk))
    assert cycle.transport.written == [reference.conn.send(h11.Data(data=c)) for c in chunks]


def test_writer_waits_while_the_transport_is_over_its_high_water_mark():
    cycle = FakeCycle()
    writer = cycle.writer()

    async def run():
        await writer.write(b"abc")
        cycle.flow.pause_writing()  # the client stopped reading: the transport's buffer is full
        pending = asyncio.ensure_future(writer.write(b"de"))
        await asyncio.sleep(0.01)
        assert not pending.done() and cycle.transport.written == [b"3\r\nabc\r\n"]
        cycle.flow.resume_writing()
        await pending
        await writer.write(b"")  # never an empty chunk: it would end the body
        cycle.disconnected = True
        await writer.write(b"gone")

    asyncio.run(run())
    assert cycle.transport.written == [b"3\r\nabc\r\n", b"2\r\nde\r\n"]


def test_body_writer_is_none_off_uvicorn_h11():
    assert direct_write.body_writer({}) is None  # no server send (a test transport)
    assert direct_write.body_writer({direct_write.SERVER_SEND: lambda m: None}) is None  # not a bound method
    assert FakeCycle().writer("HEAD") is None
    assert FakeCycle().writer("POST") is not None


def test_http_1_0_writer_frames_with_h11_and_skips_a_closing_transport():
    cycle = FakeCycle("1.0")
    writer = cycle.writer()
    asyncio.run(writer.write(b"abc"))
    cycle.transport.closing = True
    asyncio.run(writer.write(b"def"))
    assert cycle.transport.written == [b"abc"]
