"""Request models of POST /v1/responses (OpenAI's Responses API), the subset this server runs: text and message
input, instructions, sampling, function tools, text formats.  Like every request model here, unknown fields are
a 400 naming them (previous_response_id, conversation, reasoning, built-in tools, ...): nothing is silently
ignored.  Response bodies are written as plain dicts in serving_responses.py, in the openai SDK's shapes."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag

from pagedserve.entrypoints.openai.protocol import (FunctionDefinition, FunctionName, Int, JsonSchemaFormat,
                                                    NamedFunction, NonEmptyStr, _Request, _SEED_MAX, _SEED_MIN)


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list[Any]] = None  # an earlier response's output_text, sent back as input
    logprobs: Optional[list[Any]] = None


class InputMessage(_Request):
    """A message item (EasyInputMessage or a previous output message sent back)."""
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputText]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class InputFunctionCall(_Request):
    """A call the model made earlier (an output item sent back)."""
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: FunctionName
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class InputFunctionCallOutput(_Request):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str
    id: Optional[str] = None
    status: Optional[str] = None


def _item_type(item: Any) -> str:
    """Items are told apart by `type`; a message may leave it out (OpenAI's EasyInputMessage)."""
    value = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return value if value in ("message", "function_call", "function_call_output") else "unknown"


InputItem = Annotated[Union[Annotated[InputMessage, Tag("message")], Annotated[InputFunctionCall, Tag("function_call")],
                            Annotated[InputFunctionCallOutput, Tag("function_call_output")]],
                      Discriminator(_item_type)]


class FunctionTool(FunctionDefinition):
    """Chat's function definition, flat: {"type": "function", "name", ...}."""
    type: Literal["function"]


class NamedFunctionChoice(NamedFunction):
    type: Literal["function"]


class TextFormatText(_Request):
    type: Literal["text"]


class TextFormatJsonObject(_Request):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaFormat):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON schema")  # required here, as OpenAI's

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class TextConfig(_Request):
    format: Annotated[Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema],
                      Field(discriminator="type")] = TextFormatText(type="text")


class ResponsesRequest(_Request):
    model: Optional[str] = None
    input: Union[NonEmptyStr, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Int(ge=1)] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedFunctionChoice]] = None
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    stream: bool = False
    store: bool = Field(False, description="accepted; nothing is stored (false is what the server does)")
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    # ---- extras (vLLM names)
    seed: Optional[Int(ge=_SEED_MIN, le=_SEED_MAX)] = None
    top_k: Optional[Int(ge=-1)] = None
    priority: Int() = 0
    cache_salt: Optional[NonEmptyStr] = None
