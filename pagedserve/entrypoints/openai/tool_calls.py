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
from dataclasses import dataclass, field
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


# ---------------------------------------------------------------------------------------------- output -> calls
@dataclass
class CallDelta:
    """A piece of one tool call: its first piece carries the id and the name."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCallDeltas:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: "ToolCallDeltas") -> "ToolCallDeltas":
        self.content += other.content
        self.calls += other.calls
        return self


class ToolCallParser:
    """Turns one choice's text into content and tool calls as the text grows: feed() each new piece, finish() at
    the end. The non-streamed answer runs the same parser over the whole text, so the streamed deltas always
    reassemble to it. This base class is the plain-text case (no tools, or tool_choice "none")."""

    def __init__(self) -> None:
        self.buffer = ""
        self.num_calls = 0

    def feed(self, text: str) -> ToolCallDeltas:
        self.buffer += text
        return self._scan()

    def finish(self) -> ToolCallDeltas:
        return self._flush()

    def _scan(self) -> ToolCallDeltas:
        out = ToolCallDeltas(content=self.buffer)
        self.buffer = ""
        return out

    def _flush(self) -> ToolCallDeltas:
        return self._scan()

    def _start_call(self, out: ToolCallDeltas, name: str, arguments: str = "") -> None:
        out.calls.append(CallDelta(self.num_calls, arguments, new_call_id(), name))
        self.num_calls += 1

    def _add_arguments(self, out: ToolCallDeltas, arguments: str) -> None:
        if arguments:
            out.calls.append(CallDelta(self.num_calls - 1, arguments))


class NamedCallParser(ToolCallParser):
    """tool_choice names a function: the whole (grammar-constrained) output is its arguments, streamed as is."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _scan(self) -> ToolCallDeltas:
        out = ToolCallDeltas()
        if self.num_calls == 0:
            self._start_call(out, self.name, self.buffer)
        else:
            self._add_arguments(out, self.buffer)
        self.buffer = ""
        return out


_REQUIRED_ITEM_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"parameters":')


