"""Pydantic models for the OpenAI-compatible API (request shapes follow OpenAI, extras follow vLLM).

Every request model forbids unknown fields: a field this server does not implement (logit_bias,
suffix, functions, ...) is rejected with a 400 that names it instead of being
silently ignored.  Types are strict (no "1" -> 1 coercion; ints are accepted where floats are, and whole
floats such as 2.0 where ints are: JSON has one number type); NaN and Infinity are refused.

The models are also the published contract (/openapi.json): every constraint the server enforces on a
single field is written here as a schema constraint (non-empty prompt / messages / stop strings,
ranges), so that a request the schema calls valid is not rejected for its shape.  What a schema cannot
say (the prompt's length in tokens against max_model_len, token ids against the vocabulary, rules that
tie two fields together, the served model's name, per-server limits) is listed in `BUSINESS_RULES` and
documented as a 400/404 in `error_responses`.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer

from pagedserve.sampling_params import MAX_LOGPROBS, MAX_N

MAX_STOP_TOKEN_IDS = 1 << 16

# Seeds are passed to torch generators: keep them in the signed 64-bit range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1


def _whole_float_to_int(value: Any) -> Any:
    """JSON has one number type: 3.0 is the integer 3 (as JSON Schema says); 3.5 stays a type error."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**constraints: Any) -> Any:
    """An integer field: strict (no "3", no true) but a whole float such as 3.0 counts as 3.  The range
    sits inside (before the validator) so that the JSON schema shows it as minimum / maximum."""
    return Annotated[int, Field(**constraints), BeforeValidator(_whole_float_to_int)]


NonNegInt = Int(ge=0)
TokenId = Int(ge=0, description="a token id, in [0, vocab_size)")
NonEmptyStr = Annotated[str, Field(min_length=1)]
# A token-id prompt: at least one id.
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class _Request(BaseModel):
    # JSON has no NaN / Infinity (Python's parser still reads them, and 1e999 as inf): refuse them.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


def random_uuid() -> str:
    return uuid.uuid4().hex


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM extra: a usage object on every chunk, not only at the end.
    continuous_usage_stats: bool = False


# One stop string or a list of them; each non-empty (an empty list means "no stop strings").
StopType = Optional[Union[NonEmptyStr, list[NonEmptyStr]]]


class JsonSchemaFormat(_Request):
    name: NonEmptyStr = Field(max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="a JSON schema")
    strict: Optional[bool] = None

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(_Request):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(_Request):
    """vLLM's structured_outputs: exactly one constraint."""
    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json", description="a JSON schema")
    regex: Optional[NonEmptyStr] = None
    choice: Optional[Annotated[list[NonEmptyStr], Field(min_length=1)]] = None
    grammar: Optional[NonEmptyStr] = Field(None, description="a Lark / EBNF grammar (llguidance syntax)")
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: Int(ge=1, le=MAX_N) = 1
    stop: StopType = Field(None, description="stop string(s), each non-empty; the server's --max-stop-strings "
                                             "and --max-stop-chars limits apply")
    seed: Optional[Int(ge=_SEED_MIN, le=_SEED_MAX)] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # ---- extras (vLLM names)
    top_k: Optional[Int(ge=-1, description="-1 or 0: disabled")] = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: Int(ge=0) = 0
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0)
    priority: Int(description="non-zero only with --scheduling-policy priority (else 400)") = 0
    cache_salt: Optional[NonEmptyStr] = None
    # a ceiling for the parser; the server's --max-stop-token-ids (default 256) is the limit that applies
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # ---- token controls: OpenAI's logit_bias (token id as a string -> [-100, 100]), vLLM's allowed_token_ids and
    # bad_words; ranges and the vocabulary are checked by SamplingParams and the engine (400 naming the field)
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[TokenId]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[Int(ge=0, le=MAX_LOGPROBS)] = None  # vLLM's: returned as `prompt_logprobs`
    truncate_prompt_tokens: Optional[Int(ge=-1, description="-1 or >= 1: keep the prompt's last k tokens")] = None
    # vLLM's server beam search: n beams, ranked by cum_logprob / len**length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # ---- structured output: OpenAI's response_format, vLLM's structured_outputs and older guided_* names
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[NonEmptyStr] = None
    guided_choice: Optional[Annotated[list[NonEmptyStr], Field(min_length=1)]] = None
    guided_grammar: Optional[NonEmptyStr] = None


