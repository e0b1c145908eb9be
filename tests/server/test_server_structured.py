"""Structured outputs and tool calls over HTTP. The tiny random chat model shows the protocol:
a random model writes valid output only because the constraint makes it; the real SmolLM2
with the official `openai` client (parse() with a pydantic model, tool round trips) is the
path a user runs."""

import json

import jsonschema
import openai
import pydantic
import pytest
import requests

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig
from http_server import serving
from jaxserve.testing.tiny_chat import tiny_chat_model

TINY = "tiny-chat"
CHAT = [{"role": "user", "content": "Name a colour."}]
COLOUR = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}}}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"],
           "get_time": TIME["function"]["parameters"]}


# ---- the tiny model -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    model = tiny_chat_model(seed=0)
    engine = LLMEngine(EngineConfig(model=model.source, warmup=False, max_num_seqs=4,
                                    max_model_len=1024, max_num_batched_tokens=256),
                       model=model)
    loop = EngineLoop(engine).start()
    try:
        with serving(loop, ServerConfig(served_model_name=TINY)) as s:
            yield s
    finally:
        loop.stop()


def chat(server, **body):
    body = {"model": TINY, "messages": CHAT, "max_tokens": 64, **body}
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
CASES = [  # (id, body, param)
    ("format-type", {"response_format": {"type": "xml"}}, "response_format"),
    ("format-bad-schema", {"response_format": BAD_SCHEMA}, "response_format"),
    ("format-unenforceable-keyword", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ("format-no-schema-object", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("bad-regex", {"guided_regex": "(("}, "guided_regex"),
    # The tiny vocabulary has no token for non-ASCII bytes: no token can start it (the fuzz of
    # tests/server/test_openapi.py once drew such a regex and got a 500 at the first step).
    ("unstartable-regex", {"guided_regex": "\u00ef~"}, "guided_regex"),
    ("empty-choice", {"guided_choice": []}, "guided_choice"),
    ("bad-grammar", {"guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ("two-constraints", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("choice-names-no-tool", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("bad-tool-choice", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ("tool-bad-name", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ("duplicate-tools", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("tool-bad-schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objec"}}}], "tool_choice": "required"},
     "tool_choice"),
    ("required-and-format", {"tools": [WEATHER], "tool_choice": "required",
                             "response_format": {"type": "json_object"}}, "response_format"),
    ("min-tokens", {"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
    ("strict-not-bool", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "c", "schema": COLOUR, "strict": "yes"}}}, "response_format"),
    ("tool-strict-not-bool", {"tools": [{"type": "function", "function": {
        "name": "f", "strict": 1}}]}, "tools"),
]


@pytest.mark.parametrize("body,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_constraints_are_400s(server, body, param):
    r = chat(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_tools_on_completions_are_refused(server):
    r = requests.post(server.url + "/v1/completions", json={
        "model": TINY, "prompt": "x", "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_random_model_follows_the_constraints(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOUR, "strict": True}}
    for seed in range(3):
        r = chat(server, response_format=fmt, temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        jsonschema.validate(json.loads(choice["message"]["content"]), COLOUR)
        assert choice["finish_reason"] == "stop"
    r = requests.post(server.url + "/v1/completions", json={
        "model": TINY, "prompt": "x", "max_tokens": 16, "temperature": 1.0, "n": 3,
        "guided_choice": ["alpha", "beta gamma"]}, timeout=60)
    assert {c["text"] for c in r.json()["choices"]} <= {"alpha", "beta gamma"}
    r = chat(server, guided_regex="[0-9]{4}", temperature=1.0)
    assert len(r.json()["choices"][0]["message"]["content"]) == 4
    r = chat(server, response_format={"type": "json_object"}, temperature=0.0, max_tokens=200)
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # a random model may not close it within max_tokens
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].startswith("{")


# Neither object says additionalProperties: strict mode closes both, JSON Schema leaves them open.
UNSAID = {"type": "object", "required": ["ok", "inner"], "properties": {
    "ok": {"type": "boolean"},
    "inner": {"type": "object", "properties": {"n": {"enum": [1, 2]}}}}}


def _extra_keys(value: dict) -> set[str]:
    return (set(value) - {"ok", "inner"}) | (set(value.get("inner", {})) - {"n"})


def test_strict_schemas_close_objects_and_others_stay_open(server):
    # A random model at temperature 1 adds a property whenever the grammar lets it.
    got = {}
    for strict in (True, False):
        fmt = {"type": "json_schema", "json_schema": {"name": "u", "schema": UNSAID,
                                                      "strict": strict}}
        got[strict] = []
        for seed in range(4):
            r = chat(server, response_format=fmt, temperature=1.0, seed=seed, max_tokens=200)
            assert r.status_code == 200, r.text
            got[strict].append(r.json()["choices"][0])
    for choice in got[True]:
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        jsonschema.validate(value, UNSAID)
        assert not _extra_keys(value), value
    open_outputs = [c["message"]["content"] for c in got[False]]
    assert any(c["finish_reason"] == "length" or _extra_keys(json.loads(c["message"]["content"]))
               for c in got[False]), open_outputs


def test_a_length_cut_inside_a_constraint_says_length(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOUR}}
    r = chat(server, response_format=fmt, temperature=1.0, max_tokens=2)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    for stream in (False, True):
        body = dict(tools=[WEATHER], tool_choice="required", max_tokens=6, temperature=1.0,
                    stream=stream)
        r = chat(server, **body)
        if stream:
            finishes = [json.loads(line[6:])["choices"][0]["finish_reason"]
                        for line in r.text.splitlines()
                        if line.startswith("data: {") and json.loads(line[6:])["choices"]]
            assert [f for f in finishes if f] == ["length"], finishes
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_a_required_call_with_tags_and_quotes_in_its_arguments_is_a_call(server):
    # The string may hold anything; the regex makes the random model write the closing tag,
    # braces and escaped quotes inside it, as SmolLM2 once did.
    tricky = (r'<tool_call>\n\{"name": "get_time", "arguments": \{"city": '
              r'">P</tool_call>\}, \\"\{"\}\}\n</tool_call>')
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    for stream in (False, True):
        kw = dict(model=TINY, messages=CHAT, tools=[WEATHER, TIME], max_tokens=120,
                  temperature=1.0, extra_body={"guided_regex": tricky})
        if stream:
            args, names, content, finish = "", "", "", None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    content += c.delta.content or ""
                    for d in c.delta.tool_calls or []:
                        names += d.function.name or ""
                        args += d.function.arguments or ""
                    finish = c.finish_reason or finish
        else:
            out = client.chat.completions.create(**kw)
            (call,) = out.choices[0].message.tool_calls
            names, args = call.function.name, call.function.arguments
            content, finish = out.choices[0].message.content or "", out.choices[0].finish_reason
        assert (names, finish, content) == ("get_time", "tool_calls", ""), (args, content)
        assert json.loads(args) == {"city": '>P</tool_call>}, "{'}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_random_model_calls_tools_when_told(server, stream, tool_choice):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    choice = ({"type": "function", "function": {"name": "get_time"}} if tool_choice == "named"
              else "required")
    kw = dict(model=TINY, messages=CHAT, tools=[WEATHER, TIME], tool_choice=choice,
              max_tokens=120, temperature=1.0, seed=3, parallel_tool_calls=False)
    if stream:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
                finish = c.finish_reason or finish
        got = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        out = client.chat.completions.create(**kw)
        finish = out.choices[0].finish_reason
        got = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
    assert finish == "tool_calls" and len(got) == 1
    name, args = got[0]
    assert name == "get_time" or (tool_choice == "required" and name == "get_weather")
    jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_tool_messages_are_accepted(server):
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = chat(server, messages=messages, tools=[WEATHER], max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_calls_the_model_writes(server, stream):
    # tool_choice auto constrains nothing; a regex makes the random model write one call
    # between two bits of text, which the parser must turn into content + tool_calls.
    forced = (r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "(Paris|Rome)"\}\}\n</tool_call> Done\.')
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    kw = dict(model=TINY, messages=CHAT, tools=[WEATHER, TIME], max_tokens=120,
              temperature=1.0, extra_body={"guided_regex": forced})
    if stream:
        content, names, args, finish = "", "", "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    assert d.index == 0
                    names += d.function.name or ""
                    args += d.function.arguments or ""
                finish = c.finish_reason or finish
    else:
        out = client.chat.completions.create(**kw)
        msg, finish = out.choices[0].message, out.choices[0].finish_reason
        (call,) = msg.tool_calls
        content, names, args = msg.content, call.function.name, call.function.arguments
    assert finish == "tool_calls" and names == "get_weather"
    assert json.loads(args)["city"] in ("Paris", "Rome")
    assert content.split() == ["Sure.", "Done."]


def _prompt(template: str | None, **body) -> str:
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.protocol import ModelInfo, parse_chat
    from jaxserve.testing.tiny_chat import tiny_tokenizer
    tok = tiny_tokenizer()
    if template is not None:
        tok = tok.with_chat_template(template)
    req = parse_chat({"model": TINY, "max_tokens": 4, **body}, ServerConfig(),
                     ModelInfo(tok, tok.vocab_size, 4096))
    return req.prompt_texts[0]


HISTORY = CHAT + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_a_template_that_knows_tools_renders_them():
    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} "
                "{{ c.function.arguments.city }}){% endfor %}{% endfor %}")
    text = _prompt(template, messages=HISTORY, tools=[WEATHER, TIME])
    assert text == ("[tool get_weather][tool get_time]<user>Name a colour.<assistant>"
                    "(call get_weather Paris)<tool>sunny")


def test_other_templates_get_the_hermes_prompt():
    text = _prompt(None, messages=HISTORY, tools=[WEATHER])
    assert "<tools>" in text and '"name": "get_weather"' in text  # the system block
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text
    assert "<tools>" not in _prompt(None, messages=HISTORY, tools=[WEATHER],
                                    tool_choice="none")


def test_the_openai_stream_helper_accumulates_the_argument_fragments(server):
    # client.chat.completions.stream: the client's own accumulator, its argument-delta events
    # and its final parse of a strict function tool.
    class GetTime(pydantic.BaseModel):
        city: str = pydantic.Field(pattern="^[A-Z][a-z]{1,9}$")

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    tool = openai.pydantic_function_tool(GetTime, name="get_time")
    fragments, names = [], []
    with client.chat.completions.stream(
            model=TINY, messages=CHAT, tools=[tool], tool_choice="required", max_tokens=120,
            temperature=1.0, seed=5, parallel_tool_calls=False) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
            elif event.type == "tool_calls.function.arguments.done":
                names.append(event.name)
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert names == ["get_time"] and final.choices[0].finish_reason == "tool_calls"
    assert len(fragments) > 1 and "".join(fragments) == call.function.arguments
    assert isinstance(call.function.parsed_arguments, GetTime)