class RequiredCallsParser(ToolCallParser):
    """tool_choice "required": the output is grammar-constrained compact JSON, `[{"name":N,"parameters":{...}},
    ...]`. A call starts as soon as its name is complete; its arguments stream as their raw JSON text."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""  # all of it: content if no call ever starts
        self.state = "open"  # open -> item -> args -> close -> item ... -> done
        self.depth = 0
        self.in_string = self.escaped = False

    def feed(self, text: str) -> ToolCallDeltas:
        self.text += text
        return super().feed(text)

    def _scan(self) -> ToolCallDeltas:
        out = ToolCallDeltas()
        pos, text = 0, self.buffer
        while pos < len(text) and self.state != "done":
            if self.state == "args":
                end = self._args_end(text, pos)
                self._add_arguments(out, text[pos:end])
                pos = end
                if self.depth == 0:
                    self.state = "close"
            elif self.state == "item" and text[pos] == "{":
                head = _REQUIRED_ITEM_HEAD.match(text, pos)
                if head is None:
                    break  # the head is still incomplete
                self._start_call(out, json.loads(head.group(1)))
                self.state, pos = "args", head.end()
            else:  # "[" opens, "," separates, "}" closes an item, "]" ends
                self.state = {"]": "done", "}": "item"}.get(text[pos], "item")
                pos += 1
        self.buffer = text[pos:]
        return out

    def _args_end(self, text: str, pos: int) -> int:
        """Where the arguments value ends in text[pos:] (len(text) if it goes on), tracking JSON nesting."""
        for i in range(pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(text)

    def _flush(self) -> ToolCallDeltas:
        # Cut short (max_tokens) before any call started: what there is stays content.
        out = ToolCallDeltas(content=self.text if self.num_calls == 0 else "")
        self.buffer = ""
        return out


class _MarkedCallsParser(ToolCallParser):
    """Formats whose calls follow a marker in free text: the text before streams as content (held back only
    while it could be the start of the marker); whitespace next to a call is dropped."""
    marker = ""

    def __init__(self) -> None:
        super().__init__()
        self.in_calls = False
        self.pending_space = ""  # trailing whitespace: content only if more content follows
        self.content_started = False

    def _content(self, out: ToolCallDeltas, text: str) -> None:
        body = text.rstrip()
        trailing = text[len(body):]
        if body:
            body = self.pending_space + body
            if self.num_calls and not self.content_started:
                body = body.lstrip()  # the content starts after a call: no leading space
            out.content += body
            self.pending_space, self.content_started = "", True
        self.pending_space += trailing

    def _scan(self) -> ToolCallDeltas:
        out = ToolCallDeltas()
        while True:
            if self.in_calls:
                if not self._scan_calls(out):
                    return out
                continue
            at = self.buffer.find(self.marker)
            if at < 0:
                keep = _partial_marker_length(self.buffer, self.marker)
                self._content(out, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            self._content(out, self.buffer[:at])
            self.buffer, self.in_calls = self.buffer[at + len(self.marker):], True

    def _scan_calls(self, out: ToolCallDeltas) -> bool:
        """Consume calls from the buffer (after the marker); True when back in text."""
        return False

    def _calls_complete(self, out: ToolCallDeltas, body: str, items: Any) -> None:
        """Emit whole calls from a parsed body, or the marker and body as content if they are not calls."""
        calls = _named_calls(items, ("arguments", "parameters"))
        if calls is None:
            self._content(out, self.marker + body)
            return
        for name, arguments in calls:
            self._start_call(out, name, arguments)

    def _flush(self) -> ToolCallDeltas:
        out = ToolCallDeltas()
        if self.in_calls:
            self._unterminated(out)
        else:
            self._content(out, self.buffer)
        self.buffer = ""
        if not self.num_calls:
            out.content += self.pending_space
        return out

    def _unterminated(self, out: ToolCallDeltas) -> None:
        self._content(out, self.marker + self.buffer)


def _partial_marker_length(text: str, marker: str) -> int:
    """The longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _named_calls(items: Any, argument_keys: tuple[str, str]) -> list[tuple[str, str]] | None:
    """(name, arguments as JSON text) of each parsed call object, the first of argument_keys present holding its
    arguments; None if any item is not such an object (then the text is content, not calls)."""
    try:
        return [(item["name"], _arguments_text(next((item[k] for k in argument_keys if k in item), {})))
                for item in items]
    except (TypeError, KeyError):
        return None


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class HermesParser(_MarkedCallsParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, each call whole once closed."""
    marker, end_marker = "<tool_call>", "</tool_call>"

    def _scan_calls(self, out: ToolCallDeltas) -> bool:
        at = self.buffer.find(self.end_marker)
        if at < 0:
            return False
        body, self.buffer, self.in_calls = self.buffer[:at], self.buffer[at + len(self.end_marker):], False
        obj = _json_or_none(body.strip())
        if isinstance(obj, dict):
            self._calls_complete(out, body, [obj])
        else:
            self._content(out, self.marker + body + self.end_marker)
        return True


class MistralParser(_MarkedCallsParser):
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` to the end of the output."""
    marker = "[TOOL_CALLS]"

    def _unterminated(self, out: ToolCallDeltas) -> None:
        items = _json_or_none(self.buffer.strip())
        self._calls_complete(out, self.buffer, items if isinstance(items, list) else None)


class Llama3JsonParser(ToolCallParser):
    """Llama 3: the whole reply is `{"name": ..., "parameters": ...}` (calls separated by ";"), optionally after
    `<|python_tag|>`. Decided by the first non-space characters: a reply that starts as JSON is held to the
    end and becomes calls (or, if it does not parse as calls, content); any other reply streams as content."""
    python_tag = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.mode = "undecided"  # -> "text" | "json"

    def _scan(self) -> ToolCallDeltas:
        if self.mode == "undecided":
            head = self.buffer.lstrip()
            if not head or self.python_tag.startswith(head):
                return ToolCallDeltas()
            self.mode = "json" if head.startswith(("{", self.python_tag)) else "text"
        if self.mode == "json":
            return ToolCallDeltas()
        return super()._scan()

    def _flush(self) -> ToolCallDeltas:
        if self.mode != "json":
            return super()._scan()
        out = ToolCallDeltas()
        parts = [_json_or_none(part) for part in self.buffer.strip().removeprefix(self.python_tag).split(";")]
        calls = _named_calls(parts, ("parameters", "arguments"))
        if calls is None:
            out.content = self.buffer
        for name, arguments in calls or []:
            self._start_call(out, name, arguments)
        self.buffer = ""
        return out


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def make_tool_call_parser(plan: ToolPlan, parser: str | None) -> ToolCallParser:
    if plan.mode == "named":
        return NamedCallParser(plan.function_name or "")
    if plan.mode == "required":
        return RequiredCallsParser()
    if plan.mode == "auto" and parser is not None:
        return PARSERS[parser]()
    return ToolCallParser()


def extract_tool_calls(plan: ToolPlan, text: str, parser: str | None) -> tuple[str | None, list[ResponseToolCall]]:
    """-> (content, tool calls) of a finished output: the streamed parser run over the whole text."""
    tool_parser = make_tool_call_parser(plan, parser)
    deltas = tool_parser.feed(text)
    deltas += tool_parser.finish()
    return assemble(deltas)


def assemble(deltas: ToolCallDeltas) -> tuple[str | None, list[ResponseToolCall]]:
    calls: list[ResponseToolCall] = []
    for piece in deltas.calls:
        if piece.id is not None:
            calls.append(ResponseToolCall(id=piece.id, function=ResponseFunctionCall(name=piece.name or "",
                                                                                     arguments=piece.arguments)))
        else:
            calls[piece.index].function.arguments += piece.arguments
    if not calls:
        return deltas.content, []
    return deltas.content or None, calls