# ---------------------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    # A text, a batch of texts, a token-id list, or a batch of token-id lists; nothing empty.
    prompt: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: Optional[Int(ge=0, description="0 only with echo (scores the prompt)")] = 16
    logprobs: Optional[Int(ge=0, le=MAX_LOGPROBS)] = None
    echo: bool = False
    # best_of > n: best_of samples, the n with the highest cumulative logprob returned (not with stream)
    best_of: Optional[Int(ge=1, le=MAX_N)] = None


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
    # vLLM's shape: None for the first prompt token, then token id -> {logprob, rank, decoded_token}
    prompt_logprobs: Optional[list[Optional[dict[str, dict[str, Any]]]]] = None


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


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionCall(_Request):
    name: FunctionName
    arguments: str = Field(description="the arguments, a JSON object as a string")


class ToolCall(_Request):
    id: NonEmptyStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ChatTextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="assistant messages: the calls it made")
    tool_call_id: Optional[str] = Field(None, description="tool messages: the call this is the result of")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema of the arguments")
    strict: Optional[bool] = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        None, description='default "auto" when tools are given ("auto" needs --enable-auto-tool-choice)')
    parallel_tool_calls: bool = True
    max_tokens: Optional[Int(ge=1)] = None
    max_completion_tokens: Optional[Int(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Optional[Int(ge=0, le=MAX_LOGPROBS)] = None
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


class ResponseFunctionCall(_Response):
    name: str
    arguments: str


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # --reasoning-parser (vLLM's field)
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


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
    prompt_logprobs: Optional[list[Optional[dict[str, dict[str, Any]]]]] = None  # vLLM's extra


class DeltaFunctionCall(_Response):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Response):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(_Response):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # --reasoning-parser: the thinking streams as its own deltas
    tool_calls: Optional[list[DeltaToolCall]] = None

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
    prompt_logprobs: Optional[list[Optional[dict[str, dict[str, Any]]]]] = None  # with prompt_logprobs, once

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):  # the key only in the chunk that carries them, as the completions stream
        out = handler(self)
        if out.get("prompt_logprobs") is None:
            out.pop("prompt_logprobs", None)
        return out


# ------------------------------------------------------------------------------------------ utilities
class TokenizeCompletionRequest(_Request):
    """Tokenize a text (completion style)."""

    model: Optional[str] = None
    prompt: NonEmptyStr
    add_special_tokens: Optional[bool] = None  # default: True

    @property
    def messages(self) -> None:  # the other variant's field: handlers may test `req.messages is None`
        return None


class TokenizeChatRequest(_Request):
    """Tokenize messages through the chat template."""

    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: Optional[bool] = None  # default: False (the template has the special tokens)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @property
    def prompt(self) -> None:  # the other variant's field
        return None


# Exactly one of `prompt` or `messages` (vLLM has the same two models).  The schema is their anyOf, so
# `{}` and `{"prompt": ..., "messages": ...}` are schema-invalid; errors.py reports them as one message.
TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]
# Variant model name -> the field that selects it (used to report validation errors of the union).
TOKENIZE_VARIANTS = {"TokenizeCompletionRequest": "prompt", "TokenizeChatRequest": "messages"}


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[TokenId]


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


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"


class VersionResponse(_Response):
    version: str


# ---------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    """OpenAI's error object: all four keys are always present (`param` and `code` may be null)."""

    message: str
    type: str
    param: Optional[str]
    code: Optional[Union[str, int]]


