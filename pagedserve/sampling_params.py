"""User-facing sampling and beam-search parameters (names follow vLLM)."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from pagedserve.errors import InvalidRequestError


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all tokens/text so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


# Above this many samples per request the KV pool is better spent on other requests.
MAX_N = 128
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs; the engine's own is EngineArgs.max_logprobs


@dataclass
class StructuredOutputsParams:
    """Constrain the output, as in vLLM: exactly one of a JSON schema, a regex, a list of choices, a grammar
    (Lark / EBNF, llguidance's syntax) or any JSON object."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: compact separators only, no free whitespace (vLLM's name)
    # The request field the constraint came from (errors name it): structured_outputs, response_format, ...
    source: str = "structured_outputs"
    # The grammar applies only after the output contains these tokens (with --reasoning-parser: the end of the
    # thinking, as vLLM applies structured output after the reasoning ends); None: from the first token.
    start_after_token_ids: tuple[int, ...] | None = None

    def param(self, kind: str | None = None) -> str:
        return f"{self.source}.{kind}" if self.source == "structured_outputs" and kind else self.source

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(f"{self.source} needs exactly one of json, regex, choice, grammar, "
                                      f"json_object; got {given or 'none'}.", param=self.source)
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise InvalidRequestError(f"{self.param('json')}: not valid JSON: {exc}",
                                          param=self.param("json")) from exc
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError(f"{self.param('json')} must be a JSON schema object.", param=self.param("json"))
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise InvalidRequestError(f"{self.param('choice')} must be a non-empty list of non-empty strings.",
                                      param=self.param("choice"))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{self.param(name)} must be a non-empty string.", param=self.param(name))

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"

    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint (the grammar cache key)."""
        value: Any = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text + ("\0compact" if self.disable_any_whitespace else "")



@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one always included)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (no text, no decoded logprob tokens), as in vLLM
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Token controls (vLLM's names; applied by model_executor/token_controls.py). logit_bias: token id -> bias
    # added to its logit, OpenAI's [-100, 100] (keys may be strings of ids, as JSON sends them).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never generate these words (tokenized by the InputProcessor)
    bad_words_token_ids: list[list[int]] | None = None  # set by the InputProcessor from bad_words
    # Per prompt token (after the first): its logprob and the top-N, computed in the prefill's forward. A request
    # asking for them bypasses prefix-cache hits (a cached prefix has no logits), as in vLLM.
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len - 1)

    def __post_init__(self) -> None:
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        """Checks that need no engine: ranges and types. The engine's InputProcessor checks the rest
        (token ids against the vocabulary, lengths, limits)."""
        def bad(name: str, value: object, limit: str) -> InvalidRequestError:
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            return InvalidRequestError(f"{name} must be {limit}, got {shown}.", param=name)

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"an integer in [1, {MAX_N}]")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "greater than 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "a non-negative integer")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", self.prompt_logprobs, "a non-negative integer")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
                or not (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)):
            raise bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "-1 or an integer >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if self.stop and not self.detokenize:
            raise bad("stop", self.stop, "empty with detokenize=False (stop strings are matched in the text)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative integers")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of non-negative integers")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", self.bad_words, "a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def truncates(self) -> bool:
        """Random sampling cut to top-k / top-p / min-p: which tokens survive depends on the whole distribution."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _logit_bias(bias: object) -> dict[int, float]:
    """logit_bias with int keys (JSON sends "123") and float values in OpenAI's [-100, 100]."""
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must be a map of token id to bias, got {type(bias).__name__}.",
                                  param="logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if isinstance(key, bool) or token < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}.",
                                      param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value!r} for {key!r}.",
                                      param="logit_bias")
        out[token] = float(value)
    return out


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    temperature: float = 0.0  # beam search here is deterministic

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be a positive integer, got {self.beam_width!r}.",
                                      param="beam_width")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.",
                                      param="max_tokens")


