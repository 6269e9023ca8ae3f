"""Typed errors of the engine boundary. The HTTP layer maps each to one status code; nothing parses messages.

| error | raised when | HTTP |
| --- | --- | --- |
| InvalidRequestError (a ValueError) | a request the engine will not run; names the parameter | 400 |
| QueueFullError | the waiting queue is at its limit (overload) | 429 + Retry-After |
| EngineRequestError | the engine failed this one request (a step raised while it ran) | 500 |
| RequestAborted | the request was aborted before it finished | (the stream just ends) |
| EngineShuttingDown | the server is draining / stopping | 503 |
| EngineDeadError | the engine loop is gone | 503 |
"""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad input: `param` names the offending field (OpenAI's `param`), `code` is a stable error code."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class QueueFullError(RuntimeError):
    """Backpressure: too many requests are waiting; try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineRequestError(RuntimeError):
    """The engine failed this one request (a step raised while it was scheduled)."""


class RequestAborted(EngineRequestError):
    """The request was aborted before it finished."""


class EngineShuttingDown(RuntimeError):
    """The server is shutting down; in-flight and new requests end with this."""


class EngineDeadError(RuntimeError):
    """The engine loop is gone (it cannot serve anything any more)."""
