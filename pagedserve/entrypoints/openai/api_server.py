"""`pagedserve serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    app = build_app(async_llm, args)     # tests / embedding
    run_server(args)                     # load the model, bind, serve until SIGINT/SIGTERM

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (generative models); POST
/v1/embeddings, /pooling, /score, /v1/score, /rerank, /v1/rerank, /v2/rerank (pooling models: serving_pooling.py);
GET /v1/models, GET /v1/models/{id},
GET /health, GET /version, POST /tokenize, POST /detokenize, GET /metrics, GET /v1/events (engine step events,
SSE), GET /dashboard.  See docs/SERVING.md.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import secrets
import signal
import sys
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedserve import envs
from pagedserve.engine.async_llm import DEFAULT_STEP_TIMEOUT_S, AsyncLLM
from pagedserve.engine.protocol import EngineClient
from pagedserve.engine.startup import process_age_s
from pagedserve.entrypoints.dashboard.routes import HostCheck, add_live_event_routes
from pagedserve.entrypoints.openai.direct_write import DirectWriteApp
from pagedserve.entrypoints.openai.errors import (OpenAIError, error_response, exception_to_openai,
                                                  install_error_handlers)
from pagedserve.errors import EngineRequestError, EngineShuttingDown
from pagedserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                    DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                                    TokenizeResponse)
from pagedserve.entrypoints.openai import protocol as api_docs  # route docs (responses=)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedserve.entrypoints.openai.pooling_protocol import (EmbeddingRequest, EmbeddingResponse, PoolingRequest,
                                                            PoolingResponse, RerankRequest, RerankResponse,
                                                            ScoreRequest, ScoreResponse)
from pagedserve.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedserve.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedserve.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from pagedserve.entrypoints.openai.serving_engine import ClientDisconnected, OpenAIServing
from pagedserve.entrypoints.openai.serving_models import OpenAIServingModels, add_lora_routes, parse_lora_module
from pagedserve.entrypoints.openai.vllm_compat import (add_compat_args, add_compat_routes, add_cors,
                                                       load_chat_template, load_generation_defaults, uvicorn_kwargs)

logger = logging.getLogger("pagedserve.api")

# Reachable without the API key (load balancers and Prometheus scrapers carry no token).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
OPEN_PREFIXES = ("/dashboard",)  # the page's static files; the events it reads need the key
DEFAULT_MAX_BODY_BYTES = 16 << 20
DETOKENIZE_MIN_LIMIT = 1 << 16  # tokens one /detokenize may ask for, whatever max_model_len (~20 ms of GIL)


# ------------------------------------------------------------------------------------------------ CLI
def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from pagedserve.config import EngineArgs

    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server",
                              description="OpenAI-compatible HTTP server (flags follow vLLM's names).")
    p.add_argument("model", nargs="?", default=None,
                   help="local checkpoint dir or hub id (default: the embedded demo model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (use 0.0.0.0 to listen on all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=envs.PAGEDSERVE_API_KEY,
                   help="require 'Authorization: Bearer <key>' on every endpoint except /health, /metrics and the "
                        "/dashboard page (default: $PAGEDSERVE_API_KEY)")
    p.add_argument("--admin-api-key", default=envs.PAGEDSERVE_ADMIN_API_KEY,
                   help="a second key, accepted everywhere the API key is, that alone gets the full view of "
                        "/v1/events (the vLLM KV-cache events, with other clients' token ids); without it every "
                        "reader gets the redacted view (default: $PAGEDSERVE_ADMIN_API_KEY)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated host names /dashboard and /v1/events answer under, besides IP addresses, "
                        "localhost and --host ('*': any); other Host headers get 403 (DNS-rebinding protection)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput / KV usage line")
    p.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats lines")
    p.add_argument("--enable-log-requests", action="store_true", help="log every request (sizes and params)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are ended "
                        "with an error")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="sequences that may wait for a seat in the running batch; beyond it new requests get "
                        "429 with Retry-After (SGLang's name)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 before they are read")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the model family's tool-call format: hermes (Hermes / Qwen <tool_call>), llama3_json, "
                        "mistral ([TOOL_CALLS])")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split the thinking off chat answers into reasoning_content (vLLM's parsers): qwen3 "
                        "(<think>...</think>), deepseek_r1 (answer starts in reasoning), gpt_oss (harmony channels)")
    p.add_argument("--structured-outputs-config", type=structured_outputs_config, default={},
                   help='vLLM\'s, as JSON; one key here: {"enable_in_reasoning": true} applies output constraints to '
                        "the thinking too (default: only after the reasoning ends, with --reasoning-parser)")
    p.add_argument("--max-consecutive-step-failures", type=int, default=5,
                   help="/health answers 503 after this many failed engine steps in a row (until one succeeds)")
    p.add_argument("--step-timeout-s", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                   help="/health answers 503 while an engine step has run longer than this (a hung KV store or "
                        "kernel), until it returns (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S)")
    p.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                   help="LoRA adapters served with --enable-lora: name=path (a PEFT directory) or JSON, as vLLM")
    add_compat_args(p)
    EngineArgs.add_cli_args(p)  # --served-model-name, --max-num-seqs, --num-kv-blocks, ... (vLLM names)
    p.set_defaults(func=run_server)
    return p


def structured_outputs_config(text: str) -> dict[str, bool]:
    """--structured-outputs-config: vLLM's JSON, of which this server has one key (anything else is an error)."""
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or set(value) - {"enable_in_reasoning"} or \
            not all(isinstance(v, bool) for v in value.values()):
        raise argparse.ArgumentTypeError('expected {"enable_in_reasoning": true|false}')
    return value


