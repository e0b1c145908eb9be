"""POST /v1/responses bodies -> the chat route's GenerationRequest, plus what the Response repeats.

A Responses request is rewritten as a chat completions body and validated by `parse_chat`, so
the engine, the chat template, tool calling and structured outputs see exactly what the chat
route would give them: `instructions` becomes a system message ahead of the conversation, input
items become messages (`function_call` items an assistant turn's tool_calls, merged into the
assistant message before them; `function_call_output` items tool messages; `reasoning` items are
dropped, as the chat route drops an assistant turn's reasoning), function tools and
`tool_choice` take chat's shape, `text.format` becomes `response_format` and
`max_output_tokens` `max_completion_tokens`. A 400 names the Responses field, not chat's.

`previous_response_id` continues a stored conversation (server/responses_store.py); its
`instructions` are not carried over (OpenAI's rule). Fields this server cannot honour are refused
with a 400 `unsupported` rather than ignored (REFUSED, and non-function tools or tool choices).
"""

from __future__ import annotations

import dataclasses

from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import ApiError, invalid, shown
from jaxserve.server.fields import Fields
from jaxserve.server.protocol import GenerationRequest, ModelInfo, parse_chat
from jaxserve.server.responses_store import ResponseStore

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
FORMATS = ("text", "json_object", "json_schema")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# Copied as they are into the chat body: OpenAI's sampling fields and vLLM's extras.
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "seed", "top_k",
          "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
          "ignore_eos", "min_tokens", "priority", "structured_outputs", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar")
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
          "response_format": "text"}  # chat's name of a field -> the Responses name
# Refused unless absent, null, false, 0 or empty: background runs, server-side conversations,
# prompt templates, compaction, moderation, output logprobs.
REFUSED = ("background", "conversation", "prompt", "context_management", "moderation",
           "top_logprobs")
IGNORED_INCLUDES = ("reasoning.encrypted_content",)  # reasoning comes back as plain text


@dataclasses.dataclass(frozen=True)
class ResponsesRequest:
    gen: GenerationRequest   # what the engine runs (the chat route's request)
    items: list[dict]        # the conversation's input items, a previous response's included
    echo: dict               # request fields the Response object repeats
    store: bool              # keep the response (false when the server keeps none)


