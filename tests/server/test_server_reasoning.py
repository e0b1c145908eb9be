"""--reasoning-parser on the chat route over HTTP, with the official client, on the tiny random
chat model: `message.reasoning_content` apart from `message.content`, `delta.reasoning_content`
until `</think>` then `delta.content`, tool calls read from the answer alone.

A random model writes `<think>` only when made to, so a regex constraint forces the text; that
also shows the rule for constrained outputs (content unless they open with `<think>`). The
unconstrained case shows the other rule: this template opens no thinking and writes none, so
the output starts inside thinking (vLLM's qwen3 / deepseek_r1) and, with no `</think>`, is all
reasoning. The server without a parser, on the same engine, is the reference text."""

import json

import pytest

from jaxserve.server import ServerConfig
from http_server import chat_stream, openai_client, serving, tiny_chat_loop

TINY = "tiny-chat"
CHAT = [{"role": "user", "content": "Name a colour."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def loop():
    with tiny_chat_loop() as loop:
        yield loop


@pytest.fixture(scope="module")
def client(loop):
    with serving(loop, ServerConfig(served_model_name=TINY, reasoning_parser="qwen3")) as s:
        yield openai_client(s)


def stream(client, **kw):
    return chat_stream(client, TINY, **kw)


def test_thinking_and_answer_are_apart(client):
    kw = dict(messages=CHAT, max_tokens=40, extra_body={
        "guided_regex": r"<think>I think\. red or blue</think>\n\nBlue\."})
    msg = client.chat.completions.create(model=TINY, **kw).choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == ("I think. red or blue",
                                                                   "\n\nBlue.")
    reasoning, content, _, finish, order = stream(client, **kw)
    assert (reasoning, content, finish) == ("I think. red or blue", "\n\nBlue.", "stop")
    # Thinking first, then the answer, never mixed back; the tag split across tokens is gone.
    assert order == sorted(order, key=["reasoning", "content"].index) and len(order) > 2


def test_unconstrained_output_starts_inside_thinking(loop, client):
    kw = dict(messages=CHAT, max_tokens=12, temperature=0)
    with serving(loop, ServerConfig(served_model_name=TINY)) as plain:
        reference = openai_client(plain).chat.completions.create(model=TINY, **kw)
    text = reference.choices[0].message.content
    assert text and "</think>" not in text and "reasoning_content" not in \
        reference.choices[0].message.model_extra
    out = client.chat.completions.create(model=TINY, **kw)
    msg = out.choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (text, None)
    assert out.choices[0].finish_reason == reference.choices[0].finish_reason
    reasoning, content, _, _, _ = stream(client, **kw)
    assert (reasoning, content) == (text, "")


def test_a_constrained_answer_without_thinking_is_content(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": {
        "type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}}}
    out = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=40,
                                         response_format=fmt, temperature=1.0, seed=1)
    msg = out.choices[0].message
    assert json.loads(msg.content)["c"] in ("red", "blue")
    assert msg.model_extra["reasoning_content"] is None


@pytest.mark.parametrize("stream_it", [False, True])
def test_tool_calls_come_from_the_answer_not_the_thinking(client, stream_it):
    thought_call = r"<think>maybe " + CALL + r"</think>No call\."
    for regex, want_calls in ((r"<think>plan</think>" + CALL, 1), (thought_call, 0)):
        kw = dict(messages=CHAT, tools=[WEATHER], max_tokens=120,
                  extra_body={"guided_regex": regex})
        if stream_it:
            reasoning, content, calls, finish, _ = stream(client, **kw)
            got = [(n, json.loads(a)) for n, a in calls.values()]
        else:
            out = client.chat.completions.create(model=TINY, **kw)
            msg, finish = out.choices[0].message, out.choices[0].finish_reason
            reasoning, content = msg.model_extra["reasoning_content"], msg.content or ""
            got = [(c.function.name, json.loads(c.function.arguments))
                   for c in msg.tool_calls or []]
        if want_calls:
            assert got == [("get_weather", {"city": "Paris"})] and finish == "tool_calls"
            assert (reasoning, content) == ("plan", "")
        else:
            assert got == [] and finish == "stop" and content == "No call."
            assert reasoning.startswith("maybe <tool_call>") and "get_weather" in reasoning
