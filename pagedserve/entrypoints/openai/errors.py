"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server reports goes through `error_response`, so clients (the official `openai`
package included) always see the same body shape.  Bad input is a 4xx, never a 500:

* `RequestValidationError` (invalid JSON, wrong types, out-of-range values, unknown fields) -> 400 with
  `param` naming the offending field (FastAPI's default would be a 422 with its own body).
* `ValueError` raised by `SamplingParams` or `LLMEngine.add_request` -> 400.
* unknown model -> 404, bad/missing API key -> 401, unknown route -> 404, wrong method -> 405.
* a failure inside the engine for one request -> 500 for that request only; shutting down -> 503.
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

from pagedserve.engine.async_llm import EngineDeadError, EngineRequestError, EngineShuttingDown

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
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
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
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


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
    return text in _UNION_TAGS or "[" in text or "(" in text or text.startswith(("function-", "lax-", "strict-"))


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


def validation_error_to_openai(errors: list[dict[str, Any]]) -> OpenAIError:
    if not errors:
        return BadRequest("Invalid request.")
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
    # A union field (e.g. `prompt`) yields one error per alternative: report them together.
    top = param.split(".")[0].split("[")[0] if param else None
    same = [e for e in errors if (loc_to_param(e.get("loc", ())) or "").split(".")[0].split("[")[0] == top]
    msgs: list[str] = []
    for e in same:
        msg = str(e.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if msg not in msgs:
            msgs.append(msg)
    message = "; ".join(msgs[:4])
    if param:
        message = f"Invalid value for '{param}': {message}"
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return BadRequest(message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error_to_openai(list(exc.errors())))

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
        return error_response(OpenAIError(status, message, code=code))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(BadRequest(str(exc)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        err = exception_to_openai(exc)
        if err.status_code >= 500 and not isinstance(exc, (EngineShuttingDown, EngineDeadError, EngineRequestError)):
            logger.exception("Unhandled error in request handler")
        return error_response(err)
