"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server reports goes through `error_response`, so clients (the official `openai`
package included) always see the same body shape.  Bad input is a 4xx, never a 500:

* `RequestValidationError` (invalid JSON, wrong types, out-of-range values, unknown fields) -> 400 with
  `param` naming the offending field (FastAPI's default would be a 422 with its own body).
* `InvalidRequestError` (the engine's InputProcessor / SamplingParams) -> 400 with its param and code.
* `QueueFullError` (the waiting queue is at --max-queued-requests) -> 429 with Retry-After.
* `EngineRequestError` -> 500 for that request only; `EngineShuttingDown` / `EngineDeadError` -> 503.
* unknown model -> 404, bad/missing API key -> 401, unknown route -> 404, wrong method -> 405 with `Allow`.

`install_error_handlers` also makes /openapi.json say so: FastAPI's default 422 (never sent: validation
errors are 400s) is dropped from every operation; protocol.ROUTE_RESPONSES documents what is sent.
"""
from __future__ import annotations

import http
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.errors import (EngineDeadError, EngineRequestError, EngineShuttingDown, InvalidRequestError,
                               QueueFullError)
from pagedserve.entrypoints.openai.protocol import TOKENIZE_VARIANTS

logger = logging.getLogger("pagedserve.api")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    """Raise anywhere in a handler; the app turns it into an OpenAI error response."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(OpenAIError):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = "invalid_value") -> None:
        super().__init__(400, message, param=param, code=code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: OpenAIError) -> JSONResponse:
    headers = dict(exc.headers or {})
    if exc.status_code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers or None)


def sse_error(exc: BaseException) -> str:
    """An error inside an SSE stream (the status line has already been sent as 200)."""
    if isinstance(exc, OpenAIError):
        body = exc.body()
    elif isinstance(exc, EngineShuttingDown):
        body = error_body(str(exc) or "The server is shutting down.", "server_error", None, "service_unavailable")
    else:
        body = error_body(str(exc) or type(exc).__name__, "server_error", None, "internal_error")
    return f"data: {json.dumps(body)}\n\n"


def exception_to_openai(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return BadRequest(exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, ValueError):
        return BadRequest(str(exc))
    if isinstance(exc, EngineShuttingDown):
        return OpenAIError(503, str(exc) or "The server is shutting down.", code="service_unavailable")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc) or "The engine is not running.", code="engine_dead")
    if isinstance(exc, EngineRequestError):
        return OpenAIError(500, f"The engine failed this request: {exc}", code="internal_error")
    return OpenAIError(500, f"Internal server error: {type(exc).__name__}: {exc}", code="internal_error")


# ------------------------------------------------------------------------------------------ validation
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before",
               "function-wrap", "function-plain", "tagged-union", "literal", "is-instance"}


def _is_tag(part: Any) -> bool:
    if isinstance(part, int):
        return False
    text = str(part)
    return text in _UNION_TAGS or "[" in text or "(" in text or \
        text.startswith(("function-", "lax-", "strict-", "constrained-"))


def _alternative(loc: tuple | list) -> Any:
    """The union alternative an error belongs to (the first tag in its location), or None."""
    for part in loc:
        if _is_tag(part):
            return part
    return None


