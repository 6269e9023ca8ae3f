"""`pagedserve router --worker URL ...`: one OpenAI endpoint in front of data-parallel replicas.

Cache-aware (SGLang's router, simplified): each request goes to the replica most likely to hold its prefix in its
KV cache: the request's leading text (prompt or messages) is cut into chunks with chained hashes, like KV blocks,
and each replica remembers (LRU) the chunks it was sent. The replica matching the most leading chunks wins,
unless it has `--balance-abs-threshold` more requests in flight than the least loaded one; a request matching
none goes to the least loaded replica (then the one holding the fewest prefixes, which spreads new prefixes).
A request counts as in flight on its replica from the moment it is dispatched (concurrent requests see it) until
its answer ends, however it ends. Replicas are health-checked every `--health-check-interval` seconds; a replica
that refuses a connection (or whose pool is full) gets nothing: the request goes to the next best. Answers stream
through unbuffered; a client disconnect closes the replica's request (the server aborts it). Timeouts, pools, the
API key and the body limit: entrypoints/http_relay.py. `--policy round_robin` is the baseline to compare with.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.entrypoints.http_relay import (RelayConfig, RelayGuard, Upstream, UpstreamUnavailable,
                                               add_generation_routes, add_relay_args, relay, relay_lifespan,
                                               unavailable)

logger = logging.getLogger("pagedserve")

CHUNK_CHARS = 64  # ~16 tokens of English: about one KV block
MAX_CHUNKS = 256
MAX_PREFIXES_PER_WORKER = 100_000


def prefix_keys(payload: dict) -> list[int]:
    """Chained hashes of the request's leading text, one per CHUNK_CHARS: equal leading text, equal keys."""
    text = json.dumps(payload.get("messages", payload.get("prompt")), sort_keys=True, ensure_ascii=False)
    keys, parent = [], 0
    for start in range(0, min(len(text), CHUNK_CHARS * MAX_CHUNKS) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hash((parent, text[start:start + CHUNK_CHARS]))
        keys.append(parent)
    return keys


@dataclass(eq=False)
class Worker(Upstream):
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def matched(self, keys: list[int]) -> int:
        n = 0
        for key in keys:
            if key not in self.prefixes:
                break
            n += 1
        return n

    def remember(self, keys: list[int]) -> None:
        for key in keys:
            self.prefixes[key] = None
            self.prefixes.move_to_end(key)
        while len(self.prefixes) > MAX_PREFIXES_PER_WORKER:
            self.prefixes.popitem(last=False)


class Router:
    def __init__(self, urls: list[str], policy: str = "cache_aware", balance_abs_threshold: int = 4) -> None:
        self.workers = [Worker(url.rstrip("/")) for url in urls]
        self.policy = policy
        self.balance_abs_threshold = balance_abs_threshold
        self._turn = itertools.count()

    def choose(self, keys: list[int], excluded: set[str]) -> Worker | None:
        live = [w for w in self.workers if w.healthy and w.url not in excluded]
        if not live:
            return None
        if self.policy == "round_robin":
            return live[next(self._turn) % len(live)]
        least = min(live, key=lambda w: (w.in_flight, len(w.prefixes)))
        best = max(live, key=lambda w: (w.matched(keys), -w.in_flight))
        if best.matched(keys) == 0 or best.in_flight - least.in_flight > self.balance_abs_threshold:
            return least
        return best


def build_app(router: Router, config: RelayConfig | None = None) -> FastAPI:
    config = config or RelayConfig()
    app = FastAPI(title="pagedserve router", lifespan=lambda app: relay_lifespan(router.workers, config))
    app.add_middleware(RelayGuard, config=config)

    async def route(request: Request, path: str, body: bytes) -> Response:
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            payload = None
        keys = prefix_keys(payload) if isinstance(payload, dict) else []
        tried: set[str] = set()
        while (worker := router.choose(keys, tried)) is not None:
            tried.add(worker.url)
            worker.remember(keys)
            try:
                return await relay(worker, request, "POST", path, body)
            except UpstreamUnavailable as exc:  # nothing was sent: another replica may take it
                logger.warning("%s; retrying elsewhere", exc)
        return unavailable("no healthy worker")

    add_generation_routes(app, route, config)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for w in router.workers:
            if w.healthy:
                with contextlib.suppress(UpstreamUnavailable):
                    return await relay(w, request, "GET", "/v1/models")
        return unavailable("no healthy worker")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if any(w.healthy for w in router.workers) else 503)

    @app.get("/workers")
    async def workers() -> Response:
        return JSONResponse([w.state() | {"num_prefixes": len(w.prefixes)} for w in router.workers])

    return app


def add_router_parser(subparsers) -> None:
    p = subparsers.add_parser("router", help="one OpenAI endpoint in front of data-parallel replicas, routing each "
                                             "request to the replica most likely to hold its prefix")
    p.add_argument("--worker", nargs="+", required=True, metavar="URL", help="replica servers, e.g. http://h:8100")
    p.add_argument("--policy", choices=["cache_aware", "round_robin"], default="cache_aware")
    p.add_argument("--balance-abs-threshold", type=int, default=4,
                   help="route by load instead of prefix when the best match has this many more requests in flight")
    add_relay_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(Router(args.worker, args.policy, args.balance_abs_threshold), RelayConfig.from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
