"""Tool calling: what a request's tools and tool_choice ask of the engine, and how output becomes tool calls.

- `tool_choice` "required" or a named function: the output is grammar-constrained to the functions' JSON
  schemas (through structured output, compact JSON), so a call always parses and its arguments always validate.
  Named: the output *is* the arguments object. Required: a JSON array of {"name", "parameters"} objects
  (one item unless parallel_tool_calls).
- "auto" (needs `--enable-auto-tool-choice --tool-call-parser NAME`, as in vLLM): the model writes freely in
  its own format and a parser finds the calls: `hermes` (Hermes / Qwen `<tool_call>{...}</tool_call>`),
  `llama3_json` (Llama 3: the whole reply is `{"name": ..., "parameters": ...}`, calls separated by `;`),
  `mistral` (`[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, ResponseFunctionCall, ResponseToolCall
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""
    mode: str  # none | auto | required | named
    constraint: StructuredOutputsParams | None = None
    function_name: str | None = None  # named


def plan_tools(req: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    choice = req.tool_choice
    tools = req.tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("none")
    if not tools:
        raise InvalidRequestError("tool_choice needs tools.", param="tool_choice")
    by_name = {t.function.name: t.function for t in tools}
    if choice == "auto":
        if parser is None:
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                                      '--tool-call-parser to be set.', param="tool_choice")
        return ToolPlan("auto")
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": fn.parameters or _ANY_OBJECT},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, fn in by_name.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan("required", StructuredOutputsParams(json=schema, disable_any_whitespace=True, source="tools"))
    name = choice.function.name
    if name not in by_name:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools.", param="tool_choice")
    return ToolPlan("named", StructuredOutputsParams(json=by_name[name].parameters or _ANY_OBJECT,
                                                     disable_any_whitespace=True, source="tools"),
                    function_name=name)


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools in the form chat templates take (transformers' apply_chat_template(tools=...))."""
    if not req.tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in req.tools]


def template_message(m: Any) -> dict[str, Any]:
    """A request message as a chat template reads it (tool calls with their arguments as objects)."""
    item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        item["name"] = m.name
    if m.tool_call_id is not None:
        item["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        item["tool_calls"] = [{"id": c.id, "type": "function",
                               "function": {"name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}}
                              for c in m.tool_calls]
    return item


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call(name: str, arguments: Any) -> ResponseToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ResponseToolCall(id=new_call_id(), function=ResponseFunctionCall(name=name, arguments=args))


def extract_tool_calls(plan: ToolPlan, text: str, parser: str | None) -> tuple[str | None, list[ResponseToolCall]]:
    """-> (remaining content, tool calls) of a finished output."""
    if plan.mode == "named":
        return None, [_call(plan.function_name or "", text)]
    if plan.mode == "required":
        try:
            return None, [_call(item["name"], item["parameters"]) for item in json.loads(text)]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens: no complete call
            return text, []
    if plan.mode == "auto" and parser is not None:
        return PARSERS[parser](text)
    return text, []


def _parse_hermes(text: str) -> tuple[str | None, list[ResponseToolCall]]:
    calls, spans = [], []
    for match in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL):
        try:
            obj = json.loads(match.group(1))
            calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
            spans.append(match.span())
        except (ValueError, TypeError, KeyError):
            continue
    for start, end in reversed(spans):
        text = text[:start] + text[end:]
    return (text.strip() or None) if calls else text, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ResponseToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>")
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        try:
            obj = json.loads(part)
            calls.append(_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        except (ValueError, TypeError, KeyError):
            return text, []
    return None, calls


def _parse_mistral(text: str) -> tuple[str | None, list[ResponseToolCall]]:
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    try:
        calls = [_call(obj["name"], obj.get("arguments", {})) for obj in json.loads(tail.strip())]
    except (ValueError, TypeError, KeyError):
        return text, []
    return head.strip() or None, calls


PARSERS = {"hermes": _parse_hermes, "llama3_json": _parse_llama3_json, "mistral": _parse_mistral}
