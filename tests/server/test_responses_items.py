"""The Responses API without an engine: request conversion (server/responses_request.py) into
the chat route's prompt, and output items and their events (server/responses_items.py) built
from text, whole or cut into deltas at every point."""

import itertools
import json

import pytest

from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import ApiError
from jaxserve.server.protocol import ModelInfo
from jaxserve.server.responses_items import OutputItems
from jaxserve.server.responses_request import parse_responses
from jaxserve.server.responses_store import ResponseStore
from jaxserve.testing.tiny_chat import tiny_tokenizer

TOOLS = {"get_weather"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def info():
    tok = tiny_tokenizer()
    return ModelInfo(tok, tok.vocab_size, 4096)


def parse(info, kept=None, config=None, **body):
    return parse_responses({"model": "m", **body}, config or ServerConfig(), info,
                           kept if kept is not None else ResponseStore(0))


# ---- output items ---------------------------------------------------------------------------

def run(pieces, reasoning=None, tools=None, incomplete=False):
    out = OutputItems(reasoning, tools)
    events = [e for p in pieces for e in out.feed(p, 1)] + out.finish(incomplete)
    return out, events


def summary(items):
    def one(item):
        if item["type"] == "function_call":
            return ("function_call", item["name"], json.loads(item["arguments"]))
        return (item["type"], item["content"][0]["text"])
    return [one(i) for i in items]


ITEM_CASES = [  # (id, text, reasoning start, tools, items)
    ("plain", "Hello there.", None, None, [("message", "Hello there.")]),
    ("empty", "", None, None, [("message", "")]),
    ("thinking", "<think>hmm</think>\n\nAnswer.", "content", None,
     [("reasoning", "hmm"), ("message", "\n\nAnswer.")]),
    ("cut-in-thinking", "<think>still", "content", None, [("reasoning", "still")]),
    ("call", CALL, None, TOOLS, [("function_call", "get_weather", {"city": "Paris"})]),
    ("text-call-text", "Sure. " + CALL + " Done.", None, TOOLS,
     [("message", "Sure."), ("function_call", "get_weather", {"city": "Paris"}),
      ("message", " Done.")]),
    ("thinking-space-call", "<think>plan</think>\n\n" + CALL, "content", TOOLS,
     [("reasoning", "plan"), ("function_call", "get_weather", {"city": "Paris"})]),
    ("two-calls", CALL + "\n" + CALL, None, TOOLS,
     [("function_call", "get_weather", {"city": "Paris"})] * 2),
    ("call-in-thinking-is-thinking", "<think>" + CALL + "</think>ok", "content", TOOLS,
     [("reasoning", CALL), ("message", "ok")]),
    ("unknown-tool-is-text", CALL.replace("get_weather", "nope"), None, TOOLS,
     [("message", CALL.replace("get_weather", "nope"))]),
    # A regex after a prompt that opened thinking (reasoning.output_start's "either").
    ("either-closes", "hmm</think>\n\n" + CALL, "either", TOOLS,
     [("reasoning", "hmm"), ("function_call", "get_weather", {"city": "Paris"})]),
    ("either-no-close", "yes", "either", None, [("message", "yes")]),
]


def _cuts(text):
    yield [text]
    yield list(text)
    for k in (1, 2):
        for points in itertools.combinations(range(1, len(text)), k):
            if k == 2 and len(text) > 30:
                return
            bounds = (0,) + points + (len(text),)
            yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("text,reasoning,tools,want", [c[1:] for c in ITEM_CASES],
                         ids=[c[0] for c in ITEM_CASES])
def test_items_from_any_cut_of_the_text(text, reasoning, tools, want):
    for pieces in _cuts(text):
        out, events = run(pieces, reasoning, tools)
        assert summary(out.items) == want, pieces
        check_events(events, out.items)


def check_events(events, items):
    """Replays the events as a client accumulates them: they must rebuild the final items."""
    built, open_index = [], None
    for e in events:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert open_index is None and e["output_index"] == len(built)
            built.append(e["item"])
            open_index = e["output_index"]
            assert e["item"]["status"] == "in_progress"
        elif kind == "response.output_item.done":
            assert e["output_index"] == open_index and e["item"]["id"] == built[-1]["id"]
            built[-1] = e["item"]
            open_index = None
        else:
            assert e["output_index"] == open_index and e["item_id"] == built[-1]["id"], e
            item = built[-1]
            if kind == "response.content_part.added":
                item["content"].append(dict(e["part"]))
            elif kind.endswith("text.delta"):
                item["content"][e["content_index"]]["text"] += e["delta"]
            elif kind.endswith("text.done"):
                assert item["content"][e["content_index"]]["text"] == e["text"]
            elif kind == "response.function_call_arguments.delta":
                item["arguments"] += e["delta"]
            elif kind == "response.function_call_arguments.done":
                assert item["arguments"] == e["arguments"] and e["name"] == item["name"]
    assert open_index is None
    assert built == items


def test_events_name_the_item_kinds_and_statuses():
    out, events = run(["<think>a</think>b"], reasoning="content", incomplete=True)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"]
    # The item the token limit cut is incomplete; the one before it completed.
    assert [i["status"] for i in out.items] == ["completed", "incomplete"]
    assert out.items[0]["content"] == [{"type": "reasoning_text", "text": "a"}]


def test_reasoning_tokens_count_the_steps_inside_thinking():
    out = OutputItems("content", None)
    for piece in ["<think>", "a", "b", "</think>", "c", "d"]:
        out.feed(piece, 1)
    out.finish(False)
    assert out.reasoning_tokens == 4  # <think>, a, b and the step that closed it


@pytest.mark.parametrize("pieces,want", [(["a", "b", "</think>", "c"], 3), (["a", "b"], 0)])
def test_reasoning_tokens_count_held_steps_once_they_prove_thinking(pieces, want):
    out = OutputItems("either", None)
    for piece in pieces:
        out.feed(piece, 1)
    out.finish(False)
    assert out.reasoning_tokens == want


# ---- request conversion ---------------------------------------------------------------------

def test_instructions_and_text_input_make_the_chat_prompt(info):
    req = parse(info, input="Hi", instructions="Be brief.")
    assert req.gen.prompt_texts == [info.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])]
    assert req.gen.chat and req.items == [{"type": "message", "role": "user", "content": "Hi"}]
    assert req.echo["instructions"] == "Be brief." and req.echo["tools"] == []


