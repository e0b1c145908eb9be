"""--reasoning-parser on a Qwen3-Thinking prompt, over HTTP with the official client: the tiny
random chat model carries Qwen3-4B-Thinking-2507's real template (tests/chat_templates), whose
generation prompt ends in `<|im_start|>assistant\\n<think>\\n`, so the model's output starts
inside thinking and never writes `<think>` itself: `thought</think>\\n\\nanswer`.

A random model writes such text only when made to, so a regex constraint forces it (as in
test_server_reasoning.py, where the ChatML template opens no thinking). The server without a
parser, on the same engine, gives the raw text each split must add up to."""

import json
import pathlib

import pytest
import requests

from jaxserve.server import ServerConfig
from http_server import chat_stream, openai_client, serving, tiny_chat_loop

TINY = "tiny-chat"
TEMPLATE = (pathlib.Path(__file__).parents[1] / "chat_templates" / "qwen3.jinja").read_text()
CHAT = [{"role": "user", "content": "Name a colour."}]
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n"
THOUGHT, ANSWER = "Red is warm.", "\n\nRed."
FORCED = r"Red is warm\.</think>\n\nRed\."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def loop():
    with tiny_chat_loop(chat_template=TEMPLATE) as loop:
        yield loop


@pytest.fixture(scope="module")
def server(loop):
    with serving(loop, ServerConfig(served_model_name=TINY, reasoning_parser="qwen3")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def plain(loop):
    """A client of the same engine without a reasoning parser: the raw text."""
    with serving(loop, ServerConfig(served_model_name=TINY)) as s:
        yield openai_client(s)


def rendered(server, **body) -> str:
    """The prompt text the chat route gives the model (POST /tokenize renders alike)."""
    ids = requests.post(server.url + "/tokenize", timeout=30,
                        json={"model": TINY, "messages": CHAT, **body}).json()["tokens"]
    return requests.post(server.url + "/detokenize", timeout=30,
                         json={"model": TINY, "tokens": ids}).json()["prompt"]


def stream(client, **kw):
    return chat_stream(client, TINY, **kw)


def test_the_prompt_opens_thinking(server):
    assert rendered(server).endswith("<|im_end|>\n" + GENERATION_PROMPT)
    with_tools = rendered(server, tools=[WEATHER])
    assert with_tools.endswith(GENERATION_PROMPT) and '"name": "get_weather"' in with_tools
    assert "# Tools" in with_tools and "<tool_call>" in with_tools


def test_thinking_then_answer(client, plain):
    kw = dict(messages=CHAT, max_tokens=40, extra_body={"guided_regex": FORCED})
    raw = plain.chat.completions.create(model=TINY, **kw).choices[0].message.content
    assert raw == THOUGHT + "</think>" + ANSWER
    out = client.chat.completions.create(model=TINY, **kw)
    msg = out.choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (THOUGHT, ANSWER)
    assert out.choices[0].finish_reason == "stop"
    reasoning, content, _, finish, order = stream(client, **kw)
    assert (reasoning, content, finish) == (THOUGHT, ANSWER, "stop")
    # All thinking first, then all answer. A regex might not write </think> at all (then it
    # is all answer), so the thinking is held until </think> shows it was thinking: one delta.
    assert order == ["reasoning"] + ["content"] * (len(order) - 1) and len(order) > 2


@pytest.mark.parametrize("stream_it", [False, True])
def test_a_tool_call_after_thinking(client, plain, stream_it):
    kw = dict(messages=CHAT, tools=[WEATHER], max_tokens=120,
              extra_body={"guided_regex": r"Paris, then\.</think>\n\n" + CALL})
    raw = plain.chat.completions.create(model=TINY, **kw).choices[0].message
    # Without the parser the thinking and its tag are the call's leading text.
    assert raw.content == "Paris, then.</think>" and len(raw.tool_calls) == 1
    if stream_it:
        reasoning, content, calls, finish, order = stream(client, **kw)
        got = [(n, json.loads(a)) for n, a in calls.values()]
        assert order[0] == "reasoning" and "reasoning" not in order[order.index("tool_call"):]
    else:
        out = client.chat.completions.create(model=TINY, **kw)
        msg, finish = out.choices[0].message, out.choices[0].finish_reason
        reasoning, content = msg.model_extra["reasoning_content"], msg.content
        got = [(c.function.name, json.loads(c.function.arguments))
               for c in msg.tool_calls or []]
    assert got == [("get_weather", {"city": "Paris"})] and finish == "tool_calls"
    # The gap before the call is no answer (a stream sends it as content, as without thinking).
    assert reasoning == "Paris, then." and not (content or "").strip()


def test_responses_reasoning_item_then_message(client, plain):
    kw = dict(model=TINY, input=CHAT[0]["content"], max_output_tokens=40,
              extra_body={"guided_regex": FORCED})
    out = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == [THOUGHT]
    assert message.type == "message" and out.output_text == ANSWER
    assert 0 < out.usage.output_tokens_details.reasoning_tokens < out.usage.output_tokens
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (THOUGHT, ANSWER)
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


def test_constrained_answers_without_thinking_are_content(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": {
        "type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}}}
    kw = dict(messages=CHAT, max_tokens=40, response_format=fmt, temperature=1.0, seed=1)
    msg = client.chat.completions.create(model=TINY, **kw).choices[0].message
    assert json.loads(msg.content)["c"] in ("red", "blue")
    assert msg.model_extra["reasoning_content"] is None
    # A JSON value is never thinking, so its stream is not held back for a </think>.
    reasoning, content, _, _, order = stream(client, **kw)
    assert (reasoning, content) == ("", msg.content) and order.count("content") > 1
    # A choice might have written </think>; it did not, so it is all answer.
    kw = dict(messages=CHAT, max_tokens=10, temperature=0,
              extra_body={"guided_choice": ["yes", "no"]})
    msg = client.chat.completions.create(model=TINY, **kw).choices[0].message
    assert msg.content in ("yes", "no") and msg.model_extra["reasoning_content"] is None
    assert stream(client, **kw)[:2] == ("", msg.content)
