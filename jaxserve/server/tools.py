"""Tool calling in /v1/chat/completions: the request's tools, how the prompt shows them, the
constraint `tool_choice` asks for (server/tool_parser.py turns the output into `tool_calls`).

The format is Hermes' (Qwen 2.5, SmolLM3, Hermes 2/3, what vLLM's `hermes` parser reads):
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call. A chat
template that handles tools itself (it mentions `tools`) gets them as its `tools` variable and
the messages as they are; any other template gets a system block describing the tools and the
format, assistant tool calls written as those blocks and tool results as user turns wrapped in
`<tool_response>`. With `tool_choice` `required` or a named function, generation is constrained
to `<tool_call>` blocks whose JSON follows the tools' parameter schemas, read as OpenAI's strict
mode reads them (objects that leave `additionalProperties` unsaid are closed) unless a
function says `"strict": false`.
"""

from __future__ import annotations

import dataclasses
import json
import re

from jaxserve.core.strict_schema import close_objects
from jaxserve.core.structured_outputs import JSON_OPTIONS, StructuredOutputs
from jaxserve.server.errors import invalid, shown
from jaxserve.server.tool_parser import CLOSE, OPEN

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128


@dataclasses.dataclass(frozen=True)
class Tools:
    """A request's tools (OpenAI `function` objects), `tool_choice` and parallel_tool_calls."""

    functions: tuple[dict, ...]  # each {"name", "description", "parameters"}: the prompt's
    choice: str                  # "auto" | "required" | a function's name
    parallel: bool = True
    loose: frozenset[str] = frozenset()  # functions that said "strict": false

    @property
    def names(self) -> set[str]:
        return {fn["name"] for fn in self.functions}

    def constraint(self) -> StructuredOutputs | None:
        """The grammar of `required` / a named choice: only tool-call blocks."""
        if self.choice == "auto":
            return None
        fns = [fn for fn in self.functions if self.choice in ("required", fn["name"])]
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": fn["name"]},
                                 "arguments": fn["parameters"] if fn["name"] in self.loose
                                 else close_objects(fn["parameters"])}} for fn in fns]
        schema = {"anyOf": calls, "x-guidance": JSON_OPTIONS}
        repeat = ' ("\\n" call)*' if self.parallel else ""
        lark = (f"start: call{repeat}\n"
                f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n"
                f"body: %json {json.dumps(schema)}\n")
        return StructuredOutputs(grammar=lark)


def parse_tools(tools, tool_choice, parallel) -> Tools | None:
    """The request's tools, or None when it has none or `tool_choice` is "none"; 400s name
    the field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise invalid("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [fn["name"] for fn in functions]
    if len(set(names)) != len(names):
        raise invalid("tool names must be unique", "tools")
    choice = _choice(tool_choice, set(names))
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice == "none":
        return None
    loose = frozenset(t["function"]["name"] for t in tools if t["function"].get("strict") is False)
    return Tools(functions, choice, True if parallel is None else parallel, loose)


def _function(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(tool.get("function"), dict):
        raise invalid(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise invalid(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or "
                      f"'-', got {shown(name)}", "tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise invalid(f"tools[{i}].function.description must be a string", "tools")
    if not isinstance(fn.get("strict", False), bool):
        raise invalid(f"tools[{i}].function.strict must be a boolean", "tools")
    return {"name": name, "description": desc or "", "parameters": params}


def _choice(tool_choice, names: set[str]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise invalid(f"tool_choice names {shown(name)}, which is not in 'tools'",
                          "tool_choice")
        return name
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                  "'function': {'name': ...}}", "tool_choice")


# ---- the prompt ---------------------------------------------------------------------------

def template_handles_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def system_block(tools: Tools) -> str:
    """The Hermes tool prompt, for templates that do not render tools themselves."""
    listed = "\n".join(json.dumps({"type": "function", "function": fn}) for fn in tools.functions)
    return ("You may call functions to help with the user's request. The functions are listed "
            f"in <tools></tools>:\n<tools>\n{listed}\n</tools>\nTo call a function, reply with "
            f"one JSON object per call inside {OPEN}{CLOSE} tags:\n{OPEN}\n"
            f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def render_messages(messages: list[dict], tools: Tools | None, native: bool) -> list[dict]:
    """Messages (already checked) as the template takes them: native templates get them as
    they are (arguments as objects, HF's convention); others get plain text turns."""
    if native:
        return [_native(m) for m in messages]
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n"
                                                   "</tool_response>"})
        elif m.get("tool_calls"):
            blocks = [f"{OPEN}\n{json.dumps(_call_json(c))}\n{CLOSE}" for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None:
        block = system_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _call_json(call: dict) -> dict:
    fn = call["function"]
    return {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}


def _arguments(args):
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args
    return args if args is not None else {}


def _native(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"],
                                "arguments": _arguments(c["function"].get("arguments"))}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}
