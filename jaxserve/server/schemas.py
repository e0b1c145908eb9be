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

from pydantic import BaseModel, ConfigDict, Field, RootModel

from jaxserve.core.sampling_params import MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from jaxserve.core.structured_outputs import MAX_CHOICES, MAX_SPEC_CHARS
from jaxserve.server.embedding_protocol import MAX_INPUTS
from jaxserve.server.lora_routes import MAX_NAME_CHARS, MAX_PATH_CHARS
from jaxserve.server.protocol import CHAT_ROLES, MAX_PROMPTS
from jaxserve.server.tools import MAX_TOOLS, NAME_RE

TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None]
# What the validator accepts for the fields it does not implement (anything else is a 400).
Unsupported = Union[Literal["", "none"], Annotated[list[Any], Field(max_length=0)],
                    Annotated[dict[str, Any], Field(max_length=0)], None]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class ModelName(RootModel[str]):
    """A model this server serves (GET /v1/models): the base model or a loaded LoRA adapter.
    The served /openapi.json lists the names (`enum`); any other name is a 404."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class _Sampling(BaseModel):
    """Fields both generation routes share (ranges are SamplingParams')."""

    model_config = ConfigDict(extra="allow")
    model: ModelName = Field(description="the served model's name (GET /v1/models)")
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
    guided_regex: Annotated[str, Field(min_length=1, max_length=MAX_SPEC_CHARS)] | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
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
    echo: bool | None = Field(None, description="return the prompt before the completion "
                                                "(with logprobs: the prompt's too, the first "
                                                "token's null)")
    tools: Unsupported = None
    tool_choice: Unsupported = None
    parallel_tool_calls: None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


Content = Union[str, list[TextPart]]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(pattern=NAME_RE.pattern)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema object")
    strict: bool = False


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class SystemMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer"]
    content: Content


class UserMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user"]
    content: Content


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = Field("", description="JSON text, or the object")


class ToolCall(BaseModel):
    """A call an earlier assistant turn made, as OpenAI returned it."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: str | None = None
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["assistant"]
    content: Content


class AssistantToolCallMessage(BaseModel):
    """An assistant turn that called tools: its content may be null."""

    model_config = ConfigDict(extra="allow")
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)]


class ToolMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


# OpenAI's message shapes, by role (content is null only in an assistant turn that calls tools).
ChatMessage = Union[SystemMessage, UserMessage, AssistantMessage, AssistantToolCallMessage,
                    ToolMessage]
assert {r for m in ChatMessage.__args__ for r in m.model_fields["role"].annotation.__args__} \
    == set(CHAT_ROLES)  # every role the validator takes has a shape here


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = Field(None, description="needs logprobs: true")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="names must be unique")
    tool_choice: str | dict[str, Any] | None = Field(None, description="needs tools")
    parallel_tool_calls: bool | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's Responses API). Input items: messages (text parts),
    function_call, function_call_output, reasoning (dropped); tools: function tools. vLLM's
    sampling extras (seed, top_k, min_p, repetition_penalty, stop, guided_*, ...) are taken as
    on chat completions."""

    model_config = ConfigDict(extra="allow")
    model: ModelName = Field(description="the served model's name (GET /v1/models)")
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


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with text (vLLM's TokenizeCompletionRequest)."""

    model_config = ConfigDict(extra="allow")
    model: ModelName | None = None
    prompt: str
    add_special_tokens: bool | None = Field(
        None, description="add the model's BOS when it has one, as /v1/completions does "
                          "(default true)")
    return_token_strs: bool | None = Field(None, description="also answer the tokens' strings")


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with a chat, rendered by the model's chat template as
    /v1/chat/completions renders it (vLLM's TokenizeChatRequest)."""

    model_config = ConfigDict(extra="allow")
    model: ModelName | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = Field(
        None, description="end with the assistant turn's opening (default true)")
    continue_final_message: bool | None = Field(
        None, description="end inside the last message, to continue it; needs "
                          "add_generation_prompt: false")
    add_special_tokens: bool | None = Field(
        None, description="add BOS on top of what the template writes (default false)")
    return_token_strs: bool | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="names must be unique")
    tool_choice: str | dict[str, Any] | None = Field(None, description="needs tools")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[TokenId]
    token_strs: list[str] | None


class DetokenizeRequest(BaseModel):
    """POST /detokenize. Ids must also be below the vocabulary size, at most max_model_len."""

    model_config = ConfigDict(extra="allow")
    model: ModelName | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info (vLLM's): tokenizer_config.json's fields for a client that
    tokenizes and templates on its own."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


class EngineState(BaseModel):
    """GET /v1/engine/state: the web page's view of the engine (server/engine_state.py)."""

    model_config = ConfigDict(extra="allow")
    version: int
    time: float
    age_s: float
    model: str
    config: dict[str, Any]
    slots: list[dict[str, Any]]
    waiting: list[dict[str, Any]]
    blocks: dict[str, Any]
    gauges: dict[str, float]
    counters: dict[str, float]
    server: dict[str, Any]


class StartProfileRequest(BaseModel):
    """Optional body of POST /start_profile; captures go to the server's --profile-dir."""

    model_config = ConfigDict(extra="forbid")
    num_steps: Annotated[int, Field(ge=1)] | None = Field(
        None, description="stop by itself after this many engine steps")


class ProfileStarted(BaseModel):
    status: Literal["started"]
    directory: str
    num_steps: int | None


class ProfileStopped(BaseModel):
    status: Literal["stopped"]
    trace_dir: str
    files: list[str]
EmbeddingInput = Union[Annotated[str, Field(min_length=1)],
                       Annotated[list[Annotated[str, Field(min_length=1)]],
                                 Field(min_length=1, max_length=MAX_INPUTS)],
                       PromptIds,
                       Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_INPUTS)]]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (400 when the server was started without --enable-embeddings).
    Each input must fit the model's context; token ids must be below the vocabulary size."""

    model_config = ConfigDict(extra="allow")
    model: ModelName = Field(description="the served model's name (GET /v1/models)")
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
            UnloadLoRAAdapterRequest, TokenizeCompletionRequest, TokenizeChatRequest,
            TokenizeResponse, DetokenizeRequest, DetokenizeResponse, TokenizerInfo, EngineState,
            StartProfileRequest, ProfileStarted, ProfileStopped, ResponsesRequest,
            ResponsesResponse, EmbeddingRequest, EmbeddingResponse)
