"""Relaying OpenAI requests to pagedserve servers (the router, the prefill/decode proxy): a reverse proxy that
survives slow, hung and dying upstreams and hostile clients.

* Each upstream has its own connection pool (--max-connections-per-upstream) with connect, read and pool
  timeouts: a hung upstream holds at most its own pool, each request for at most --read-timeout, and a request
  that finds the pool full gets another upstream (or a 503) after --pool-timeout instead of queuing invisibly.
* The API key is checked before a byte of the body is read; a body is read into one buffer up to
  --max-request-body-bytes (413 by Content-Length before reading, or the moment a chunked body passes it).
* An upstream counts a request in flight from the moment it is dispatched; the count is released exactly once
  however the request ends (answered, client gone, upstream refused, died or went silent).
* The answer passes through unbuffered; a client that disconnects closes the upstream request (the server then
  aborts it). An upstream that dies or goes silent mid-stream ends an SSE stream with an OpenAI error event and
  `data: [DONE]` (a non-streamed answer is cut, so the client sees a broken response, never a truncated one).
* Health is probed every --health-check-interval on a separate small pool, so full pools never block it; /health
  of the relay answers from that state without calling anyone.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pagedserve import envs
from pagedserve.entrypoints.openai.errors import OpenAIError, error_body, error_response

logger = logging.getLogger("pagedserve")

OPENAI_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = frozenset({"/health"})  # load balancers carry no key; everything else (/workers included) needs it
DEFAULT_MAX_BODY_BYTES = 16 << 20  # the server's default: a relay accepts no more than its upstreams would
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class RelayConfig:
    api_keys: tuple[str, ...] = ()  # empty: no key checked here (the upstreams still check theirs)
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    connect_timeout: float = 5.0
    read_timeout: float = 600.0  # the longest silence of an upstream: a non-streamed answer is one silence
    pool_timeout: float = 10.0
    max_connections_per_upstream: int = 1024  # each upstream's server queues up to --max-queued-requests itself
    health_check_interval: float = 2.0
    health_check_timeout: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_connections_per_upstream"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("connect_timeout", "read_timeout", "pool_timeout", "health_check_interval",
                     "health_check_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RelayConfig:
        """From the relay flags (add_relay_args); `serve -dp` passes its own namespace: what it lacks is default."""
        keys = tuple(k for k in (getattr(args, "api_key", None), getattr(args, "admin_api_key", None)) if k)
        fields = {name: getattr(args, name) for name in cls.__dataclass_fields__
                  if name != "api_keys" and getattr(args, name, None) is not None}
        return cls(api_keys=keys, **fields)


def add_relay_args(p: argparse.ArgumentParser) -> None:
    d = RelayConfig()
    p.add_argument("--api-key", default=envs.PAGEDSERVE_API_KEY,
                   help="require 'Authorization: Bearer <key>' (checked here, before any body is read) on every "
                        "endpoint except /health (default: $PAGEDSERVE_API_KEY)")
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="larger request bodies get 413, before they are read when they declare their length")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout,
                   help="seconds to open a connection to an upstream (past it: the next upstream is tried)")
    p.add_argument("--read-timeout", type=float, default=d.read_timeout,
                   help="seconds an upstream may stay silent (a non-streamed answer is one silence) before the "
                        "request is ended with a 504 or, mid-stream, an error event")
    p.add_argument("--pool-timeout", type=float, default=d.pool_timeout,
                   help="seconds a request waits for a free connection to its upstream before another is tried")
    p.add_argument("--max-connections-per-upstream", type=int, default=d.max_connections_per_upstream,
                   help="requests in flight to one upstream at most (its connection pool)")
    p.add_argument("--health-check-interval", type=float, default=d.health_check_interval)


@dataclass(eq=False)
class Upstream:
    """One server behind the relay, with its own connection pool (set by open_pools)."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    num_routed: int = 0
    num_failed: int = 0
    client: httpx.AsyncClient | None = None

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "num_routed": self.num_routed, "num_failed": self.num_failed}

    def mark_down(self, why: str) -> None:
        if self.healthy:
            logger.warning("upstream %s marked down: %s", self.url, why)
        self.healthy = False


