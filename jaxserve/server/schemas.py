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
from jaxserve.server.embedding_protocol import MAX_INPUTS
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


EmbeddingInput = Union[Annotated[str, Field(min_length=1)],
                       Annotated[list[Annotated[str, Field(min_length=1)]],
                                 Field(min_length=1, max_length=MAX_INPUTS)],
                       PromptIds,
                       Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_INPUTS)]]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (400 when the server was started without --enable-embeddings).
    Each input must fit the model's context; token ids must be below the vocabulary size."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(description="the served model's name (GET /v1/models)")
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="base64: each embedding's float32 values, little-endian, in base64")
    dimensions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="the model's hidden size (decoder models are not matryoshka "
                          "models: any other length is a 400)")
    user: str | None = None
    normalize: bool | None = Field(None, description="L2-normalise (default true; vLLM's)")
    truncate_prompt_tokens: None = None


class Embedding(BaseModel):
    model_config = ConfigDict(extra="allow")
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


SCHEMAS = (CompletionRequest, ChatCompletionRequest, ErrorResponse, CompletionResponse,
           ChatCompletionResponse, ModelList, Health, LoadLoRAAdapterRequest,
           UnloadLoRAAdapterRequest, EmbeddingRequest, EmbeddingResponse)
