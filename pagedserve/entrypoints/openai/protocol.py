"""Pydantic models for the OpenAI-compatible API (request shapes follow OpenAI, extras follow vLLM).

Every request model forbids unknown fields: a field this server does not implement (tools,
response_format, logit_bias, suffix, ...) is rejected with a 400 that names it instead of being
silently ignored.  Types are strict (no "1" -> 1 coercion; ints are accepted where floats are).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer


from pagedserve.sampling_params import MAX_LOGPROBS, MAX_N

# Seeds are passed to torch generators: keep them in the signed 64-bit range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
NonNegInt = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


def random_uuid() -> str:
    return uuid.uuid4().hex


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM extra: a usage object on every chunk, not only at the end.
    continuous_usage_stats: bool = False


StopType = Optional[Union[str, list[str]]]


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopType = None
    seed: Optional[int] = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # ---- extras (vLLM names)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0)
    priority: int = 0
    cache_salt: Optional[str] = None
    stop_token_ids: Optional[list[NonNegInt]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: StopType) -> StopType:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _check_salt(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and v == "":
            raise ValueError("cache_salt must be a non-empty string")
        return v


# ---------------------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # Accepted only when it equals n (returning the best n of best_of samples is not implemented).
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionResponseChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ----------------------------------------------------------------------------------------------- chat
class ChatTextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ChatTextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # ---- extras (vLLM names)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


class ChatLogProb(_Response):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(_Response):
    content: Optional[list[ChatLogProbsContent]] = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionResponseChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # OpenAI sends {"content": "..."} and a final {}, not nulls
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ------------------------------------------------------------------------------------------ utilities
class TokenizeRequest(_Request):
    """Either `prompt` (completion style) or `messages` (chat template applied)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[NonNegInt]


class DetokenizeResponse(_Response):
    prompt: str


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
