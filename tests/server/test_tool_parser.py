"""The Hermes tool-call parser (server/tool_parser.py): a JSON scanner, not a split at tags.

Whole outputs and any split into stream deltas give the same calls; a stream names a call
before any of its argument fragments; tags, braces, quotes and escapes inside JSON strings
stay in the strings."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.server.tool_parser import CLOSE, OPEN, ToolCallParser, join_deltas, \
    parse_tool_calls

NAMES = {"get_weather", "get_time"}


def streamed(text: str, step: int, names=NAMES) -> tuple[str, list[dict], list[dict]]:
    """(content, joined calls, raw deltas) of `text` fed `step` characters at a time."""
    parser, content, deltas = ToolCallParser(names), "", []
    for i in range(0, len(text), step):
        c, d = parser.feed(text[i:i + step])
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    return content + c, join_deltas(deltas + d), deltas + d


def functions(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def block(obj) -> str:
    return f"{OPEN}\n{obj if isinstance(obj, str) else json.dumps(obj)}\n{CLOSE}"


def assert_stream_equals_whole(text: str, names=NAMES) -> None:
    content, calls = parse_tool_calls(text, names)
    for step in (1, 2, 3, 7, len(text) or 1):
        got_content, got_calls, deltas = streamed(text, step, names)
        assert functions(got_calls) == functions(calls), step
        # Exactly the whole response's content, or the text itself when it holds no call.
        assert got_content == (content or "" if calls else text), step
        seen = set()
        for d in deltas:  # the name (with the id) comes first, then only argument fragments
            if d["index"] not in seen:
                assert d["id"].startswith("call_") and d["function"]["arguments"] == ""
                seen.add(d["index"])
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}


def test_whole_output_calls_and_content():
    text = ('Let me check.\n' + block({"name": "get_weather", "arguments": {"city": "Rome"}})
            + "\n" + block({"name": "nope", "arguments": {}}) + "\n"
            + f'{OPEN}\n{{"name": "get_time", "arguments": {{"city": "Oslo"}}}}')  # unclosed
    content, calls = parse_tool_calls(text, NAMES)
    assert functions(calls) == [("get_weather", '{"city": "Rome"}'),
                                ("get_time", '{"city": "Oslo"}')]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert content.startswith("Let me check.") and '"nope"' in content
    assert_stream_equals_whole(text)


ADVERSARIAL = [
    f"{CLOSE}",                          # the closing tag inside a string (the bug)
    f">PARIS{CLOSE}}}, ",                # the model's own case: tag and brace in the string
    f"{OPEN}{{\"name\": \"get_time\"}}",  # a whole nested call, as text
    '"}" \\ \\" {[(',                     # quotes, escapes and brackets
    "line\nbreak\ttab \u00e9\u4e2d",
]


@pytest.mark.parametrize("value", ADVERSARIAL)
def test_tags_braces_and_quotes_inside_strings_stay_in_the_arguments(value):
    args = {"city": value, "nested": {"list": [value, {"k": value}]}}
    text = "ok " + block({"name": "get_weather", "arguments": args}) + " bye"
    content, calls = parse_tool_calls(text, NAMES)
    assert [json.loads(a) for _, a in functions(calls)] == [args]
    assert content.split() == ["ok", "bye"]
    assert_stream_equals_whole(text)


def test_a_tag_inside_a_string_of_a_plain_text_answer_is_not_a_call():
    text = 'He typed "<tool_call>" and left.'
    assert parse_tool_calls(text, NAMES) == (text, [])
    assert parse_tool_calls("plain <tool_ text", NAMES) == ("plain <tool_ text", [])


@pytest.mark.parametrize("text,want_calls,want_content", [
    # arguments before the name: the call waits for its name, then sends what it holds
    (block('{"arguments": {"city": "a"}, "name": "get_time"}') + " after",
     [("get_time", '{"city": "a"}')], "after"),
    # arguments as a JSON string (some models): the string's content is the arguments
    (block(json.dumps({"name": "get_time", "arguments": '{"city": "X"}'})),
     [("get_time", '{"city": "X"}')], None),
    # "parameters" instead of "arguments"; no arguments at all
    (block('{"name": "get_time", "parameters": {"n": 1}}') + block('{"name": "get_weather"}'),
     [("get_time", '{"n": 1}'), ("get_weather", "{}")], None),
    # literals, and junk after the object: the call stands, the junk stays as content
    (f'{OPEN}{{"name": "get_time", "arguments": {{"n": 5, "b": true}}, "x": null}}}}}}{CLOSE} t',
     [("get_time", '{"n": 5, "b": true}')], f"}}}}{CLOSE} t"),
    # not a JSON object, an unknown name, an empty block: all content, as written
    (f"{OPEN} not json {CLOSE} ok", [], f"{OPEN} not json {CLOSE} ok"),
    (block({"name": "nope", "arguments": {}}), [], block({"name": "nope", "arguments": {}})),
    (f"{OPEN}{CLOSE}", [], f"{OPEN}{CLOSE}"),
    # two calls separated by whitespace: no content between them
    (block({"name": "get_time", "arguments": {}}) + "\n\n" +
     block({"name": "get_time", "arguments": {"a": [1, {"b": "}"}]}}),
     [("get_time", "{}"), ("get_time", '{"a": [1, {"b": "}"}]}')], None),
])
def test_odd_blocks(text, want_calls, want_content):
    content, calls = parse_tool_calls(text, NAMES)
    assert functions(calls) == want_calls
    assert (content.strip() if content else content) == want_content
    assert_stream_equals_whole(text)


@pytest.mark.parametrize("lead", ["\n", " \n\n", "\t"])
def test_whitespace_around_calls_is_content_of_neither_a_stream_nor_a_whole_output(lead):
    call = block({"name": "get_time", "arguments": {}})
    for text in (lead + call, lead + call + lead + call + lead):
        assert parse_tool_calls(text, NAMES)[0] is None
        for step in (1, 2, len(text)):
            assert streamed(text, step)[0] == ""
    # before text or a block that is no call, whitespace stays, in both
    text = lead + block({"name": "nope"}) + lead + "ok" + lead + call
    content = parse_tool_calls(text, NAMES)[0]
    assert content == lead + block({"name": "nope"}) + lead + "ok"
    assert all(streamed(text, step)[0] == content for step in (1, 3, len(text)))


def test_arguments_stream_as_fragments_while_they_are_generated():
    text = block({"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3]}})
    _, calls, deltas = streamed(text, 2)
    fragments = [d["function"]["arguments"] for d in deltas[1:]]
    assert deltas[0]["function"]["name"] == "get_weather"
    assert len(fragments) > 10 and "".join(fragments) == calls[0]["function"]["arguments"]


def test_a_cut_inside_the_arguments_keeps_the_call_with_what_arrived():
    text = block({"name": "get_weather", "arguments": {"city": "Par"}})[:-len(CLOSE) - 4]
    content, calls = parse_tool_calls(text, NAMES)
    assert functions(calls) == [("get_weather", '{"city": "Par')] and content is None
    assert_stream_equals_whole(text)
    cut_before_name = f'{OPEN}\n{{"name": "get_we'
    assert parse_tool_calls(cut_before_name, NAMES) == (cut_before_name, [])


JSON_TEXT = st.lists(st.sampled_from(list('<>/{}[]"\\:, \n') + [OPEN, CLOSE, "a", "é"]),
                     max_size=12).map("".join)
ARGS = st.recursive(st.none() | st.booleans() | st.integers() | JSON_TEXT,
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(JSON_TEXT, inner, max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(args=st.dictionaries(JSON_TEXT, ARGS, max_size=4), step=st.integers(1, 9),
       before=JSON_TEXT.filter(lambda s: "<" not in s), indent=st.sampled_from([None, 2]))
def test_any_arguments_come_back_exactly(args, step, before, indent):
    obj = {"name": "get_time", "arguments": args}
    text = before + block(json.dumps(obj, indent=indent))
    content, calls, _ = streamed(text, step)
    assert [json.loads(a) for _, a in functions(calls)] == [args]
    assert content == before.rstrip(" \t\r\n")  # the whitespace before the call dropped
    assert functions(parse_tool_calls(text, NAMES)[1]) == functions(calls)
