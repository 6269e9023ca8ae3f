"""POST /v1/responses: OpenAI's Responses API on top of the chat path.

A Responses request becomes a chat request (instructions -> a system message, input items -> messages, function
tools -> chat tools, text.format -> response_format, max_output_tokens -> max_tokens), runs through
OpenAIServingChat.generate_chat (so tool calls, reasoning and structured output are parsed exactly as for
/v1/chat/completions), and its answer is written back as output items: `reasoning` (with --reasoning-parser),
`message` (output_text) and `function_call`.  Streamed, the chat chunks become the SDK's typed events
(response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta / .done, response.reasoning_text.delta / .done, response.function_call_arguments.delta
/ .done, response.content_part.done, response.output_item.done, response.completed or response.incomplete), each
`event: <type>` + `data: <json>` with a sequence_number; an engine failure mid-stream is an `error` event."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse

from pagedserve.entrypoints.openai.errors import OpenAIError, exception_to_openai, validation_error_to_openai
from pagedserve.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                    ChatCompletionStreamResponse, UsageInfo)
from pagedserve.entrypoints.openai.protocol_responses import (InputFunctionCall, InputMessage, ResponsesRequest)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_engine import SSEResponse
from pagedserve.errors import InvalidRequestError


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# chat's field -> the Responses field it came from, so that a 400 names what the client sent
_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, sep, rest = param.partition(".")
    head, bracket, index = head.partition("[")
    return _RESPONSES_PARAMS.get(head, head) + bracket + index + sep + rest


# ------------------------------------------------------------------------------------ request
def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    for item in [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, InputFunctionCall):  # consecutive calls are one assistant turn
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls,
        "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p, "user": req.user,
        "seed": req.seed, "top_k": req.top_k, "priority": req.priority, "cache_salt": req.cache_salt}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in req.tools]
    if req.tool_choice is not None:
        fields["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            exclude={"type"}, exclude_none=True, by_alias=True)}
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except pydantic.ValidationError as exc:
        err = validation_error_to_openai(list(exc.errors()), None)
        err.param = responses_param(err.param)
        raise err from None


# ----------------------------------------------------------------------------------- response
def usage_body(usage: UsageInfo | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, req: ResponsesRequest, raw_request: Request | None = None):
        chat_req = to_chat_request(req)
        response_id, created = _id("resp"), int(time.time())
        try:
            result = await self.chat.generate_chat(chat_req, raw_request)
        except (OpenAIError, InvalidRequestError) as exc:
            exc.param = responses_param(exc.param)
            raise
        if isinstance(result, ChatCompletionResponse):
            choice = result.choices[0]
            output = []
            if choice.message.reasoning_content:
                output.append(reasoning_item(_id("rs"), choice.message.reasoning_content))
            if choice.message.content or not choice.message.tool_calls:
                output.append(message_item(_id("msg"), choice.message.content or ""))
            output += [call_item(_id("fc"), c.id, c.function.name, c.function.arguments)
                       for c in choice.message.tool_calls]
            return JSONResponse(self.body(req, response_id, created, output, choice.finish_reason,
                                          usage_body(result.usage)))
        chunks, close = result
        return SSEResponse(self._events(req, response_id, created, chunks), on_close=close,
                           profile=self.chat.engine_client.profile)

    def body(self, req: ResponsesRequest, response_id: str, created: int, output: list[dict[str, Any]],
             finish_reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The Response object; finish_reason None: still in progress."""
        status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
        tool_choice = req.tool_choice if req.tool_choice is not None else "auto" if req.tools else "none"
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.chat.served_model_name, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or []],
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text
                                else {"type": "text"})},
            "metadata": req.metadata or {}, "store": False, "truncation": "disabled", "user": req.user,
            "previous_response_id": None, "reasoning": None, "usage": usage}

    async def _events(self, req: ResponsesRequest, response_id: str, created: int,
                      chunks: AsyncIterator[ChatCompletionStreamResponse]) -> AsyncIterator[str]:
        seq = 0
        output: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None  # the open output item
        calls: dict[int, dict[str, Any]] = {}  # the chat stream's tool-call index -> its item

        def event(type_: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {type_}\ndata: {json.dumps({'type': type_, 'sequence_number': seq - 1, **fields})}\n\n"

        def open_item(item: dict[str, Any]) -> list[str]:
            nonlocal current
            events = close_item()
            current = item
            output.append(item)
            index = len(output) - 1
            events.append(event("response.output_item.added", output_index=index, item=item))
            if item["type"] in ("reasoning", "message"):
                events.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part=part(item)))
            return events

        def part(item: dict[str, Any]) -> dict[str, Any]:
            return dict(item["content"][0])

        def close_item() -> list[str]:
            nonlocal current
            if current is None:
                return []
            item, index, current = current, len(output) - 1, None
            item["status"] = "completed"
            ids = {"item_id": item["id"], "output_index": index}
            if item["type"] == "function_call":
                events = [event("response.function_call_arguments.done", **ids, name=item["name"],
                                arguments=item["arguments"])]
            else:
                text = item["content"][0]["text"]
                events = [event("response.reasoning_text.done", **ids, content_index=0, text=text)
                          if item["type"] == "reasoning" else
                          event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[]),
                          event("response.content_part.done", **ids, content_index=0, part=part(item))]
            return events + [event("response.output_item.done", output_index=index, item=item)]

        def delta_text(kind: str, text: str) -> list[str]:
            events = [] if current is not None and current["type"] == kind else \
                open_item(reasoning_item(_id("rs"), "", "in_progress") if kind == "reasoning"
                          else message_item(_id("msg"), "", "in_progress"))
            current["content"][0]["text"] += text
            ids = {"item_id": current["id"], "output_index": len(output) - 1, "content_index": 0}
            if kind == "reasoning":
                return events + [event("response.reasoning_text.delta", **ids, delta=text)]
            return events + [event("response.output_text.delta", **ids, delta=text, logprobs=[])]

        in_progress = self.body(req, response_id, created, [], None, None)
        for line in (event("response.created", response=in_progress),
                     event("response.in_progress", response=in_progress)):
            yield line
        finish_reason, usage = None, None
        try:
            async for chunk in chunks:
                if chunk.usage is not None and not chunk.choices:
                    usage = chunk.usage
                for choice in chunk.choices:
                    d = choice.delta
                    events: list[str] = []
                    if d.reasoning_content:
                        events += delta_text("reasoning", d.reasoning_content)
                    if d.content:
                        events += delta_text("message", d.content)
                    for tc in d.tool_calls or []:
                        if tc.index not in calls:
                            calls[tc.index] = call_item(_id("fc"), tc.id or "", tc.function.name or "", "",
                                                        "in_progress")
                            events += open_item(calls[tc.index])
                        if tc.function is not None and tc.function.arguments:
                            calls[tc.index]["arguments"] += tc.function.arguments
                            events.append(event("response.function_call_arguments.delta",
                                                item_id=calls[tc.index]["id"], output_index=output.index(
                                                    calls[tc.index]), delta=tc.function.arguments))
                    finish_reason = choice.finish_reason or finish_reason
                    for line in events:
                        yield line
            if not output:  # an empty answer is still one (empty) message, as in the non-streamed response
                for line in open_item(message_item(_id("msg"), "", "in_progress")):
                    yield line
            for line in close_item():
                yield line
            final = self.body(req, response_id, created, output, finish_reason or "stop", usage_body(usage))
            yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                        response=final)
        except Exception as exc:  # the engine failed the request or the server is shutting down
            err = exception_to_openai(exc)
            body = err.body()["error"]
            yield event("error", code=body.get("code"), message=body["message"], param=body.get("param"))
        finally:
            await chunks.aclose()