def test_function_call_items_become_the_chat_tool_turns(info):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    text = parse(info, input=items, tools=[WEATHER]).gen.prompt_texts[0]
    # The assistant turn holds its text and its call; the result is a tool response turn.
    assert "<|im_start|>assistant\nLet me look.\n<tool_call>\n" \
           '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tools_text_format_and_limits_map_onto_chat(info):
    fmt = {"type": "json_schema", "name": "c", "strict": True,
           "schema": {"type": "object", "properties": {"c": {"enum": ["red"]}}}}
    req = parse(info, input="x", text={"format": fmt}, max_output_tokens=7, temperature=0.5,
                top_p=0.9)
    p = req.gen.params
    assert (p.max_tokens, p.temperature, p.top_p) == (7, 0.5, 0.9)
    # strict: objects that leave additionalProperties unsaid are closed (chat's reading)
    assert json.loads(p.structured_outputs.json)["additionalProperties"] is False
    assert req.gen.constraint_param == "text"
    forced = parse(info, input="x", tools=[WEATHER], tool_choice={"type": "function",
                                                                 "name": "get_weather"})
    assert forced.gen.tools.choice == "get_weather" and forced.gen.constraint_param == \
        "tool_choice"


def test_reasoning_start_follows_the_server_parser(info):
    assert parse(info, input="x").gen.reasoning is None
    on = ServerConfig(reasoning_parser="deepseek_r1")
    assert parse(info, config=on, input="x").gen.reasoning == "reasoning"
    assert parse(info, config=on, input="x", text={"format": {"type": "json_object"}}) \
        .gen.reasoning == "content"