def _best_alternative(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Errors of one union field: keep the alternative the input was meant for (the one whose errors are
    about values, not types: `["ok", ""]` is a list of strings with an empty one, not a bad token list)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for e in errors:
        groups.setdefault(_alternative(e.get("loc", ())), []).append(e)
    if len(groups) < 2:
        return errors
    for group in groups.values():
        if all(not str(e.get("type", "")).endswith("_type") for e in group):
            return group
    return errors


def _tokenize_union(errors: list[dict[str, Any]], body: Any) -> list[dict[str, Any]] | OpenAIError:
    """/tokenize's body is a union of two models: pick the variant the body chose by its key field."""
    if not isinstance(body, dict):
        return BadRequest("The request body must be a JSON object.", code="invalid_type")
    chosen = [name for name, key in TOKENIZE_VARIANTS.items() if key in body]
    if len(chosen) != 1:
        keys = " or ".join(f"'{k}'" for k in TOKENIZE_VARIANTS.values())
        return BadRequest(f"Send exactly one of {keys}.", param=None if chosen else "prompt",
                          code="missing_required_parameter" if not chosen else "invalid_value")
    kept = []
    for e in errors:
        loc = list(e.get("loc", ()))
        i = 1 if loc and loc[0] == "body" else 0
        if len(loc) > i and loc[i] == chosen[0]:
            kept.append({**e, "loc": tuple(loc[:i] + loc[i + 1:])})
    return kept or errors


def _describe(e: dict[str, Any]) -> str:
    kind = str(e.get("type", ""))
    min_length = (e.get("ctx") or {}).get("min_length")
    if kind in ("string_too_short", "too_short") and min_length == 1:
        return "must not be empty" + (" (at least one item is required)" if kind == "too_short" else "")
    msg = str(e.get("msg", "invalid value"))
    return msg[len("Value error, "):] if msg.startswith("Value error, ") else msg


def loc_to_param(loc: tuple | list) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; union tags are dropped."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for part in parts:
        if _is_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def validation_error_to_openai(errors: list[dict[str, Any]], body: Any = None) -> OpenAIError:
    if not errors:
        return BadRequest("Invalid request.")
    if any(_loc_head(e) in TOKENIZE_VARIANTS for e in errors):
        picked = _tokenize_union(errors, body)
        if isinstance(picked, OpenAIError):
            return picked
        errors = picked
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return BadRequest(f"Invalid JSON body{': ' + str(detail) if detail else ''}.", code="invalid_json")
    param = loc_to_param(first.get("loc", ()))
    if kind == "extra_forbidden":
        return BadRequest(f"Unsupported parameter: '{param}' is not supported by this server.", param=param,
                          code="unsupported_parameter")
    if kind == "missing":
        if param is None:
            return BadRequest("The request body is missing (expected a JSON object).", code="missing_body")
        return BadRequest(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        return BadRequest("The request body must be a JSON object.", code="invalid_type")
    # A union field (e.g. `prompt`) yields one error per alternative: keep the alternative the input
    # was meant for; if none fits (a type error in each), report them together.
    top = param.split(".")[0].split("[")[0] if param else None
    same = _best_alternative([e for e in errors
                              if (loc_to_param(e.get("loc", ())) or "").split(".")[0].split("[")[0] == top])
    first = same[0] if same else first
    kind = str(first.get("type", ""))
    if len({_alternative(e.get("loc", ())) for e in same}) == 1:
        param = loc_to_param(first.get("loc", ()))
        same = [first]
    # Like the handlers: a batch of one prompt is reported as `prompt`, not `prompt[0]`.
    if param == "prompt[0]" and isinstance(body, dict) and isinstance(body.get("prompt"), list) \
            and len(body["prompt"]) == 1:
        param = "prompt"
    msgs: list[str] = []
    for e in same:
        msg = _describe(e)
        if msg not in msgs:
            msgs.append(msg)
    message = "; ".join(msgs[:4])
    if param:
        message = f"Invalid value for '{param}': {message}"
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return BadRequest(message, param=param, code=code)


def _loc_head(e: dict[str, Any]) -> Any:
    loc = list(e.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    return loc[0] if loc else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error_to_openai(list(exc.errors()), getattr(exc, "body", None)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message, code = "Not found.", "not_found"
            if exc.detail and exc.detail != "Not Found":
                message = str(exc.detail)
        else:
            try:
                phrase = http.HTTPStatus(status).phrase
            except ValueError:
                phrase = "Error"
            message, code = str(exc.detail or phrase), None
        # e.g. 405's `Allow` (RFC 9110 requires it), 401's `WWW-Authenticate`
        return error_response(OpenAIError(status, message, code=code, headers=getattr(exc, "headers", None)))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(exception_to_openai(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        err = exception_to_openai(exc)
        if err.status_code >= 500 and not isinstance(exc, (EngineShuttingDown, EngineDeadError, EngineRequestError)):
            logger.exception("Unhandled error in request handler")
        return error_response(err)

    _document_errors(app)


def _document_errors(app: FastAPI) -> None:
    """/openapi.json: drop FastAPI's automatic 422 (validation errors are 400s here, documented per route
    by protocol.ROUTE_RESPONSES) and its HTTPValidationError schemas, which nothing returns."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()  # FastAPI caches it (and rebuilds it when routes change): this is idempotent
        for item in schema.get("paths", {}).values():
            for operation in item.values():
                if isinstance(operation, dict):
                    operation.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