class UpstreamUnavailable(Exception):
    """Nothing of the request reached the upstream (refused, unreachable, pool full): another one may take it."""


def open_pools(upstreams: Sequence[Upstream], config: RelayConfig) -> None:
    timeout = httpx.Timeout(connect=config.connect_timeout, read=config.read_timeout, write=config.read_timeout,
                            pool=config.pool_timeout)
    n = config.max_connections_per_upstream
    for u in upstreams:
        u.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=n,
                                                                          max_keepalive_connections=min(n, 64)))


async def close_pools(upstreams: Sequence[Upstream]) -> None:
    for u in upstreams:
        if u.client is not None:
            await u.client.aclose()


async def check_health_forever(upstreams: Sequence[Upstream], config: RelayConfig) -> None:
    async with httpx.AsyncClient(timeout=config.health_check_timeout) as client:  # apart from the request pools
        async def probe(u: Upstream) -> None:
            try:
                ok = (await client.get(u.url + "/health")).status_code == 200
            except httpx.HTTPError as exc:
                ok, why = False, f"/health failed ({type(exc).__name__})"
            else:
                why = "/health answered non-200"
            if ok and not u.healthy:
                logger.info("upstream %s healthy again", u.url)
                u.healthy = True
            elif not ok:
                u.mark_down(why)

        while True:
            await asyncio.gather(*(probe(u) for u in upstreams))  # at once: a hung one delays no other's probe
            await asyncio.sleep(config.health_check_interval)


@contextlib.asynccontextmanager
async def relay_lifespan(upstreams: Sequence[Upstream], config: RelayConfig):
    """The upstreams' pools open and health-checked for the app's lifetime."""
    open_pools(upstreams, config)
    task = asyncio.create_task(check_health_forever(upstreams, config))
    try:
        yield
    finally:
        task.cancel()
        await close_pools(upstreams)


# ---------------------------------------------------------------------------------------------- requests
class RelayGuard:
    """Pure ASGI, outermost: the API key and a declared Content-Length are checked before the app runs, so a
    request without the key or over the limit is answered without a byte of its body being read."""

    def __init__(self, app: Any, config: RelayConfig) -> None:
        self.app = app
        self.accepted = [f"Bearer {key}".encode() for key in config.api_keys]
        self.max_bytes = config.max_request_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path", "") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        got = headers.get(b"authorization", b"")
        if self.accepted and not any([secrets.compare_digest(got, key) for key in self.accepted]):  # no short cut
            message = "Missing API key: send 'Authorization: Bearer <key>'." if not got else "Incorrect API key provided."
            await refusal(OpenAIError(401, message, code="invalid_api_key"))(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await refusal(too_large(self.max_bytes))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"The request body exceeds {max_bytes} bytes (--max-request-body-bytes).",
                       code="request_too_large")


def refusal(exc: OpenAIError) -> Response:
    """An error answered before the body was read: the connection closes after it (without that, the HTTP server
    would read and discard the rest of the body to keep the connection alive)."""
    response = error_response(exc)
    response.headers["connection"] = "close"
    return response


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, read into one growing buffer (linear, whatever the chunking); OpenAIError 413 as soon as it
    passes max_bytes (a chunked body declares no length: it is counted as it arrives)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large(max_bytes)
    return bytes(body)


def add_generation_routes(app: FastAPI, handler: Callable[[Request, str, bytes], Awaitable[Response]],
                          config: RelayConfig) -> None:
    """POST /v1/completions and /v1/chat/completions -> handler(request, path, body), the body read under the
    size limit."""
    for path in OPENAI_GENERATION_PATHS:
        async def endpoint(request: Request, path: str = path) -> Response:
            try:
                body = await read_body(request, config.max_request_body_bytes)
            except OpenAIError as exc:
                return refusal(exc)
            return await handler(request, path, body)

        app.add_api_route(path, endpoint, methods=["POST"])


def forwarded_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}


def unavailable(message: str) -> Response:
    return error_response(OpenAIError(503, message, code="service_unavailable"))


