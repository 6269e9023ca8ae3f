"""The common streamed chunks as pre-rendered JSON: no pydantic model per token.

A streamed request sends one chunk per new token; nearly all of them hold only new text (and, last, a finish
reason). Building `CompletionStreamResponse(...)` and `model_dump_json()` for each took ~16-20 us of the event loop's
time (validation of four nested models, then serialization); here the part that never changes within a stream (id,
object, created, model, up to the choice's index) is rendered once, and each chunk only JSON-escapes its text
(the json module's C encoder). The bytes are those `model_dump_json()` gives (tests/entrypoints/test_sse.py
checks): no ASCII escaping, no spaces, every field in the models' order, nulls kept except in a chat delta.
Chunks with logprobs, usage, prompt logprobs, reasoning or tool calls still go through the models.
"""
from __future__ import annotations

import json

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class StreamChunkEncoder:
    """`data: {...}\\n\\n` for one stream's text-only chunks (object "text_completion" or "chat.completion.chunk")."""

    def __init__(self, object_type: str, request_id: str, created: int, model: str) -> None:
        head = _dumps({"id": request_id, "object": object_type, "created": created, "model": model})
        self._head = "data: " + head[:-1] + ',"choices":[{"index":'

    def completion(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        """A CompletionStreamResponse with one choice and no logprobs or usage."""
        return (f'{self._head}{index},"text":{_dumps(text)},"logprobs":null,"finish_reason":{_dumps(finish_reason)},'
                f'"stop_reason":{_dumps(stop_reason)}}}],"usage":null}}\n\n')

    def chat(self, index: int, content: str | None, finish_reason: str | None, stop_reason: int | str | None) -> str:
        """A ChatCompletionStreamResponse with one choice whose delta holds only content (or nothing)."""
        delta = "{}" if content is None else f'{{"content":{_dumps(content)}}}'
        return (f'{self._head}{index},"delta":{delta},"logprobs":null,"finish_reason":{_dumps(finish_reason)},'
                f'"stop_reason":{_dumps(stop_reason)}}}],"usage":null}}\n\n')
