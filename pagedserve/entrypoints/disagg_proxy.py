"""`pagedserve proxy --prefill URL --decode URL`: disaggregated prefill/decode behind one OpenAI endpoint.

Each completion or chat request goes first to a prefill instance (a server with kv_role kv_producer on a shared
KV store) as the same request with max_tokens=1, not streamed: it computes the prompt's KV, and write-through
saves the full blocks to the store before it answers. Then the original request goes to a decode instance
(kv_consumer on the same store), which loads those blocks instead of computing them; its answer, a stream or
not, passes through unbuffered, and a client that disconnects closes the decode request (the server aborts it).
A prefill instance that fails only costs the decode instance the prompt's compute: the request still succeeds.
Instances are taken round-robin.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedserve.entrypoints.http_relay import (add_generation_routes, forwarded_headers, new_client, stream_back,
                                               unavailable)

logger = logging.getLogger("pagedserve")

# what the prefill request drops: it produces one token, unstreamed
_PREFILL_DROPPED = ("stream", "stream_options", "max_completion_tokens", "n", "best_of", "use_beam_search")


def prefill_body(payload: dict) -> dict:
    body = {k: v for k, v in payload.items() if k not in _PREFILL_DROPPED}
    body["max_tokens"] = 1
    return body


def build_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    app = FastAPI(title="pagedserve prefill/decode proxy")
    client = new_client()
    prefill_turn, decode_turn = itertools.count(), itertools.count()

    def pick(urls: list[str], turn) -> str:
        return urls[next(turn) % len(urls)].rstrip("/")

    async def prefill_then_decode(request: Request, path: str) -> Response:
        body = await request.body()
        headers = forwarded_headers(request)
        try:
            payload = json.loads(body)
        except json.JSONDecodeError:
            payload = None
        if isinstance(payload, dict):  # anything else: the decode instance answers the 400
            try:
                await client.post(pick(prefill_urls, prefill_turn) + path, json=prefill_body(payload),
                                  headers=headers)
            except httpx.HTTPError as exc:  # the decode instance computes the prompt itself
                logger.warning("prefill instance failed (%s: %s); decoding without its KV", type(exc).__name__, exc)
        return await relay(client.build_request("POST", pick(decode_urls, decode_turn) + path, content=body,
                                                headers=headers))

    async def relay(upstream_request: httpx.Request) -> Response:
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            return unavailable(f"decode instance unreachable: {exc}")
        return stream_back(upstream)

    add_generation_routes(app, prefill_then_decode)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await relay(client.build_request("GET", decode_urls[0].rstrip("/") + "/v1/models",
                                                headers=forwarded_headers(request)))

    @app.get("/health")
    async def health() -> Response:
        for url in decode_urls:
            try:
                if (await client.get(url.rstrip("/") + "/health")).status_code == 200:
                    return Response(status_code=200)
            except httpx.HTTPError:
                pass
        return Response(status_code=503)

    return app


def add_proxy_parser(subparsers) -> None:
    p = subparsers.add_parser("proxy", help="disaggregated prefill/decode: one OpenAI endpoint in front of prefill "
                                            "(kv_producer) and decode (kv_consumer) servers sharing a KV store")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers, e.g. http://h:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=_run_proxy)


def _run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")
    return 0
