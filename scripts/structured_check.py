"""Structured output and tool calls on the real model through the official `openai` client.

Starts SmolLM2-135M-Instruct behind the OpenAI server in this process, then:

- schemas: 10 JSON schemas (closed by strict mode, open, `$ref`, enums, nested arrays,
  nullable, a map) sent as `response_format` `json_schema`, at temperature 0 and 0.9; each
  output must validate with `jsonschema` (against the schema as strict mode reads it: objects
  without `additionalProperties` closed) or end with `finish_reason="length"`;
- tools: `tool_choice` required (one tool, two tools, parallel calls) and named, streamed and
  not, at temperature 0 and 0.9; every call must come back in `tool_calls` (never as content),
  with `finish_reason="tool_calls"`, arguments that parse and validate against the tool's
  schema, and a streamed call's name in its first delta before any argument fragment; an
  output cut at max_tokens (`finish_reason="length"`) must hold valid calls but for its last.

    .venv/bin/python scripts/structured_check.py --md docs/results/structured_check.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import faulthandler
import json
import logging
import pathlib
import signal
import sys
import threading
import time

import jsonschema
import openai

from jaxserve import EngineConfig, LLMEngine
from jaxserve.core.strict_schema import close_objects
from jaxserve.server import EngineLoop, ServerConfig, create_app, make_server
from jaxserve.tools.machine import describe

MODEL = "smollm2-135m"
TEMPERATURES = (0.0, 0.9)


def _obj(props: dict, required: list[str], **extra) -> dict:
    return {"type": "object", "properties": props, "required": required, **extra}


PERSON = _obj({"name": {"type": "string"}, "age": {"type": "integer"}}, ["name", "age"])
# (name, prompt, schema, strict)
SCHEMAS = [
    ("ok-note", "Is the sky blue? Answer as JSON with ok and an optional note.",
     _obj({"ok": {"type": "boolean"}, "note": {"type": ["string", "null"]}}, ["ok"]), True),
    ("ref-two-objects", "Give the author and the editor of a book as JSON.",
     {"$defs": {"person": PERSON}, **_obj({"author": {"$ref": "#/$defs/person"},
                                           "editor": {"$ref": "#/$defs/person"}},
                                          ["author", "editor"])}, True),
    ("enums", "Describe a T-shirt as JSON.",
     _obj({"size": {"enum": ["small", "medium", "large"]},
           "color": {"type": "string", "enum": ["red", "green"]}}, ["size", "color"]), True),
    ("nested-arrays", "Write a 2 by 2 matrix of integers as JSON.",
     _obj({"matrix": {"type": "array", "items": {"type": "array",
                                                 "items": {"type": "integer"}}}}, ["matrix"]),
     True),
    ("nullable", "Give a person's name and nickname (or null) as JSON.",
     _obj({"name": {"type": "string"},
           "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
          ["name", "nickname"]), True),
    ("array-of-objects", "List two products in an order as JSON.",
     _obj({"items": {"type": "array", "items": _obj({"sku": {"type": "string"},
                                                     "qty": {"type": "integer"}},
                                                    ["sku", "qty"])}}, ["items"]), True),
    ("open-not-strict", "Describe a film as JSON with at least a title.",
     _obj({"title": {"type": "string"}}, ["title"]), False),
    ("open-explicit", "Give a number a as JSON.",
     _obj({"a": {"type": "integer"}}, ["a"], additionalProperties=True), True),
    ("map-of-integers", "Give the ages of three friends as a JSON object.",
     {"type": "object", "additionalProperties": {"type": "integer"}}, True),
    ("nested-optional", "Describe a user account as JSON.",
     _obj({"user": _obj({"id": {"type": "integer"}, "email": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}}}, ["id"])},
          ["user"]), True),
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": _obj({"city": {"type": "string"}}, ["city"])}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": _obj({"query": {"type": "string"},
                        "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                       ["query"])}}
TOOL_SCHEMAS = {t["function"]["name"]: close_objects(t["function"]["parameters"])
                for t in (WEATHER, SEARCH)}
ASK = [{"role": "system", "content": "You answer questions by calling functions."},
       {"role": "user", "content": "What is the weather like in Paris today? Also find news "
                                   "about Paris."}]
NAMED = {"type": "function", "function": {"name": "search_web"}}
# (name, tools, tool_choice, parallel)
TOOL_CASES = [
    ("required-one", [WEATHER], "required", False),
    ("required-two", [WEATHER, SEARCH], "required", False),
    ("required-parallel", [WEATHER, SEARCH], "required", True),
    ("named", [WEATHER, SEARCH], NAMED, False),
]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=2, help="seeds per case at temperature > 0")
    ap.add_argument("--md", type=pathlib.Path)
    ap.add_argument("--json", type=pathlib.Path)
    return ap.parse_args(argv)


def check_schema(client, case, temperature: float, seed: int, max_tokens: int) -> dict:
    name, prompt, schema, strict = case
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=temperature, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": strict}})
    choice = out.choices[0]
    text, finish = choice.message.content, choice.finish_reason
    row = {"case": name, "temperature": temperature, "seed": seed, "finish": finish,
           "text": text}
    if finish == "length":
        row["outcome"] = "length"
        return row
    try:
        jsonschema.validate(json.loads(text), close_objects(schema) if strict else schema)
        row["outcome"] = "valid"
    except (ValueError, jsonschema.ValidationError) as e:
        row["outcome"], row["error"] = "INVALID", str(e).splitlines()[0][:200]
    return row


def _stream_calls(client, kw) -> tuple[list[dict], str, str | None, bool]:
    """(calls, content, finish, name-first) from a streamed completion, accumulated as the
    openai client's users do."""
    calls, content, finish, name_first = {}, "", None, True
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                if d.function.arguments and not entry["name"] and not d.function.name:
                    name_first = False
                entry["id"] += d.id or ""
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return list(calls.values()), content, finish, name_first


