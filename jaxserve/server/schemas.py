"""Pydantic models of the request and response bodies: the source of GET /openapi.json.

Why pydantic: it is the maintained way to write JSON Schema from Python types (it emits
draft 2020-12, which OpenAPI 3.1 uses as is), and it is already what the OpenAI client
library describes these bodies with. These models describe; they do not validate requests.
server/protocol.py stays the authority for what a request means (it checks what a schema
cannot: prompt length against the model, token ids against the vocabulary, cross-field
rules), and tests/server/test_openapi.py checks that the two agree on the bad-input table.

Unknown fields are allowed (OpenAI clients send fields this server ignores), so every model is
`extra="allow"`. Limits come from the same constants the validator reads.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.core.sampling_params import MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from jaxserve.server.lora_routes import MAX_NAME_CHARS, MAX_PATH_CHARS
from jaxserve.server.protocol import CHAT_ROLES, MAX_PROMPTS

TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None]
# What the validator accepts for the fields it does not implement (anything else is a 400).
Unsupported = Union[Literal["", "none"], Annotated[list[Any], Field(max_length=0)],
                    Annotated[dict[str, Any], Field(max_length=0)], None]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class _Sampling(BaseModel):
    """Fields both generation routes share (ranges are SamplingParams')."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(description="the served model's name (GET /v1/models)")
    n: Annotated[int, Field(ge=1)] | None = Field(
        None, description="choices per prompt; at most the server's max_n")
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="new tokens; prompt + max_tokens must fit the model's context")
    min_tokens: Annotated[int, Field(ge=0)] | None = Field(None, description="<= max_tokens")
    stop: Stop = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    best_of: Literal[1] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    functions: Unsupported = None
    function_call: Unsupported = None
    suffix: Unsupported = None
    logit_bias: Unsupported = None
    audio: Unsupported = None
    modalities: Unsupported = None
    prediction: Unsupported = None


PromptIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Union[Annotated[str, Field(min_length=1)],
               Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)],
               PromptIds,
               Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)]]


class CompletionRequest(_Sampling):
    """POST /v1/completions. Token ids must also be below the vocabulary size."""

    prompt: Prompt
    logprobs: Logprobs | None = None
    echo: bool | None = Field(None, description="not together with logprobs")
    tools: Unsupported = None
    tool_choice: Unsupported = None
    parallel_tool_calls: None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = Field(None, description="needs logprobs: true")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's Responses API). Input items: messages (text parts),
    function_call, function_call_output, reasoning (dropped); tools: function tools. vLLM's
    sampling extras (seed, top_k, min_p, repetition_penalty, stop, guided_*, ...) are taken as
    on chat completions."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(description="the served model's name (GET /v1/models)")
    input: str | list[dict[str, Any]]
    instructions: str | None = Field(None, description="a system message ahead of the input")
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description="{'format': text | json_object | "
                                                          "json_schema}")
    stream: bool | None = None
    store: bool | None = Field(None, description="kept only with --max-stored-responses N > 0")
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = Field(None, description="repeated, not acted on")
    user: str | None = None
    include: list[str] | None = Field(None, description="only reasoning.encrypted_content "
                                                        "(ignored)")
    truncation: Literal["disabled"] | None = None
    # Refused (400 unsupported) unless absent, null, false, 0 or empty.
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    top_logprobs: Any = None


class ResponsesResponse(BaseModel):
    """A Response object (stream: its typed events, the last response.completed or
    response.incomplete)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    index: int
    message: dict[str, Any]
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = Field(description="what a request's `model` names: the base model or an adapter")
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = Field(None, description="the base model's name, or the adapter's "
                                               "directory")
    parent: str | None = Field(None, description="a LoRA adapter's base model (null for the "
                                                 "base model)")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


LoRAName = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: LoRAName = Field(description="the name requests select it by (`model`)")
    lora_path: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)] = Field(
        description="a PEFT LoRA adapter directory on the server (adapter_config.json + "
                    "adapter_model.safetensors)")


class UnloadLoRAAdapterRequest(BaseModel):
    """One of the two identifies the adapter (both: they must agree)."""

    model_config = ConfigDict(extra="allow")
    lora_name: LoRAName | None = None
    lora_int_id: Annotated[int, Field(ge=1)] | None = None


class Health(BaseModel):
    status: Literal["ok"]


SCHEMAS = (CompletionRequest, ChatCompletionRequest, ErrorResponse, CompletionResponse,
           ChatCompletionResponse, ModelList, Health, LoadLoRAAdapterRequest,
           UnloadLoRAAdapterRequest, ResponsesRequest, ResponsesResponse)
