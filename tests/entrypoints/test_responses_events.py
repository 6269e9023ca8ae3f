"""/v1/responses' translation of chat chunks into the Responses API's typed events (serving_responses.py), without
a server: reasoning, then content, then a tool call whose arguments stream in pieces. Every event and the final
Response validate against the installed openai SDK's own pydantic types, and the items rebuild the whole answer."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pydantic
import pytest

from pagedserve.entrypoints.openai.protocol import (ChatCompletionStreamChoice, ChatCompletionStreamResponse,
                                                    DeltaFunctionCall, DeltaMessage, DeltaToolCall, UsageInfo)
from pagedserve.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses, to_chat_request

openai_types = pytest.importorskip("openai.types.responses")


def chunk(delta: DeltaMessage, finish: str | None = None) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=delta, finish_reason=finish)])


async def chat_chunks():
    yield chunk(DeltaMessage(role="assistant", content=""))
    yield chunk(DeltaMessage(reasoning_content="let me "))
    yield chunk(DeltaMessage(reasoning_content="think"))
    yield chunk(DeltaMessage(content="Sure."))
    yield chunk(DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunctionCall(
        name="get_weather", arguments='{"city": '))]))
    yield chunk(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='"Paris"}'))]),
                finish="tool_calls")
    yield ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[],
                                       usage=UsageInfo(prompt_tokens=7, completion_tokens=9, total_tokens=16))


def test_stream_events_match_the_sdk_types_and_rebuild_the_answer():
    req = ResponsesRequest.model_validate({"input": "weather?", "stream": True, "tools": [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]})
    serving = OpenAIServingResponses(SimpleNamespace(served_model_name="m"))

    async def collect():
        return [part async for part in serving._events(req, "resp_1", 0, chat_chunks())]

    events = []
    for raw in asyncio.run(collect()):
        head, data = raw.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(pydantic.TypeAdapter(openai_types.ResponseStreamEvent).validate_python(event))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert isinstance(final, openai_types.Response) and final.status == "completed"
    reasoning, message, call = final.output
    assert reasoning.content[0].text == "let me think" and message.content[0].text == "Sure."
    assert (call.call_id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (7, 9, 16)


def test_input_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"instructions": "be brief", "max_output_tokens": 5, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"}],
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}})
    chat = to_chat_request(req)
    assert [(m.role, m.text()) for m in chat.messages] == [("system", "be brief"), ("user", "ab"), ("assistant", ""),
                                                           ("tool", "x")]
    assert [c.id for c in chat.messages[2].tool_calls] == ["c1", "c2"]  # consecutive calls: one assistant turn
    assert chat.max_tokens == 5 and chat.response_format.json_schema.schema_ == {"type": "object"}


def test_whole_response_body_matches_the_sdk_type():
    from pagedserve.entrypoints.openai.serving_responses import call_item, message_item, reasoning_item, usage_body

    req = ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 3, "metadata": {"k": "v"},
                                           "tool_choice": {"type": "function", "name": "f"},
                                           "tools": [{"type": "function", "name": "f"}]})
    serving = OpenAIServingResponses(SimpleNamespace(served_model_name="m"))
    body = serving.body(req, "resp_1", 0, [reasoning_item("rs_1", "r"), message_item("msg_1", "a"),
                                          call_item("fc_1", "call_1", "f", "{}")], "length",
                        usage_body(UsageInfo(prompt_tokens=2, completion_tokens=3, total_tokens=5)))
    resp = openai_types.Response.model_validate(body)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "a" and resp.tool_choice.name == "f" and resp.metadata == {"k": "v"}