def check_tools(client, case, stream: bool, temperature: float, seed: int,
                max_tokens: int) -> dict:
    name, tools, choice, parallel = case
    kw = dict(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
              parallel_tool_calls=parallel, max_tokens=max_tokens, temperature=temperature,
              seed=seed)
    if stream:
        calls, content, finish, name_first = _stream_calls(client, kw)
    else:
        out = client.chat.completions.create(**kw)
        msg, finish, name_first = out.choices[0].message, out.choices[0].finish_reason, True
        content = msg.content or ""
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in msg.tool_calls or []]
    row = {"case": name, "stream": stream, "temperature": temperature, "seed": seed,
           "finish": finish, "calls": calls, "content": content}
    allowed = {t["function"]["name"] for t in tools}
    if choice is NAMED:
        allowed = {NAMED["function"]["name"]}
    problems, cut = [], finish == "length"
    if not cut and (finish != "tool_calls" or not calls):
        problems.append(f"finish {finish!r} with {len(calls)} calls")
    if content.strip() and not cut:  # a cut before the first name leaves its text as content
        problems.append("content beside the calls")
    if not parallel and len(calls) > 1:
        problems.append(f"{len(calls)} calls without parallel_tool_calls")
    if not name_first:
        problems.append("an argument fragment before the call's name")
    for call in calls[:-1] if cut else calls:  # a cut output's last call may be cut too
        if call["name"] not in allowed or not call["id"].startswith("call_"):
            problems.append(f"call {call['name']!r} id {call['id']!r}")
            continue
        try:
            jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(f"arguments {call['arguments']!r}: {str(e).splitlines()[0][:120]}")
    row["outcome"] = "INVALID: " + "; ".join(problems) if problems else \
        ("length" if cut else "valid")
    return row


def run(args) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=8, max_model_len=1024))
    loop = EngineLoop(engine).start()
    app = create_app(loop, ServerConfig(served_model_name=MODEL))
    server = make_server(app, "127.0.0.1", 0, ServerConfig(served_model_name=MODEL))
    threading.Thread(target=server.run, daemon=True).start()
    pool = concurrent.futures.ThreadPoolExecutor(8)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.effective_port}/v1",
                           api_key="none", max_retries=0, timeout=600)
    seeds = {0.0: [0], **{t: list(range(args.seeds)) for t in TEMPERATURES if t > 0}}
    start = time.monotonic()
    try:
        jobs = [pool.submit(check_schema, client, case, t, s, args.max_tokens)
                for case in SCHEMAS for t in TEMPERATURES for s in seeds[t]]
        jobs += [pool.submit(check_tools, client, case, stream, t, s, args.max_tokens)
                 for case in TOOL_CASES for stream in (False, True) for t in TEMPERATURES
                 for s in seeds[t]]
        rows = [j.result() for j in jobs]
    finally:
        pool.shutdown(cancel_futures=True)
        server.close()
        loop.stop()
    return {"machine": describe(), "model": args.model, "max_tokens": args.max_tokens,
            "seconds": round(time.monotonic() - start, 1), "rows": rows}


def markdown(result: dict) -> str:
    rows = result["rows"]
    schema_rows = [r for r in rows if "stream" not in r]
    tool_rows = [r for r in rows if "stream" in r]
    bad = [r for r in rows if r["outcome"].startswith("INVALID")]
    lines = [f"# Structured output and tool calls on {result['model']} through the `openai` "
             "client", "",
             f"`scripts/structured_check.py`, {result['machine']}, max_tokens "
             f"{result['max_tokens']}, {result['seconds']} s. Schemas are sent as "
             "`response_format` `json_schema`; tool calls with `tool_choice` required or "
             "named.", "",
             f"**{len(rows) - len(bad)} of {len(rows)} requests valid or cut at length; "
             f"{len(bad)} invalid.**", "",
             "| schema | strict | temperature | seed | finish | outcome | output |",
             "|---|---|---|---|---|---|---|"]
    strict = {c[0]: c[3] for c in SCHEMAS}
    for r in schema_rows:
        text = (r["text"] or "").replace("|", "\\|").replace("\n", " ")
        text = text if len(text) <= 90 else text[:87] + "..."
        lines.append(f"| {r['case']} | {strict[r['case']]} | {r['temperature']} | {r['seed']} "
                     f"| {r['finish']} | {r['outcome']} {r.get('error', '')} | `{text}` |")
    lines += ["", "| tool case | stream | temperature | seed | finish | outcome | calls |",
              "|---|---|---|---|---|---|---|"]
    for r in tool_rows:
        calls = "; ".join(f"{c['name']}({c['arguments']})" for c in r["calls"])
        calls = calls.replace("|", "\\|").replace("\n", " ")
        calls = calls if len(calls) <= 90 else calls[:87] + "..."
        lines.append(f"| {r['case']} | {r['stream']} | {r['temperature']} | {r['seed']} | "
                     f"{r['finish']} | {r['outcome']} | `{calls}` |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack
    result = run(args)
    md = markdown(result)
    print(md)
    if args.md:
        args.md.write_text(md)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any(r["outcome"].startswith("INVALID") for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
