"""OpenAI request bodies -> a validated GenerationRequest (token ids + SamplingParams).

Everything a client can get wrong is caught here, in the handler thread, as a 400 that names
the offending `param`, so the engine thread only ever sees requests it can serve.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.sampling_params import SamplingParamError, SamplingParams
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import ApiError, invalid, shown
from jaxserve.server.fields import Fields

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Fields we do not implement: refusing them beats silently ignoring what the client asked.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "suffix", "logit_bias",
               "parallel_tool_calls", "audio", "modalities", "prediction")
CHAT_ROLES = ("system", "developer", "user", "assistant")


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
    fmt = f.raw("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise invalid("only response_format {'type': 'text'} is supported", "response_format",
                      "unsupported")


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
              stop: tuple[str, ...]) -> SamplingParams:
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
            ignore_eos=f.boolean("ignore_eos"), logprobs=top_logprobs)
    except SamplingParamError as e:
        raise invalid(str(e), e.param) from e


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
           echo: bool) -> GenerationRequest:
    stream = f.boolean("stream")
    include_usage = _stream_options(f, stream)
    n = f.integer("n", 1, 1, config.max_n)
    stop = _stop(f, config)
    params = _sampling(f, _max_tokens(f, prompts, info, chat), top_logprobs, stop)
    return GenerationRequest(chat=chat, model=f.string("model", required=True), prompts=prompts,
                             prompt_texts=texts, params=params, n=n, stream=stream,
                             include_usage=include_usage, top_logprobs=top_logprobs, echo=echo)


def _check_body(body) -> Fields:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    f = Fields(body)
    f.string("model", required=True)
    _check_unsupported(f)
    return f


def parse_completion(body, config: ServerConfig, info: ModelInfo) -> GenerationRequest:
    f = _check_body(body)
    prompts, texts = _completion_prompts(f.raw("prompt"), info)
    logprobs = f.integer("logprobs", None, 0, config.max_logprobs)
    echo = f.boolean("echo")
    if echo and logprobs is not None:
        raise invalid("'echo' together with 'logprobs' needs prompt logprobs, which are not "
                      "supported", "echo", "unsupported")
    return _build(f, config, info, chat=False, prompts=prompts, texts=texts,
                  top_logprobs=logprobs, echo=echo)


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
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and
                   isinstance(p.get("text"), str) for p in content):
            raise invalid(f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise invalid(f"messages[{i}].content must be a string or a list of text parts",
                      "messages")
    return {"role": "system" if message["role"] == "developer" else message["role"],
            "content": content}


def parse_chat(body, config: ServerConfig, info: ModelInfo) -> GenerationRequest:
    f = _check_body(body)
    messages = f.raw("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    clean = [_message_text(i, m) for i, m in enumerate(messages)]
    try:
        text = info.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - template errors are the client's conversation
        raise invalid(f"the chat template rejected the messages: {str(e)[:200]}",
                      "messages") from e
    want = f.boolean("logprobs")
    top = f.integer("top_logprobs", None, 0, config.max_logprobs)
    if top is not None and not want:
        raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    return _build(f, config, info, chat=True, prompts=[info.encode(text)], texts=[text],
                  top_logprobs=(top or 0) if want else None, echo=False)


__all__ = ["ApiError", "GenerationRequest", "ModelInfo", "parse_chat", "parse_completion"]
