"""The reasoning parsers and their registry.

Each is a marker state machine over the detokenized text: [before] -> reasoning -> [between] -> content.
  qwen3:       `<think>...</think>` where the model writes `<think>` itself; text without it is content.
               chat_template_kwargs {"enable_thinking": false}: no reasoning expected, everything is content.
  deepseek_r1: the template opens `<think>` in the prompt: the answer starts in reasoning (an echoed `<think>` is
               dropped) until `</think>`.
  gpt_oss:     harmony channels: `<|channel|>analysis<|message|>` reasoning `<|end|>`, then everything up to
               `<|channel|>final<|message|>` is dropped; the final channel is content. The markers are special
               tokens: the server decodes with skip_special_tokens=false for this parser, as vLLM.
A marker split across deltas is held back until it is whole (or proven not to be one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BEFORE, REASONING, BETWEEN, CONTENT = "before", "reasoning", "between", "content"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class ReasoningSpec:
    start: str | None  # marker that opens reasoning (None: the answer starts in it)
    end: str  # marker that closes it
    content_start: str | None = None  # text after `end` up to this marker is dropped
    strip_leading_start: bool = False  # the answer may echo `start` although it starts in reasoning
    needs_special_tokens: bool = False  # markers are special tokens: decode them


REASONING_PARSERS: dict[str, ReasoningSpec] = {
    "qwen3": ReasoningSpec(start="<think>", end="</think>"),
    "deepseek_r1": ReasoningSpec(start=None, end="</think>", strip_leading_start=True),
    "gpt_oss": ReasoningSpec(start="<|channel|>analysis<|message|>", end="<|end|>",
                             content_start="<|channel|>final<|message|>", needs_special_tokens=True),
}
_ECHOED_START = "<think>"


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, spec: ReasoningSpec, thinking: bool = True) -> None:
        self.spec = spec
        self.thinking = thinking
        self.state = (REASONING if spec.start is None else BEFORE) if thinking else CONTENT
        self.buffer = ""
        self.at_start = spec.strip_leading_start and thinking

    def _marker(self) -> str | None:
        return {BEFORE: self.spec.start, REASONING: self.spec.end, BETWEEN: self.spec.content_start}.get(self.state)

    def _next_state(self) -> str:
        return {BEFORE: REASONING, REASONING: BETWEEN if self.spec.content_start else CONTENT,
                BETWEEN: CONTENT}[self.state]

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self.state == REASONING:
            out.reasoning += text
        elif self.state in (BEFORE, CONTENT):
            out.content += text  # BETWEEN: dropped

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        out = ReasoningDelta()
        self.buffer += text
        if self.at_start:
            if _ECHOED_START.startswith(self.buffer) and not final:
                return out  # may still become the echoed `<think>`
            if self.buffer.startswith(_ECHOED_START):
                self.buffer = self.buffer[len(_ECHOED_START):]
            self.at_start = False
        while (marker := self._marker()) is not None:
            at = self.buffer.find(marker)
            if at < 0:
                break
            self._emit(out, self.buffer[:at])
            self.buffer = self.buffer[at + len(marker):]
            self.state = self._next_state()
        marker = self._marker()
        keep = 0 if final or marker is None else _held_back(self.buffer, marker)
        self._emit(out, self.buffer[:len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return out

    def finish(self) -> ReasoningDelta:
        return self.feed("", final=True)

    def split(self, text: str) -> ReasoningDelta:
        """The whole answer at once (non-streamed responses): the same machine as the deltas."""
        out = self.feed(text)
        rest = self.finish()
        return ReasoningDelta(out.reasoning + rest.reasoning, out.content + rest.content)


def make_reasoning_parser(name: str | None, chat_template_kwargs: dict[str, Any] | None) -> ReasoningParser | None:
    """One parser per choice; None without --reasoning-parser. enable_thinking=false (Qwen3's template switch,
    also passed to the template) means the answer holds no reasoning."""
    if name is None:
        return None
    thinking = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
    return ReasoningParser(REASONING_PARSERS[name], thinking)
