"""`pagedserve proxy --prefill URL --decode URL`: disaggregated prefill/decode behind one OpenAI endpoint.

Each completion or chat request goes first to a prefill instance (a server with kv_role kv_producer on a shared
KV store) as the same request with max_tokens=1, not streamed, without the fields that only shape a longer
completion (min_tokens would conflict with max_tokens=1): it computes the prompt's KV, and write-through saves the
full blocks to the store before it answers. Then the original request goes to a decode instance (kv_consumer on
the same store), which loads those blocks instead of computing them; its answer, a stream or not, passes through
unbuffered, and a client that disconnects closes the decode request (the server aborts it).

A prefill instance that fails (down, hung past --read-timeout, 5xx, 408/429) only costs the decode instance the
prompt's compute: the request still succeeds. A prefill 4xx otherwise says the request itself is bad (the decode
instance would refuse it too): it is relayed to the client. Instances are taken round-robin among the healthy
ones; timeouts, pools, the API key and the body limit: entrypoints/http_relay.py.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.entrypoints.http_relay import (ClientGone, RelayConfig, RelayGuard, Upstream, UpstreamUnavailable,
                                               add_generation_routes, add_relay_args, forwarded_headers, relay,
                                               relay_lifespan, unavailable, unless_client_leaves)

logger = logging.getLogger("pagedserve")

# what the prefill request drops: it produces one token, unstreamed, so nothing that shapes a longer completion
_PREFILL_DROPPED = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "best_of",
                    "use_beam_search")
_PREFILL_RETRYABLE = (408, 429)  # the prefill instance is busy, not the request bad


def prefill_body(payload: dict) -> dict:
    body = {k: v for k, v in payload.items() if k not in _PREFILL_DROPPED}
    body["max_tokens"] = 1
    return body


class RoundRobin:
    def __init__(self, upstreams: list[Upstream]) -> None:
        self.upstreams = upstreams
        self._turn = itertools.count()

    def order(self) -> list[Upstream]:
        """The healthy instances, starting at the next in turn."""
        start = next(self._turn)
        rotated = [self.upstreams[(start + i) % len(self.upstreams)] for i in range(len(self.upstreams))]
        return [u for u in rotated if u.healthy]


def build_app(prefill_urls: list[str], decode_urls: list[str], config: RelayConfig | None = None) -> FastAPI:
    config = config or RelayConfig()
    prefill = RoundRobin([Upstream(url.rstrip("/")) for url in prefill_urls])
    decode = RoundRobin([Upstream(url.rstrip("/")) for url in decode_urls])
    upstreams = prefill.upstreams + decode.upstreams
    app = FastAPI(title="pagedserve prefill/decode proxy", lifespan=lambda app: relay_lifespan(upstreams, config))
    app.add_middleware(RelayGuard, config=config)

    async def run_prefill(request: Request, path: str, payload: dict) -> Response | None:
        """None when the decode instance may go on (with the prompt's KV or without); else the client's answer."""
        instances = prefill.order()
        if not instances:
            logger.warning("no healthy prefill instance; decoding without its KV")
            return None
        p = instances[0]
        assert p.client is not None
        p.in_flight += 1
        p.num_routed += 1
        try:
            answer = await unless_client_leaves(request, p.client.post(p.url + path, json=prefill_body(payload),
                                                                       headers=forwarded_headers(request)))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except httpx.HTTPError as exc:  # the decode instance computes the prompt itself
            p.num_failed += 1
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                p.mark_down(type(exc).__name__)
            logger.warning("prefill instance %s failed (%s: %s); decoding without its KV", p.url,
                           type(exc).__name__, exc)
            return None
        finally:
            p.in_flight -= 1
        if 400 <= answer.status_code < 500 and answer.status_code not in _PREFILL_RETRYABLE:
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
        if answer.status_code >= 300:
            p.num_failed += 1
            logger.warning("prefill instance %s answered %d; decoding without its KV", p.url, answer.status_code)
        return None

    async def prefill_then_decode(request: Request, path: str, body: bytes) -> Response:
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            payload = None
        if isinstance(payload, dict):  # anything else: the decode instance answers the 400
            refused = await run_prefill(request, path, payload)
            if refused is not None:
                return refused
        for d in decode.order():
            try:
                return await relay(d, request, "POST", path, body)
            except UpstreamUnavailable as exc:
                logger.warning("%s; trying the next decode instance", exc)
        return unavailable("no healthy decode instance")

    add_generation_routes(app, prefill_then_decode, config)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for d in decode.order():
            try:
                return await relay(d, request, "GET", "/v1/models")
            except UpstreamUnavailable:
                continue
        return unavailable("no healthy decode instance")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if any(d.healthy for d in decode.upstreams) else 503)

    @app.get("/workers")
    async def workers() -> Response:
        return JSONResponse([u.state() | {"role": "prefill"} for u in prefill.upstreams] +
                            [u.state() | {"role": "decode"} for u in decode.upstreams])

    return app


def add_proxy_parser(subparsers) -> None:
    p = subparsers.add_parser("proxy", help="disaggregated prefill/decode: one OpenAI endpoint in front of prefill "
                                            "(kv_producer) and decode (kv_consumer) servers sharing a KV store")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers, e.g. http://h:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers")
    add_relay_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=_run_proxy)


def _run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(args.prefill, args.decode, RelayConfig.from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
