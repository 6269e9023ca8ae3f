"""The vLLM server plumbing people script against, with vLLM's names and behaviour (issue 53):

    --chat-template FILE|TEXT, --allowed-origins/--allowed-methods/--allowed-headers/--allow-credentials (CORS),
    --root-path, --ssl-keyfile/--ssl-certfile, --trust-remote-code (parsed, ignored: a log line),
    GET|POST /ping and POST /invocations (SageMaker), POST /reset_prefix_cache (PAGEDSERVE_SERVER_DEV_MODE=1).

--served-model-name (several names) and --gpu-memory-utilization are EngineArgs flags (config.py).
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedserve import envs
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.openai.errors import OpenAIError, error_response
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("pagedserve.api")

Handler = Callable[[Any, Request], Awaitable[Any]]


def add_compat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, as a file path or inline text, used instead of the tokenizer's")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for fields a request leaves unset: auto (the model's "
                        "generation_config.json), vllm (none), or a folder holding a generation_config.json")
    p.add_argument("--allowed-origins", type=json.loads, default=["*"], help='CORS origins, JSON list (vLLM)')
    p.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS methods, JSON list (vLLM)")
    p.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS headers, JSON list (vLLM)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--root-path", default=None,
                   help="the path prefix a reverse proxy serves this app under (ASGI root_path)")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (uvicorn)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (uvicorn)")


def load_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a path to an existing file is read; anything else is the template itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long inline template is no valid path
        pass
    if not any(c in value for c in "{%"):
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # what vLLM takes


def load_generation_defaults(value: str | None, model_dir: str | None) -> dict[str, Any]:
    """--generation-config -> {request field: default}, as vLLM: `vllm` none, `auto` the model's file, else the
    folder's. A missing file means no defaults."""
    if value in (None, "vllm"):
        return {}
    folder = model_dir if value == "auto" else value
    if folder is None or not (Path(folder) / "generation_config.json").is_file():
        if value != "auto":
            raise ValueError(f"--generation-config: no generation_config.json in {value!r}")
        return {}
    config = json.loads((Path(folder) / "generation_config.json").read_text())
    defaults = {k: config[k] for k in GENERATION_CONFIG_FIELDS if config.get(k) is not None}
    if defaults:
        logger.info("Sampling defaults from %s/generation_config.json: %s", folder, defaults)
    return defaults


def uvicorn_kwargs(args: Any) -> dict[str, Any]:
    """The uvicorn.Config arguments these flags set."""
    if getattr(args, "trust_remote_code", False):
        logger.info("--trust-remote-code is accepted and ignored: pagedserve runs its own model implementations, "
                    "never a checkpoint's Python code")
    kwargs: dict[str, Any] = {}
    if getattr(args, "root_path", None):
        kwargs["root_path"] = args.root_path
    if getattr(args, "ssl_keyfile", None) or getattr(args, "ssl_certfile", None):
        kwargs.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    return kwargs


def add_cors(app: FastAPI, args: Any) -> None:
    """starlette's CORSMiddleware, configured as vLLM's (its defaults allow every origin). Added after the
    API-key layer so it is outermost: preflights (OPTIONS) are answered without a key, as in vLLM."""
    from starlette.middleware.cors import CORSMiddleware

    if args is None:
        return
    app.add_middleware(CORSMiddleware, allow_origins=getattr(args, "allowed_origins", ["*"]),
                       allow_methods=getattr(args, "allowed_methods", ["*"]),
                       allow_headers=getattr(args, "allowed_headers", ["*"]),
                       allow_credentials=bool(getattr(args, "allow_credentials", False)))


def add_compat_routes(app: FastAPI, engine_client: EngineClient, health: Callable[[], Awaitable[Response]],
                      completion: Handler, chat: Handler) -> None:
    @app.get("/ping", include_in_schema=False)
    @app.post("/ping", include_in_schema=False)
    async def ping():
        """SageMaker's health check: /health's answer."""
        return await health()

    @app.post("/invocations", include_in_schema=False)  # its body is either schema: documented as those routes
    async def invocations(raw_request: Request):
        """SageMaker's single route, as vLLM's: a body with `messages` is a chat completion, with `prompt` a
        completion."""
        try:
            body = await raw_request.json()
        except ValueError:
            return error_response(OpenAIError(400, "The body is not valid JSON.", code="invalid_json"))
        if not isinstance(body, dict) or not ("messages" in body or "prompt" in body):
            return error_response(OpenAIError(400, "/invocations needs `messages` (chat) or `prompt` (completion).",
                                              param="messages", code="invalid_request"))
        kind, handler = (ChatCompletionRequest, chat) if "messages" in body else (CompletionRequest, completion)
        try:
            req = kind.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc
        return await handler(req, raw_request)

    if envs.PAGEDSERVE_SERVER_DEV_MODE:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            """Dev mode only (vLLM's VLLM_SERVER_DEV_MODE): forget every cached prefix. 200 when done; 409 while
            running requests hold blocks."""
            if await engine_client.reset_prefix_cache():
                return Response(status_code=200)
            return JSONResponse({"error": {"message": "Requests in flight hold cached blocks; retry when idle.",
                                           "type": "conflict", "code": "prefix_cache_busy"}}, status_code=409)
