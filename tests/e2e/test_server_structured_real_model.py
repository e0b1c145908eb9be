"""The official `openai` client, unchanged, against the real SmolLM2: `parse()` with a pydantic
model, tool round trips (tools -> tool call -> tool result -> answer) with tool_choice
auto, required and named, streaming and not, and scripts/structured_check.py's schemas and
forced tool calls (every output valid, or cut at max_tokens)."""

import concurrent.futures
import importlib.util
import json
import pathlib

import openai
import pydantic
import pytest

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig
from http_server import serving

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "system", "content": "You answer questions by calling functions."},
       {"role": "user", "content": "What is the weather like in Paris today?"}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=100)


SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "structured_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("structured_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def client(smollm2_fp32):
    engine = LLMEngine(EngineConfig(model=smollm2_fp32.source, warmup=False, max_num_seqs=4,
                                    max_model_len=1024, max_num_batched_tokens=256),
                       model=smollm2_fp32)
    loop = EngineLoop(engine).start()
    try:
        with serving(loop, ServerConfig(served_model_name=MODEL)) as server:
            yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=300)
    finally:
        loop.stop()


def test_parse_returns_a_pydantic_object(client):
    out = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=80, temperature=0.8, seed=1)
    city = out.choices[0].message.parsed
    assert isinstance(city, City), out.choices[0].message.content
    assert City.model_validate_json(out.choices[0].message.content) == city


# One earlier exchange in the conversation, so a 135M model sees what calling looks like
# (with tool_choice "auto" nothing forces the format).
EXAMPLE = [
    {"role": "user", "content": "What is the weather like in Rome today?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "Cloudy, 18 C"},
    {"role": "assistant", "content": "It is cloudy in Rome, 18 C."},
    {"role": "user", "content": "What is the weather like in Oslo today?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -2 C"},
    {"role": "assistant", "content": "It is snowing in Oslo, -2 C."}]


def _call(client, tool_choice, stream: bool):
    messages = ASK[:1] + EXAMPLE + ASK[1:] if tool_choice == "auto" else ASK
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER], tool_choice=tool_choice,
              max_tokens=80, temperature=0.0, parallel_tool_calls=False)
    if not stream:
        out = client.chat.completions.create(**kw)
        msg = out.choices[0].message
        return ([(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or []],
                msg.content, out.choices[0].finish_reason)
    calls, text, finish = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", "", ""])
                entry[0] += d.id or ""
                entry[1] += d.function.name or ""
                entry[2] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return [tuple(v) for v in calls.values()], text or None, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice", ["auto", "required", "named"])
def test_tool_round_trip(client, tool_choice, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}} \
        if tool_choice == "named" else tool_choice
    calls, content, finish = _call(client, choice, stream)
    print(tool_choice, stream, calls, repr(content), finish)
    if tool_choice != "auto":
        assert finish == "tool_calls" and calls
    if calls:
        assert finish == "tool_calls"
        for call_id, name, args in calls:
            assert call_id.startswith("call_") and name == "get_weather"
            assert isinstance(json.loads(args)["city"], str)
    else:  # auto: the model may answer in text; that answer is then the whole turn
        assert content
        return
    messages = ASK + [
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls]}]
    messages += [{"role": "tool", "tool_call_id": i, "content": "Sunny, 24 C"}
                 for i, _, _ in calls]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                           tool_choice="none", max_tokens=30, temperature=0.0)
    answer = final.choices[0].message
    assert answer.content and not answer.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_schemas_validate_or_end_at_length(client, check, temperature):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rows = list(pool.map(lambda case: check.check_schema(client, case, temperature, 0, 200),
                             check.SCHEMAS))
    assert [r for r in rows if r["outcome"] not in ("valid", "length")] == []
    outcome = {r["case"]: r["outcome"] for r in rows}
    # The cases: unsaid additionalProperties under strict used to run on with
    # properties the schema never named.
    assert outcome["ok-note"] == outcome["enums"] == "valid", rows
    assert sum(o == "valid" for o in outcome.values()) >= len(rows) // 2, rows


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_forced_tool_calls_always_come_back_as_valid_calls(client, check, temperature):
    cases = [c for c in check.TOOL_CASES if c[0] in ("required-one", "required-two", "named")]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rows = list(pool.map(lambda job: check.check_tools(client, *job, temperature, 0, 256),
                             [(case, stream) for case in cases for stream in (False, True)]))
    assert [(r["case"], r["stream"], r["outcome"]) for r in rows if r["outcome"] != "valid"] \
        == [], rows