def test_previous_response_continues_the_stored_conversation(info):
    store = ResponseStore(2)
    first = parse(info, kept=store, input="Hi", instructions="Old rules.")
    store.put({"id": "resp_1"}, first.items + [
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Hello!"}]}])
    second = parse(info, kept=store, input="Again", previous_response_id="resp_1",
                   instructions="New rules.")
    assert second.gen.prompt_texts[0] == info.tokenizer.apply_chat_template([
        {"role": "system", "content": "New rules."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}])
    store.put({"id": "resp_2"}, [])
    store.put({"id": "resp_3"}, [])  # resp_1 is the least recently used: dropped
    assert store.get("resp_1") is None and len(store) == 2


ERRORS = [  # (id, body, param, code)
    ("no-input", {}, "input", "missing_field"),
    ("input-number", {"input": 3}, "input", None),
    ("item-type", {"input": [{"type": "image_generation_call"}]}, "input", "unsupported"),
    ("item-not-object", {"input": ["hi"]}, "input", None),
    ("bad-role", {"input": [{"role": "wizard", "content": "x"}]}, "input", None),
    ("image-part", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, "input", None),
    ("call-without-id", {"input": [{"type": "function_call", "name": "f",
                                    "arguments": "{}"}]}, "input", None),
    ("empty-input", {"input": []}, "input", None),
    ("hosted-tool", {"input": "x", "tools": [{"type": "web_search"}]}, "tools", "unsupported"),
    ("tool-choice-hosted", {"input": "x", "tools": [WEATHER],
                            "tool_choice": {"type": "file_search"}}, "tool_choice",
     "unsupported"),
    ("tool-choice-unknown", {"input": "x", "tools": [WEATHER],
                             "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", None),
    ("format-type", {"input": "x", "text": {"format": {"type": "xml"}}}, "text", None),
    ("schema-not-object", {"input": "x", "text": {"format": {"type": "json_schema",
                                                             "schema": 3}}}, "text", None),
    ("max-output-zero", {"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ("temperature", {"input": "x", "temperature": -1}, "temperature", None),
    ("background", {"input": "x", "background": True}, "background", "unsupported"),
    ("top-logprobs", {"input": "x", "top_logprobs": 3}, "top_logprobs", "unsupported"),
    ("truncation-auto", {"input": "x", "truncation": "auto"}, "truncation", "unsupported"),
    ("include", {"input": "x", "include": ["message.output_text.logprobs"]}, "include",
     "unsupported"),
    ("conversation", {"input": "x", "conversation": "conv_1"}, "conversation", "unsupported"),
    ("metadata", {"input": "x", "metadata": {"a": 1}}, "metadata", None),
    ("store-type", {"input": "x", "store": "yes"}, "store", None),
    ("instructions-type", {"input": "x", "instructions": ["x"]}, "instructions", None),
]


@pytest.mark.parametrize("body,param,code", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_bad_requests_name_the_responses_field(info, body, param, code):
    with pytest.raises(ApiError) as raised:
        parse(info, **body)
    err = raised.value
    assert (err.status, err.param, err.code) == (400, param, code), err.message
    assert "messages" not in err.message and "max_completion_tokens" not in err.message


def test_previous_response_not_found(info):
    with pytest.raises(ApiError) as raised:
        parse(info, input="x", previous_response_id="resp_nope")
    assert raised.value.status == 404 and "--max-stored-responses" in raised.value.message
    with pytest.raises(ApiError) as raised:
        parse(info, kept=ResponseStore(3), input="x", previous_response_id="resp_nope")
    assert raised.value.status == 404 and "--max-stored-responses" not in raised.value.message