def parse_responses(body, config: ServerConfig, info: ModelInfo,
                    store: ResponseStore) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    f = Fields(body)
    _check_refused(f)
    new_items = _input_items(f.raw("input"))
    previous_id = f.string("previous_response_id")
    items = _previous_items(previous_id, store) + new_items
    instructions = f.string("instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + \
        _messages(items, len(items) - len(new_items))
    chat = {name: body[name] for name in PASSED if name in body}
    chat.update(messages=messages, tools=_tools(f.raw("tools")),
                tool_choice=_tool_choice(f.raw("tool_choice")),
                response_format=_text_format(f.raw("text")),
                max_completion_tokens=f.raw("max_output_tokens"))
    try:
        gen = parse_chat(chat, config, info)
    except ApiError as e:
        if e.param in PARAMS:  # the client sent the Responses field: name that one
            e.message = e.message.replace(f"'{e.param}'", f"'{PARAMS[e.param]}'")
            e.param = PARAMS[e.param]
        raise
    # check_compiles names this field in its 400: the Responses name.
    gen = dataclasses.replace(gen, constraint_param=PARAMS.get(gen.constraint_param,
                                                               gen.constraint_param))
    wants_store = f.boolean("store", True)
    echo = {"instructions": instructions, "max_output_tokens": f.raw("max_output_tokens"),
            "metadata": _metadata(f.raw("metadata")),
            "parallel_tool_calls": f.boolean("parallel_tool_calls", True),
            "previous_response_id": previous_id, "reasoning": _object(f, "reasoning"),
            "store": wants_store and store.enabled,
            "temperature": gen.params.temperature, "text": _object(f, "text") or
            {"format": {"type": "text"}}, "tool_choice": f.raw("tool_choice") or "auto",
            "tools": f.raw("tools") or [], "top_p": gen.params.top_p, "truncation": "disabled",
            "user": f.string("user")}
    return ResponsesRequest(gen=gen, items=items, echo=echo, store=echo["store"])


def _check_refused(f: Fields) -> None:
    for name in REFUSED:
        if f.raw(name) not in (None, False, 0, "", [], {}):
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported")
    if f.raw("truncation") not in (None, "disabled"):
        raise invalid("'truncation' must be 'disabled': a conversation longer than the context "
                      "is a 400, not truncated", "truncation", "unsupported")
    include = f.raw("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
            raise invalid("'include' must be a list of strings", "include")
        extra = [i for i in include if i not in IGNORED_INCLUDES]
        if extra:
            raise invalid(f"'include' {shown(extra[0])} is not supported by this server",
                          "include", "unsupported")


def _object(f: Fields, name: str) -> dict | None:
    value = f.raw(name)
    if value is not None and not isinstance(value, dict):
        raise invalid(f"'{name}' must be an object, got {shown(value)}", name)
    return value


def _metadata(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise invalid("'metadata' must be an object of string values", "metadata")
    return value


def _previous_items(previous_id: str | None, store: ResponseStore) -> list[dict]:
    if previous_id is None:
        return []
    entry = store.get(previous_id)
    if entry is None:
        why = "" if store.enabled else (" (this server keeps no responses: start it with "
                                         "--max-stored-responses N)")
        raise ApiError(404, f"response {shown(previous_id)} not found{why}",
                       type="not_found_error", param="previous_response_id",
                       code="response_not_found")
    return entry.items


def _input_items(value) -> list[dict]:
    if value is None:
        raise invalid("'input' is a required field", "input", "missing_field")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid("'input' must be a string or a list of input items", "input")
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEM_TYPES:
            raise invalid(f"input[{i}] must be an object of type {', '.join(ITEM_TYPES)} (got "
                          f"{shown(kind)}): other items are not supported", "input",
                          "unsupported" if isinstance(kind, str) else None)
    return value


def _messages(items: list[dict], first_new: int) -> list[dict]:
    """Chat messages of the conversation's items (those before first_new were checked when
    they were stored; the index in a 400 counts the request's own input)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i - first_new}]"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(where, item))
        elif kind == "function_call":
            call = _function_call(where, item)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id") or ""
            if not isinstance(call_id, str):
                raise invalid(f"{where}.call_id must be a string", "input")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(f"{where}.output", item.get("output"))})
    return messages


def _message(where: str, item: dict) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {shown(role)}",
                      "input")
    return {"role": role, "content": _text(f"{where}.content", item.get("content"))}


def _text(where: str, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise invalid(f"{where} must be a string or a list of text parts ({', '.join(TEXT_PARTS)}); "
                  "images, files and audio are not supported", "input")


def _function_call(where: str, item: dict) -> dict:
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if not all(isinstance(v, str) for v in (call_id, name, args)):
        raise invalid(f"{where} (function_call) needs string 'call_id', 'name' and 'arguments'",
                      "input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _tools(tools) -> list[dict] | None:
    """OpenAI's flat Responses function tools in chat's nested shape (tools.py checks them)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(f"tools[{i}]: only function tools are supported, got type "
                          f"{shown(kind)}", "tools", "unsupported" if kind else None)
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict")
            if tool.get(k) is not None}})
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice  # none / auto / required; anything else is tools.py's 400
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                  "'name': ...}; other tool choices are not supported", "tool_choice",
                  "unsupported")


def _text_format(text) -> dict | None:
    """`text.format` as chat's response_format (structured.py checks and compiles it)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise invalid("'text' must be {'format': {'type': 'text' | 'json_object' | "
                      "'json_schema', ...}}", "text")
    kind = fmt.get("type") if fmt is not None else "text"
    if kind not in FORMATS:
        raise invalid(f"text.format.type must be one of {', '.join(FORMATS)}, got {shown(kind)}",
                      "text")
    if kind != "json_schema":
        return {"type": kind}
    schema = fmt.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid("text.format.schema must be a JSON schema object", "text")
    return {"type": "json_schema", "json_schema": {
        k: v for k, v in (("name", fmt.get("name")), ("schema", schema),
                          ("strict", fmt.get("strict"))) if v is not None}}