class ClientGone(Exception):
    """The client disconnected before its answer started."""


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body was read: the next message can only be the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, awaitable: Awaitable[Any]) -> Any:
    """The awaitable's result, unless the client disconnects first: then it is cancelled (closing its upstream
    connection, so the server aborts the request) and ClientGone raised."""
    task = asyncio.ensure_future(awaitable)
    watching = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()


async def relay(upstream: Upstream, request: Request, method: str, path: str, body: bytes | None = None) -> Response:
    """Send the request to `upstream` and pass its answer back. Raises UpstreamUnavailable when nothing reached
    it (try another); any other failure is answered here (502/504, or nothing for a client that left)."""
    assert upstream.client is not None, "open_pools first"
    upstream.in_flight += 1  # at dispatch: concurrent requests see it while this one waits for its answer
    upstream.num_routed += 1
    try:
        answer = await unless_client_leaves(request, upstream.client.send(upstream.client.build_request(
            method, upstream.url + path, content=body, headers=forwarded_headers(request)), stream=True))
    except ClientGone:
        upstream.in_flight -= 1
        return Response(status_code=499)  # nobody reads it
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        upstream.in_flight -= 1
        if not isinstance(exc, httpx.PoolTimeout):  # a full pool is busy, not down
            upstream.mark_down(f"{type(exc).__name__}: {exc}")
        raise UpstreamUnavailable(f"{upstream.url}: {type(exc).__name__}") from exc
    except httpx.HTTPError as exc:
        upstream.in_flight -= 1
        upstream.num_failed += 1
        timed_out = isinstance(exc, httpx.TimeoutException)
        if not timed_out:
            upstream.mark_down(f"{type(exc).__name__} before answering")
        logger.warning("upstream %s failed before answering: %s: %s", upstream.url, type(exc).__name__, exc)
        status, code = (504, "upstream_timeout") if timed_out else (502, "upstream_failed")
        return error_response(OpenAIError(status, f"The upstream server failed: {type(exc).__name__}.",
                                          code=code, type="server_error"))
    except BaseException:
        upstream.in_flight -= 1
        raise
    return RelayedAnswer(upstream, answer)


class RelayedAnswer(StreamingResponse):
    """An upstream answer streamed back; the upstream request is closed and its in-flight count released once,
    whichever way the response ends (done, client gone, upstream died)."""

    def __init__(self, upstream: Upstream, answer: httpx.Response) -> None:
        self.upstream, self.answer = upstream, answer
        self.is_sse = answer.headers.get("content-type", "").startswith("text/event-stream")
        super().__init__(self._chunks(), status_code=answer.status_code,
                         media_type=answer.headers.get("content-type"),
                         headers={"x-pagedserve-worker": upstream.url})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.upstream.in_flight -= 1
            with contextlib.suppress(BaseException):
                await asyncio.shield(self.answer.aclose())

    async def _chunks(self) -> AsyncIterator[bytes]:
        pending = b""  # SSE: only whole events go out, so an error event never lands inside a cut one
        try:
            async for chunk in self.answer.aiter_raw():
                if not self.is_sse:
                    yield chunk
                    continue
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end >= 0:
                    yield pending[:end + 2]
                    pending = pending[end + 2:]
        except httpx.HTTPError as exc:  # died (connection reset or closed early) or silent past the read timeout
            self.upstream.num_failed += 1
            if not isinstance(exc, httpx.TimeoutException):
                self.upstream.mark_down(f"{type(exc).__name__} mid-answer")
            logger.warning("upstream %s failed mid-answer: %s: %s", self.upstream.url, type(exc).__name__, exc)
            if not self.is_sse:
                raise  # the connection is cut: the client sees a broken answer, not a short one
            body = error_body(f"The upstream server failed mid-stream: {type(exc).__name__}.", "server_error",
                              None, "upstream_timeout" if isinstance(exc, httpx.TimeoutException) else "upstream_failed")
            yield f"data: {json.dumps(body)}\n\n".encode() + SSE_DONE
            return
        if pending:
            yield pending