# ------------------------------------------------------------------------------------------ API key
class APIKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would get in the way of streaming and disconnects). The outermost
    layer: a request without the key is answered before any of its body is read."""

    def __init__(self, app: Any, api_key: str | None, admin_api_key: str | None = None) -> None:
        self.app = app
        self.accepted = [f"Bearer {key}".encode() for key in (api_key, admin_api_key) if key]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or path in OPEN_PATHS or \
                path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        got = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                got = value
                break
        if not any([secrets.compare_digest(got, key) for key in self.accepted]):  # a list: no short cut
            message = ("Missing API key: send 'Authorization: Bearer <key>'." if not got else
                       "Incorrect API key provided.")
            await error_response(OpenAIError(401, message, code="invalid_api_key"))(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over the limit: by Content-Length before reading; a body without one (chunked) is counted
    as the app reads it, and the moment it passes the limit the client gets the 413 and the app a disconnect, so
    nothing past the limit is ever held (and nothing is buffered here)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and declared.isdigit():
            if int(declared) > self.max_bytes:
                await self._reject(scope, receive, send)
            else:  # the HTTP parser holds the client to its Content-Length
                await self.app(scope, receive, send)
            return
        received = 0
        rejected = response_started = False

        async def counting_receive() -> dict:
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    rejected = True
                    if not response_started:
                        await self._reject(scope, receive, send)
                    return {"type": "http.disconnect"}  # the app stops reading and answers nobody
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal response_started
            if rejected:
                return  # the 413 went out: whatever the app says after its disconnect is dropped
            response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not rejected:
                raise  # the app's disconnect handling after a 413 is no error worth a traceback

    async def _reject(self, scope: dict, receive: Any, send: Any) -> None:
        err = OpenAIError(413, f"The request body exceeds {self.max_bytes} bytes (--max-request-body-bytes).",
                          code="request_too_large")
        await error_response(err)(scope, receive, send)


# ------------------------------------------------------------------------------------------------ app
def build_app(engine_client: EngineClient, args: Any = None, *, shutdown_engine_on_exit: bool = True) -> FastAPI:
    """The FastAPI app around a running engine client.  Each app has its own Prometheus registry.

    `args` (the `serve` CLI namespace) may be None: then the server defaults apply."""
    from prometheus_client import CollectorRegistry

    from pagedserve.metrics.prometheus import CONTENT_TYPE_LATEST, PrometheusStatLogger, render
    from pagedserve.metrics.server_profile import ServerProfileCollector

    def arg(name: str, default: Any) -> Any:
        return getattr(args, name, default) if args is not None else default

    config = engine_client.config
    served = config.model.served_model_name
    max_model_len = config.model.max_model_len
    log_requests = bool(arg("enable_log_requests", False))
    completion = OpenAIServingCompletion(engine_client, served, log_requests)
    chat = OpenAIServingChat(engine_client, served, log_requests,
                             tool_call_parser=arg("tool_call_parser", None) if arg("enable_auto_tool_choice", False)
                             else None, reasoning_parser=arg("reasoning_parser", None),
                             constrain_reasoning=arg("structured_outputs_config", {}).get("enable_in_reasoning", False))
    base = OpenAIServing(engine_client, served, log_requests)
    pooling = OpenAIServingPooling(engine_client, served, log_requests)
    responses = OpenAIServingResponses(chat)
    names = arg("served_model_name", None)
    chat_template = load_chat_template(arg("chat_template", None))
    defaults = load_generation_defaults(arg("generation_config", None), None if config.model.is_default_model
                                        else config.model.path)
    models = OpenAIServingModels(engine_client, [served, *(names if isinstance(names, list) else ())],
                                 arg("lora_modules", None) or [])
    if models.static_lora_modules and not models.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora.")
    for serving in (completion, chat, base, pooling):
        serving.served_model_aliases = frozenset(names if isinstance(names, list) else ())
        serving.chat_template = chat_template
        serving.default_sampling = defaults
        serving.models = models

    registry = CollectorRegistry()
    cache_info = {"block_size": config.cache.block_size, "num_gpu_blocks": engine_client.kv_cache_config.num_blocks,
                  "enable_prefix_caching": config.cache.enable_prefix_caching,
                  "cache_dtype": config.cache.kv_cache_dtype}
    prometheus = PrometheusStatLogger(registry, served, max_model_len=max_model_len,
                                      max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                                      cache_config=cache_info)
    engine_client.add_stat_logger(prometheus)
    registry.register(ServerProfileCollector(engine_client.profile, served))
    is_demo = config.model.is_default_model
    model_root = config.model.path
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await models.init_static_loras()
        yield
        if shutdown_engine_on_exit:
            await asyncio.to_thread(engine_client.shutdown)

    app = DirectWriteApp(title="pagedserve OpenAI-compatible API", lifespan=lifespan)
    app.state.engine_client = engine_client
    app.state.registry = registry
    app.state.served_model_name = served
    install_error_handlers(app)

    async def guarded(coro):
        """Every failure becomes an OpenAI error body; a gone client gets nothing (and no traceback)."""
        try:
            return await coro
        except ClientDisconnected:
            return Response(status_code=499)
        except OpenAIError as exc:
            return error_response(exc)
        except Exception as exc:
            err = exception_to_openai(exc)
            if isinstance(exc, EngineRequestError):
                logger.warning("request failed in the engine: %s", exc)  # the engine loop logged the traceback
            elif err.status_code >= 500 and not isinstance(exc, EngineShuttingDown):
                logger.exception("request failed")
            return error_response(err)

    # ---------------------------------------------------------------------------- OpenAI routes
    @app.post("/v1/completions", response_model=api_docs.CompletionResponse, responses=api_docs.ROUTE_RESPONSES["completions"])
    async def create_completion(req: CompletionRequest, raw_request: Request):
        return await guarded(completion.create_completion(req, raw_request))

    @app.post("/v1/chat/completions", response_model=api_docs.ChatCompletionResponse, responses=api_docs.ROUTE_RESPONSES["chat"])
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        return await guarded(chat.create_chat_completion(req, raw_request))

    # pooling models (vLLM's routes); documented in /openapi.json where the model serves them, else a 400 naming
    # `model`, as a pooling model answers the generation routes
    pools = config.pooler is not None

    def add_pooling_route(paths: tuple[str, ...], request_cls: type, response_cls: type, handler: Any) -> None:
        async def route(req, raw_request: Request):
            return await guarded(handler(req, raw_request))

        route.__annotations__ = {"req": request_cls, "raw_request": Request}  # the body's model, for FastAPI
        for path in paths:
            app.add_api_route(path, route, methods=["POST"], response_model=response_cls, include_in_schema=pools,
                              responses=api_docs.ROUTE_RESPONSES["pooling"])

    add_pooling_route(("/v1/embeddings",), EmbeddingRequest, EmbeddingResponse, pooling.create_embedding)
    add_pooling_route(("/pooling",), PoolingRequest, PoolingResponse, pooling.create_pooling)
    add_pooling_route(("/score", "/v1/score"), ScoreRequest, ScoreResponse, pooling.create_score)
    add_pooling_route(("/rerank", "/v1/rerank", "/v2/rerank"), RerankRequest, RerankResponse, pooling.create_rerank)
    @app.post("/v1/responses", response_model=dict[str, Any], responses=api_docs.ROUTE_RESPONSES["responses"])
    async def create_response(req: ResponsesRequest, raw_request: Request):
        return await guarded(responses.create_response(req, raw_request))

    def model_card() -> ModelCard:
        card = ModelCard(id=served, created=created, root=model_root, max_model_len=max_model_len)
        card.demo_model = is_demo  # type: ignore[attr-defined]  (extra field)
        if is_demo:
            card.description = ("the small demo model embedded in the pagedserve package "  # type: ignore[attr-defined]
                                "(pagedserve/demo_model): for trying the server, not for real use")
        return card

    @app.get("/v1/models", response_model=api_docs.ModelList, responses=api_docs.ROUTE_RESPONSES["models"])
    async def list_models():
        return JSONResponse(ModelList(data=[model_card(), *models.lora_cards(created, max_model_len)]).model_dump())

    @app.get("/v1/models/{model_id:path}", response_model=api_docs.ModelCard, responses=api_docs.ROUTE_RESPONSES["model"])
    async def retrieve_model(model_id: str):
        lora_card = next((c for c in models.lora_cards(created, max_model_len) if c.id == model_id), None)
        if lora_card is not None:
            return JSONResponse(lora_card.model_dump())
        if model_id != served:
            return error_response(OpenAIError(404, f"The model `{model_id}` does not exist.", param="model",
                                              code="model_not_found"))
        return JSONResponse(model_card().model_dump())

    add_lora_routes(app, models, guarded)

    # ------------------------------------------------------------------------------ utilities
    @app.post("/tokenize", response_model=api_docs.TokenizeResponse, responses=api_docs.ROUTE_RESPONSES["tokenize"])
    async def tokenize(req: TokenizeRequest):
        async def run():
            base.check_model(req.model)
            if req.prompt is not None:  # the schema makes it exactly one of prompt / messages
                tokens = await base.encode(req.prompt, add_special_tokens=req.add_special_tokens
                                           if req.add_special_tokens is not None else True)
            else:
                _, tokens = await base.encode_chat(req.messages or [], req.add_generation_prompt,
                                                   req.continue_final_message, req.chat_template_kwargs,
                                                   add_special_tokens=bool(req.add_special_tokens))
            return JSONResponse(TokenizeResponse(tokens=tokens, count=len(tokens),
                                                 max_model_len=max_model_len).model_dump())
        return await guarded(run())

    # a whole sequence or the whole vocabulary, at least: transformers walks the list in Python, holding the GIL
    max_detokenize_tokens = max(max_model_len, config.model.vocab_size, DETOKENIZE_MIN_LIMIT)

    @app.post("/detokenize", response_model=api_docs.DetokenizeResponse, responses=api_docs.ROUTE_RESPONSES["detokenize"])
    async def detokenize(req: DetokenizeRequest):
        async def run():
            base.check_model(req.model)
            if len(req.tokens) > max_detokenize_tokens:
                raise OpenAIError(400, f"tokens: at most {max_detokenize_tokens} tokens can be detokenized at once, "
                                       f"got {len(req.tokens)}.", param="tokens", code="too_many_tokens")

            def decode() -> str:  # a thread: transformers' decode walks the list in Python first
                engine_client.input_processor.check_token_ids(req.tokens, "tokens")
                return base.tokenizer.decode(req.tokens)

            return JSONResponse(DetokenizeResponse(prompt=await asyncio.to_thread(decode)).model_dump())
        return await guarded(run())

    @app.get("/health", response_model=api_docs.HealthResponse, responses=api_docs.ROUTE_RESPONSES["health"])
    async def health():
        """200 only when the engine is ready (warmed up) and its loop alive and stepping; else 503."""
        state = engine_client.health()
        if state.healthy:
            return JSONResponse({"status": "ok"})
        return error_response(OpenAIError(503, f"Unhealthy ({state.status}): {state.message}.",
                                          code="service_unavailable"))

    @app.get("/version", response_model=api_docs.VersionResponse, responses=api_docs.ROUTE_RESPONSES["version"])
    async def version():
        from pagedserve import __version__

        return JSONResponse({"version": __version__})

    @app.get("/metrics", response_class=Response, responses=api_docs.ROUTE_RESPONSES["metrics"])
    async def metrics():
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    add_compat_routes(app, engine_client, health, create_completion, create_chat_completion)

    admin_api_key = arg("admin_api_key", None)
    hosts = HostCheck(arg("host", None), (arg("allowed_hosts", "") or "").split(","))
    add_live_event_routes(app, engine_client.events, lambda: engine_client.accepting, hosts, admin_api_key)

    # added last = outermost: the key is checked before the body-size layer lets anything be read
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=arg("max_request_body_bytes", DEFAULT_MAX_BODY_BYTES))
    api_key = arg("api_key", None)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, admin_api_key=admin_api_key)
    add_cors(app, args)
    return app


# --------------------------------------------------------------------------------------------- server
class GracefulServer(uvicorn.Server):
    """uvicorn.Server that, on SIGINT/SIGTERM, stops accepting, gives in-flight requests `grace` seconds,
    then ends the rest with an error chunk / 503, stops the engine thread and exits 0 without a traceback."""

    def __init__(self, config: uvicorn.Config, engine_client: EngineClient, grace: float) -> None:
        super().__init__(config)
        self.engine_client = engine_client
        self.grace = grace

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            logger.info("Received %s: draining (%.1f s for in-flight requests)", signal.Signals(sig).name, self.grace)
            self.engine_client.begin_drain()
            timer = threading.Timer(self.grace, self.engine_client.fail_all,
                                    [EngineShuttingDown("The server is shutting down.")])
            timer.daemon = True
            timer.start()
        else:  # second signal: end everything now
            self.engine_client.fail_all(EngineShuttingDown("The server is shutting down."))

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            age = process_age_s()
            logger.info("Port open: accepting requests %s", "" if age is None else f"{age:.2f} s after the process started")

    @contextlib.contextmanager
    def capture_signals(self):
        # Like uvicorn's, minus re-raising the signal afterwards (which prints a KeyboardInterrupt
        # traceback, or kills the process with SIGTERM, after an otherwise clean shutdown).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in originals.items():
                signal.signal(s, handler)


def run_server(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineArgs

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                         f"{', '.join(TOOL_CALL_PARSERS)}).")
    imports_s = process_age_s()  # the interpreter, the CLI and the server's imports, before any work
    engine_args = EngineArgs.from_cli_args(args)
    t0 = time.perf_counter()
    logger.info("Starting: loading the model, building/loading native kernels and warming up before binding "
                "%s:%d", args.host, args.port)
    async_llm = AsyncLLM.from_engine_args(engine_args, log_stats=not args.disable_log_stats,
                                          log_interval_s=args.log_stats_interval,
                                          max_queued_requests=args.max_queued_requests,
                                          max_consecutive_step_failures=args.max_consecutive_step_failures,
                                          step_timeout_s=args.step_timeout_s)
    stages = async_llm.engine.startup
    # The grammar engine's view of the vocabulary (0.1-0.2 s for 8k-49k tokens) is built now, not inside the first
    # constrained request's step, where it stalled every request of the batch.
    with stages.stage("structured output (llguidance)"):
        async_llm.engine.structured_output.ll_tokenizer
    with stages.stage("HTTP app"):
        app = build_app(async_llm, args)
    # Everything alive now lives as long as the server. Frozen, the collector never traverses it again: a full
    # collection over the ~300k objects of torch, transformers and the app took 80-250 ms, a stall of every stream
    # in the step it landed in (the p99 inter-token latency); afterwards it sees only the requests' own objects.
    with stages.stage("heap freeze"):
        gc.collect()
        gc.freeze()
    logger.info("Froze %d objects of the start-up heap (never collected again)", gc.get_freeze_count())
    imports = "" if imports_s is None else f"process start and imports {imports_s:.2f} s, "
    logger.info("Start-up stages: %s%s; total %.2f s", imports, stages.summary(),
                (imports_s or 0.0) + time.perf_counter() - t0)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=max(1.0, args.shutdown_timeout + 5.0),
                            timeout_keep_alive=5, **uvicorn_kwargs(args))
    server = GracefulServer(config, async_llm, args.shutdown_timeout)
    logger.info("Serving %s on http://%s:%d (OpenAI-compatible API under /v1)", app.state.served_model_name,
                args.host, args.port)
    try:
        server.run()
    except KeyboardInterrupt:  # pragma: no cover - a signal before uvicorn installed its handlers
        pass
    finally:
        async_llm.shutdown()
        # The process ends next: frozen, the interpreter's exit-time collections skip every object of torch,
        # transformers and the app (traversing them cost 3-4 s of CPU per shutdown on a 2-core machine, longer than
        # the rest of the shutdown); refcounting still frees them, and the engine is already shut down. Not where
        # triton is loaded: nanobind, its bindings, reports each object still alive at exit as a leak.
        if "triton" in sys.modules:
            gc.unfreeze()
        else:
            gc.freeze()
    return 0


def main(argv: list[str] | None = None) -> int:  # `python -m pagedserve.entrypoints.openai.api_server`
    parser = argparse.ArgumentParser(prog="pagedserve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
