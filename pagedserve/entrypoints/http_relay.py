"""Relaying OpenAI requests to pagedserve servers (the prefill/decode proxy, the router): headers kept, the answer
passed through unbuffered, a client disconnect closing the upstream request (the server then aborts it)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask


OPENAI_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def add_generation_routes(app: FastAPI, handler: Callable[[Request, str], Awaitable[Response]]) -> None:
    """POST /v1/completions and /v1/chat/completions -> handler(request, path)."""
    for path in OPENAI_GENERATION_PATHS:
        async def endpoint(request: Request, path: str = path) -> Response:
            return await handler(request, path)

        app.add_api_route(path, endpoint, methods=["POST"])


def new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))


def forwarded_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}


def stream_back(upstream: httpx.Response, headers: dict[str, str] | None = None,
                on_close: Callable[[], None] | None = None) -> Response:
    """The upstream answer as it arrives; once it ends (or the client went away) the upstream request is closed
    and `on_close` runs."""
    async def close() -> None:
        await upstream.aclose()
        if on_close is not None:
            on_close()

    return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                             media_type=upstream.headers.get("content-type"), headers=headers,
                             background=BackgroundTask(close))


def unavailable(message: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": "ServiceUnavailable", "code": 503}}, status_code=503)
