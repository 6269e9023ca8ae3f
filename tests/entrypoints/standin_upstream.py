"""Stand-in upstreams for the router and proxy tests: a small real HTTP server process on loopback that behaves
badly on purpose. Not a test module (no tests here); run as `python standin_upstream.py MODE PORT [DELAY]`:

* slow: /health 200; a completion answers after DELAY seconds (streamed as 3 SSE events if asked); GET /stats
  says how many generation requests came, the peak number at once, and the size of the last body.
* hold: as slow, but a completion waits until POST /release instead of DELAY seconds (a test reads what is in
  flight with no timing window).
* die: /health 200; a streamed completion sends 2 SSE events, then the process exits (os._exit); a non-streamed
  one exits before answering.
* reject: /health 200; every completion gets an OpenAI-style 400.
* hang: accepts connections and reads requests, never answers anything (/health included).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def completion(text: str) -> dict:
    return {"id": "cmpl-standin", "object": "text_completion", "model": "standin",
            "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}]}


def sse(text: str) -> bytes:
    return f"data: {json.dumps(completion(text))}\n\n".encode()


def build_app(mode: str, delay: float):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    stats = {"requests": 0, "in_flight": 0, "peak_in_flight": 0, "last_body_bytes": 0}
    released = asyncio.Event()  # hold mode: completions wait for POST /release

    async def generate(request: Request) -> Response:
        body = await request.body()
        stats["requests"] += 1
        stats["last_body_bytes"] = len(body)
        payload = json.loads(body)
        if mode == "reject":
            return JSONResponse({"error": {"message": "rejected by the stand-in", "type": "invalid_request_error",
                                           "param": "min_tokens", "code": "invalid_value"}}, status_code=400)
        if mode == "die" and not payload.get("stream"):
            os._exit(3)
        stats["in_flight"] += 1
        stats["peak_in_flight"] = max(stats["peak_in_flight"], stats["in_flight"])
        try:
            await (released.wait() if mode == "hold" else asyncio.sleep(delay))
        finally:
            stats["in_flight"] -= 1
        if not payload.get("stream"):
            return JSONResponse(completion("ok"))

        async def events():
            for i in range(3):
                yield sse(f"part{i} ")
                await asyncio.sleep(0.05)
                if mode == "die" and i == 1:
                    os._exit(3)  # mid-stream, after two events
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def get_stats(request: Request) -> Response:
        return JSONResponse(stats)

    async def release(request: Request) -> Response:
        released.set()
        return Response(status_code=200)

    return Starlette(routes=[Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/health", health), Route("/stats", get_stats),
                             Route("/release", release, methods=["POST"])])


async def serve_hung(port: int) -> None:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):
            pass  # read everything, answer nothing, keep the connection open

    server = await asyncio.start_server(swallow, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


class StandinUpstream:
    """The stand-in in a subprocess, up (listening) when the constructor returns."""

    def __init__(self, mode: str, delay: float = 0.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = mode
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), mode, str(self.port),
                                      str(delay)])
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stand-in {mode} did not start")
            time.sleep(0.05)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=5).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "hang":
        asyncio.run(serve_hung(port))
    else:
        import uvicorn

        uvicorn.run(build_app(mode, float(sys.argv[3])), host="127.0.0.1", port=port, log_level="error")
