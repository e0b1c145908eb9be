"""OpenAI request bodies -> a validated GenerationRequest (token ids + SamplingParams).

Everything a client can get wrong is caught here, in the handler thread, as a 400 that names
the offending `param`, so the engine thread only ever sees requests it can serve.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.sampling_params import SamplingParamError, SamplingParams
from jaxserve.core.structured_outputs import StructuredOutputs
from jaxserve.server import reasoning
from jaxserve.server import tools as tool_calls
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import ApiError, invalid, shown
from jaxserve.server.fields import Fields
from jaxserve.server.structured import constraint

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Fields we do not implement: refusing them beats silently ignoring what the client asked.
UNSUPPORTED = ("functions", "function_call", "suffix", "logit_bias", "audio", "modalities",
               "prediction")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    chat: bool
    model: str
    prompts: list[list[int]]          # token ids, one list per prompt
    prompt_texts: list[str]           # the text of each prompt (for echo)
    params: SamplingParams            # n=1; the engine request per prompt gets n
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None          # None: no logprobs; k: k alternatives per token
    echo: bool = False
    constraint_param: str | None = None  # the field params.structured_outputs came from
    tools: tool_calls.Tools | None = None  # chat: parse the output into tool_calls
    priority: int = 0                 # lower runs first, FCFS within (vLLM's field)
    # chat with a reasoning parser: where the output starts unless it opens with <think>
    # ("reasoning", "content" or "either"; server/reasoning.py); None: no reasoning parser
    reasoning: str | None = None


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    tokenizer: object
    vocab_size: int
    max_model_len: int

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise invalid("this model has no tokenizer: send the prompt as token ids", "prompt")
        bos = [tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []
        return bos + tok.encode(text)


def _check_unsupported(f: Fields) -> None:
    for name in UNSUPPORTED:
        value = f.raw(name)
        if value not in (None, "", [], {}, "none"):
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported")
    best_of = f.integer("best_of", 1, 1)
    if best_of != 1:
        raise invalid("'best_of' > 1 is not supported", "best_of", "unsupported")


def _stop(f: Fields, config: ServerConfig) -> tuple[str, ...]:
    stop = f.raw("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop")
    if len(stop) > config.max_stop_strings:
        raise invalid(f"at most {config.max_stop_strings} stop strings, got {len(stop)}", "stop")
    if any(len(s) > config.max_stop_string_chars for s in stop):
        raise invalid(f"stop strings may have at most {config.max_stop_string_chars} "
                      "characters", "stop")
    return tuple(stop)


def _stream_options(f: Fields, stream: bool) -> bool:
    opts = f.raw("stream_options")
    if opts is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    return Fields(opts).boolean("include_usage", False)


def _sampling(f: Fields, max_tokens: int, top_logprobs: int | None,
              stop: tuple[str, ...], spec: StructuredOutputs | None = None,
              spec_param: str | None = None) -> SamplingParams:
    """The SamplingParams of each prompt (n=1 here; each branch gets its own seed stream).

    Fields are type-checked here; their ranges are SamplingParams' own, reported as 400s.
    """
    try:
        return SamplingParams(
            temperature=f.number("temperature", 1.0), top_p=f.number("top_p", 1.0),
            top_k=f.integer("top_k", -1), min_p=f.number("min_p", 0.0),
            repetition_penalty=f.number("repetition_penalty", 1.0),
            presence_penalty=f.number("presence_penalty", 0.0),
            frequency_penalty=f.number("frequency_penalty", 0.0),
            seed=f.integer("seed", None), max_tokens=max_tokens,
            min_tokens=f.integer("min_tokens", 0), stop=stop,
            ignore_eos=f.boolean("ignore_eos"), logprobs=top_logprobs,
            structured_outputs=spec)
    except SamplingParamError as e:
        param = spec_param if e.param == "structured_outputs" else e.param
        raise invalid(str(e), param) from e


def _max_tokens(f: Fields, prompts: list[list[int]], info: ModelInfo, chat: bool) -> int:
    name = "max_completion_tokens" if chat and f.raw("max_completion_tokens") is not None \
        else "max_tokens"
    longest = max(len(p) for p in prompts)
    prompt_param = "messages" if chat else "prompt"
    if longest >= info.max_model_len:
        raise invalid(f"this model's maximum context length is {info.max_model_len} tokens; "
                      f"the prompt has {longest}", prompt_param, "context_length_exceeded")
    default = info.max_model_len - longest if chat else COMPLETION_DEFAULT_MAX_TOKENS
    value = f.integer(name, None, 1)
    if value is None:
        return min(default, info.max_model_len - longest)
    if longest + value > info.max_model_len:
        raise invalid(f"this model's maximum context length is {info.max_model_len} tokens; "
                      f"you asked for {longest + value} ({longest} in the prompt, {value} to "
                      f"generate)", name, "context_length_exceeded")
    return value


def _build(f: Fields, config: ServerConfig, info: ModelInfo, *, chat: bool,
           prompts: list[list[int]], texts: list[str], top_logprobs: int | None,
           echo: bool, tools: tool_calls.Tools | None = None) -> GenerationRequest:
    stream = f.boolean("stream")
    include_usage = _stream_options(f, stream)
    n = f.integer("n", 1, 1, config.max_n)
    stop = _stop(f, config)
    spec, spec_param = constraint(f)
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        if spec is not None:
            raise invalid(f"'{spec_param}' cannot be combined with tool_choice "
                          f"{tools.choice!r}", spec_param)
        spec, spec_param = forced, "tool_choice"
    params = _sampling(f, _max_tokens(f, prompts, info, chat), top_logprobs, stop, spec,
                       spec_param)
    return GenerationRequest(chat=chat, model=f.string("model", required=True), prompts=prompts,
                             prompt_texts=texts, params=params, n=n, stream=stream,
                             include_usage=include_usage, top_logprobs=top_logprobs, echo=echo,
                             constraint_param=spec_param, tools=tools,
                             priority=f.integer("priority", 0, -MAX_PRIORITY, MAX_PRIORITY))


MAX_PRIORITY = 2 ** 31 - 1


def _check_body(body) -> Fields:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    f = Fields(body)
    f.string("model", required=True)
    _check_unsupported(f)
    return f


def parse_completion(body, config: ServerConfig, info: ModelInfo) -> GenerationRequest:
    f = _check_body(body)
    for name in TOOL_FIELDS:
        if f.raw(name) not in (None, [], "none"):
            raise invalid(f"'{name}' is only supported by /v1/chat/completions", name,
                          "unsupported")
    prompts, texts = _completion_prompts(f.raw("prompt"), info)
    logprobs = f.integer("logprobs", None, 0, config.max_logprobs)
    echo = f.boolean("echo")
    req = _build(f, config, info, chat=False, prompts=prompts, texts=texts,
                 top_logprobs=logprobs, echo=echo)
    if echo and logprobs is not None:  # the echoed prompt's tokens get logprobs too (vLLM's)
        req = dataclasses.replace(req, params=dataclasses.replace(req.params,
                                                                  prompt_logprobs=logprobs))
    return req


def _token_ids(ids: list, info: ModelInfo) -> list[int]:
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < info.vocab_size]
    if bad:
        raise invalid(f"prompt token ids must be integers in [0, {info.vocab_size}); got "
                      f"{shown(bad[:3])}", "prompt", "invalid_token_id")
    return list(ids)


def _one_prompt(p, info: ModelInfo) -> tuple[list[int], str]:
    if isinstance(p, str):
        if not p:
            raise invalid("'prompt' must not be empty", "prompt")
        return info.encode(p), p
    if isinstance(p, list) and p:
        ids = _token_ids(p, info)
        return ids, info.tokenizer.decode(ids) if info.tokenizer is not None else ""
    raise invalid("'prompt' must be a non-empty string, list of strings, list of token ids or "
                  "list of token-id lists", "prompt")


def _completion_prompts(prompt, info: ModelInfo) -> tuple[list[list[int]], list[str]]:
    if prompt is None:
        raise invalid("'prompt' is a required field", "prompt", "missing_field")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and
                                   all(isinstance(t, int) for t in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt:
        batch = prompt
    else:
        raise invalid("'prompt' must not be empty", "prompt")
    if len(batch) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}", "prompt")
    pairs = [_one_prompt(p, info) for p in batch]
    return [ids for ids, _ in pairs], [text for _, text in pairs]


def _message_text(i: int, message) -> dict:
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise invalid(f"messages[{i}] must be an object with 'role' one of {CHAT_ROLES}",
                      "messages")
    content = message.get("content")
    extra = {}
    if message["role"] == "assistant" and message.get("tool_calls"):
        extra["tool_calls"] = _message_tool_calls(i, message["tool_calls"])
        content = content or ""
    if message["role"] == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise invalid(f"messages[{i}].tool_call_id must be a string", "messages")
        extra["tool_call_id"] = call_id or ""
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and
                   isinstance(p.get("text"), str) for p in content):
            raise invalid(f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise invalid(f"messages[{i}].content must be a string or a list of text parts",
                      "messages")
    return {"role": "system" if message["role"] == "developer" else message["role"],
            "content": content, **extra}


def _message_tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's tool_calls (as OpenAI returned them), checked."""
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", ""), (str, dict)):
            raise invalid(f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', "
                          "'function': {'name', 'arguments'}}", "messages")
        out.append({"id": c.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return out


def chat_prompt(f: Fields, info: ModelInfo, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> tuple[str, tool_calls.Tools | None]:
    """The prompt text of a chat body's `messages` (and `tools`) under the model's chat
    template, and its tools; /v1/chat/completions and POST /tokenize render alike."""
    messages = f.raw("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    clean = [_message_text(i, m) for i, m in enumerate(messages)]
    tools = tool_calls.parse_tools(f.raw("tools"), f.raw("tool_choice"),
                                   f.raw("parallel_tool_calls"))
    if info.tokenizer is None:
        raise invalid("this model has no tokenizer (no chat template)", "messages")
    native = tool_calls.template_handles_tools(info.tokenizer.chat_template)
    extra = {"tools": [{"type": "function", "function": fn} for fn in tools.functions]} \
        if native and tools is not None else {}
    try:
        text = info.tokenizer.apply_chat_template(
            tool_calls.render_messages(clean, tools, native),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **extra)
    except Exception as e:  # noqa: BLE001 - template errors are the client's conversation
        raise invalid(f"the chat template rejected the messages: {str(e)[:200]}",
                      "messages") from e
    return text, tools


def parse_chat(body, config: ServerConfig, info: ModelInfo) -> GenerationRequest:
    f = _check_body(body)
    text, tools = chat_prompt(f, info)
    want = f.boolean("logprobs")
    top = f.integer("top_logprobs", None, 0, config.max_logprobs)
    if top is not None and not want:
        raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    req = _build(f, config, info, chat=True, prompts=[info.encode(text)], texts=[text],
                 top_logprobs=(top or 0) if want else None, echo=False, tools=tools)
    if config.reasoning_parser == "none":
        return req
    return dataclasses.replace(req, reasoning=reasoning.output_start(text, _constraint(req)))


def _constraint(req: GenerationRequest) -> str | None:
    """The constraint's kind for the reasoning parser: None, "json" (a schema, a JSON object,
    forced tool calls) or "text" (a regex, choice or grammar of the client's own)."""
    spec = req.params.structured_outputs
    if spec is None:
        return None
    spelled = spec.regex or spec.choice or (spec.grammar and req.constraint_param != "tool_choice")
    return "text" if spelled else "json"


__all__ = ["ApiError", "GenerationRequest", "ModelInfo", "chat_prompt", "parse_chat",
           "parse_completion"]
