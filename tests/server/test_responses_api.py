"""POST /v1/responses over real HTTP with the official `openai` client, on the tiny random chat
model: plain and streamed responses (the typed events, in order), function calls and their
follow-up, `responses.parse` with a pydantic model, reasoning items, stored responses and
`previous_response_id`, and OpenAI-shaped 400s.

A random model writes a tool call or JSON only when a constraint makes it (tool_choice,
text.format, or vLLM's guided_regex extension), as in test_server_structured.py. The chat route
on the same engine is the reference for the text: a Responses request is a chat request."""

import json
import time

import jsonschema
import pydantic
import pytest
import requests

from jaxserve.server import ServerConfig
from http_server import openai_client, serving, tiny_chat_loop

TINY = "tiny-chat"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Rome"]}}}}
TIME = {"type": "function", "name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}}}}
STORED = 2


@pytest.fixture(scope="module")
def loop():
    with tiny_chat_loop() as loop:
        yield loop


@pytest.fixture(scope="module")
def server(loop):
    with serving(loop, ServerConfig(served_model_name=TINY,
                                    max_stored_responses=STORED)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_plain_response_is_the_chat_completion(client):
    kw = dict(max_tokens=12, temperature=0)
    chat = client.chat.completions.create(
        model=TINY, messages=[{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Name a colour."}], **kw)
    out = client.responses.create(model=TINY, instructions="Be brief.", input="Name a colour.",
                                  max_output_tokens=12, temperature=0)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == chat.choices[0].message.content and out.output_text
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    length = chat.choices[0].finish_reason == "length"
    assert out.status == ("incomplete" if length else "completed") == item.status
    assert (out.incomplete_details.reason if length else out.incomplete_details) == \
        ("max_output_tokens" if length else None)
    u = out.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens,
                                                 chat.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert (out.model, out.instructions, out.max_output_tokens, out.temperature) == \
        (TINY, "Be brief.", 12, 0.0)


def test_stream_events_in_order_build_the_final_response(client):
    kw = dict(model=TINY, input="Name a colour.", max_output_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + \
        ["response.output_text.delta"] * (len(types) - 8) + \
        ["response.output_text.done", "response.content_part.done",
         "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text and len(text) > 0
    assert final.status == "incomplete" and final.usage.output_tokens == 16
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    # The client's own accumulator (responses.stream) agrees, on a response that completes.
    with client.responses.stream(model=TINY, input="Name a colour.", max_output_tokens=40,
                                 extra_body={"guided_regex": "Blue, or red\\."}) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == "Blue, or red." == "".join(deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_then_its_output(client, stream):
    kw = dict(model=TINY, input="What is the time in a city?", tools=[WEATHER, TIME],
              tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=120,
              temperature=1.0, parallel_tool_calls=False)
    if stream:
        fragments = []
        with client.responses.stream(**kw) as s:
            for e in s:
                if e.type == "response.function_call_arguments.delta":
                    fragments.append(e.delta)
            out = s.get_final_response()
        assert "".join(fragments) == out.output[0].arguments and len(fragments) > 1
    else:
        out = client.responses.create(**kw)
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_time" and out.output_text == ""
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    jsonschema.validate(args, TIME["parameters"])
    follow = client.responses.create(
        model=TINY, tools=[WEATHER, TIME], max_output_tokens=40,
        input=[{"role": "user", "content": "What is the time in a city?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}],
        extra_body={"guided_regex": "It is noon\\."})
    assert follow.output_text == "It is noon." and follow.status == "completed"
    # The call and its result are in the prompt: it is longer than the question alone.
    alone = client.responses.create(model=TINY, tools=[WEATHER, TIME], max_output_tokens=1,
                                    input="What is the time in a city?")
    assert follow.usage.input_tokens > alone.usage.input_tokens + 20


def test_text_and_calls_on_both_sides(client):
    forced = (r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "Rome"\}\}\n</tool_call> Done\.')
    out = client.responses.create(model=TINY, input="Weather?", tools=[WEATHER],
                                  max_output_tokens=120, extra_body={"guided_regex": forced})
    assert [i.type for i in out.output] == ["message", "function_call", "message"]
    # The space just before the call is dropped (server/tool_parser.py), the one after it kept.
    assert out.output_text == "Sure. Done." and json.loads(out.output[1].arguments) == \
        {"city": "Rome"}


class Colour(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^(red|blue|green)$")
    warm: bool


def test_parse_with_a_pydantic_model(client):
    out = client.responses.parse(model=TINY, input="A colour?", text_format=Colour,
                                 max_output_tokens=60, temperature=1.0)
    assert isinstance(out.output_parsed, Colour), out.output_text
    assert out.output_parsed.name in ("red", "blue", "green")
    assert out.text.format.type == "json_schema" and out.text.format.name == "Colour"


def test_reasoning_items(loop):
    with serving(loop, ServerConfig(served_model_name=TINY, reasoning_parser="deepseek_r1")) \
            as s:
        client = openai_client(s)
        kw = dict(model=TINY, input="Hi", max_output_tokens=60,
                  extra_body={"guided_regex": r"<think>Greet back\.</think>Hello!"})
        out = client.responses.create(**kw)
        events = list(client.responses.create(stream=True, **kw))
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == ["Greet back."] and reasoning.summary == []
    assert out.output_text == "Hello!"
    assert 0 < out.usage.output_tokens_details.reasoning_tokens < out.usage.output_tokens
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert thought == "Greet back." and done == [thought]
    assert events[-1].response.output[0].content[0].text == thought
    assert events[-1].response.output_text == "Hello!"


def test_stored_responses_continue_and_are_bounded(server, client):
    first = client.responses.create(model=TINY, input="Hi", max_output_tokens=8,
                                    extra_body={"guided_regex": "Hello!"})
    assert first.store is True or first.model_extra.get("store") is True
    got = requests.get(f"{server.url}/v1/responses/{first.id}", timeout=30).json()
    assert got["id"] == first.id and got["output"][0]["content"][0]["text"] == "Hello!"
    second = client.responses.create(model=TINY, input="Again", previous_response_id=first.id,
                                     max_output_tokens=1)
    alone = client.responses.create(model=TINY, input="Again", max_output_tokens=1,
                                    store=False)
    # The follow-up's prompt holds the first turn: Hi, Hello! and their chat markup.
    assert second.usage.input_tokens > alone.usage.input_tokens + 6
    assert second.previous_response_id == first.id
    assert requests.get(f"{server.url}/v1/responses/{alone.id}", timeout=30).status_code == 404
    for _ in range(STORED):  # the oldest falls out
        client.responses.create(model=TINY, input="x", max_output_tokens=1)
    r = requests.post(server.url + "/v1/responses", timeout=30, json={
        "model": TINY, "input": "x", "previous_response_id": first.id})
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_without_a_store_store_true_is_answered_false(loop):
    with serving(loop, ServerConfig(served_model_name=TINY)) as s:
        out = openai_client(s).responses.create(model=TINY, input="x", max_output_tokens=1)
        assert out.model_extra.get("store") is False or out.store is False
        r = requests.post(s.url + "/v1/responses", timeout=30, json={
            "model": TINY, "input": "x", "previous_response_id": out.id})
        assert r.status_code == 404 and "--max-stored-responses" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "computer_call_output"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "objec"}}}}, "text"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
], ids=["item", "hosted-tool", "bad-schema", "too-long", "background", "temperature"])
def test_bad_requests_are_openai_400s(server, body, param):
    r = requests.post(server.url + "/v1/responses", json={"model": TINY, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert set(err) == {"message", "type", "param", "code"}


def test_unknown_model_and_bad_json(server):
    r = requests.post(server.url + "/v1/responses", json={"model": "gpt-9", "input": "x"},
                      timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = requests.post(server.url + "/v1/responses", data=b'{"model": ', timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def finished_by_length(server) -> float:
    text = requests.get(server.url + "/metrics", timeout=30).text
    lines = [line for line in text.splitlines()
             if line.startswith('jaxserve_request_total{finish_reason="length"}')]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0  # none yet: no series


def test_a_dropped_stream_frees_its_request(server, loop):
    free, finished = loop.stats()["kv_blocks_free"], finished_by_length(server)
    body = {"model": TINY, "input": "Once upon a time", "max_output_tokens": 900,
            "ignore_eos": True, "stream": True}
    with requests.post(server.url + "/v1/responses", json=body, stream=True, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith(b"event: "):
                events.append(line)
                if len(events) == 6:
                    break  # leaving the with-block closes the socket mid-stream
    assert events[-1] == b"event: response.output_text.delta"
    deadline = time.monotonic() + 30
    while (loop.in_flight() or loop.stats()["kv_blocks_free"] != free) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert loop.in_flight() == 0 and loop.stats()["kv_blocks_free"] == free
    # Aborted, not run to its 900 tokens with nobody listening.
    assert finished_by_length(server) == finished