class ErrorResponse(BaseModel):
    """The body of every non-2xx response: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# Rules a JSON schema cannot express; a schema-valid request that breaks one is refused with this status
# (and the OpenAI error body naming `param`).  The conformance test accepts exactly these refusals.
BUSINESS_RULES: dict[str, str] = {
    "model": "404 unless it is the served model's name",
    "prompt / messages": "400 if the prompt has >= max_model_len tokens or a token id outside the vocabulary, "
                         "or the chat template refuses the messages",
    "max_tokens": "400 if prompt + max_tokens > max_model_len or more than the whole KV cache",
    "min_tokens": "400 if greater than max_tokens",
    "n": "400 if prompts x n > --max-sequences-per-request",
    "stop": "400 if more than --max-stop-strings strings or --max-stop-chars characters",
    "stop_token_ids / tokens": "400 if an id is outside the vocabulary",
    "logprobs / top_logprobs / prompt_logprobs": "400 if above --max-logprobs; top_logprobs needs logprobs=true",
    "max_tokens (completions)": "400 if 0 without echo",
    "logit_bias / allowed_token_ids": "400 if a token id is outside the vocabulary or a bias outside [-100, 100]",
    "best_of": "400 if below n, or above n with stream",
    "truncate_prompt_tokens": "400 if 0 or above max_model_len - 1",
    "use_beam_search": "400 with a field beam search does not honour (logprobs, echo, temperature > 0, ...), or n "
                       "above half of --max-logprobs",
    "priority": "400 if non-zero without --scheduling-policy priority",
    "stream_options": "400 without stream=true",
    "max_completion_tokens": "400 if both it and max_tokens are given and they differ",
    "add_generation_prompt / continue_final_message": "400 if both are true",
    "chat_template_kwargs": "400 if it sets a reserved key",
    "response_format / structured_outputs / guided_*": "400 if more than one constraint is given (tool_choice "
                                                       "required or a named function counts as one), json_schema "
                                                       "without its schema, or the schema / regex / grammar is "
                                                       "invalid",
    "tools / tool_choice": "400 if tool_choice names a function not in tools, is required / named without tools, "
                           "is auto without --enable-auto-tool-choice, or a function's parameters schema is "
                           "invalid",
}

_ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request: malformed JSON, a field of the wrong type or out of range, an unknown field, or a "
         "request breaking a rule the schema cannot express (prompt longer than the context, token id outside "
         "the vocabulary, min_tokens > max_tokens, ...).  `param` names the field.",
    401: "Missing or wrong API key (only when the server runs with --api-key).",
    404: "Unknown model (`param` = 'model') or unknown path.",
    413: "Request body too large.",
    429: "The server's waiting queue is full; retry after the `Retry-After` header's seconds.",
    500: "The engine failed this request (other requests are not affected).",
    503: "The server is starting, shutting down, or its engine is not running.",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for the given statuses, each with the OpenAI error body."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[code]}
        if code == 429:
            entry["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
        out[code] = entry
    return out


def _sse(description: str) -> dict[str, Any]:
    # One event (OpenAPI 3.2's itemSchema, as FastAPI writes it): `data` is a JSON chunk, an error object
    # (`{"error": {...}}`, when the request fails mid-stream) or the final `[DONE]`.
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer", "minimum": 0}}}
    return {"description": description, "content": {"text/event-stream": {"itemSchema": event}}}


# What each route documents (FastAPI `responses=`).  Every route may answer 500 (a bug), every route but
# /health and /metrics 401 (--api-key), every route with a JSON body 400 and 413.
_BODY = (400, 401, 413, 500)
ROUTE_RESPONSES: dict[str, dict[int | str, dict[str, Any]]] = {
    "completions": {**error_responses(*_BODY, 404, 429, 503),
                    200: _sse("A completion (JSON), or with stream=true an event stream of chunks ending "
                              "with `data: [DONE]`.")},
    "chat": {**error_responses(*_BODY, 404, 429, 503),
             200: _sse("A chat completion (JSON), or with stream=true an event stream of chunks ending with "
                       "`data: [DONE]`.")},
    "pooling": error_responses(*_BODY, 404, 429, 503),  # embeddings, pooling, score, rerank: one JSON answer
    "responses": {**error_responses(*_BODY, 404, 429, 503),
                  200: _sse("A Response object (JSON), or with stream=true its typed events (`event:` + `data:`), "
                            "ending with response.completed or response.incomplete.")},
    "tokenize": error_responses(*_BODY, 404),
    "detokenize": error_responses(*_BODY, 404),
    "models": error_responses(401, 500),
    "model": error_responses(401, 404, 500),
    "health": error_responses(500, 503),
    "version": error_responses(401, 500),
    "metrics": {**error_responses(500),
                200: {"description": "Prometheus text exposition format.",
                      "content": {"text/plain": {"schema": {"type": "string"}}}}},
}
