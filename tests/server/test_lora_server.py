"""LoRA adapters over HTTP: `model` selects an adapter, GET /v1/models lists them, the load and
unload routes, their errors, the lora_requests_info gauge, `serve --lora-modules` and the
page's model picker.

A tiny random chat model (jaxserve/testing/tiny_chat.py) with enable_lora, and random adapters
written in PEFT's file format (jaxserve/testing/peft_files.py) that the real loader
(models/lora_weights.py) reads: nothing is stubbed. What shows that the server applies the
adapter: its greedy output differs from the base model's and equals the engine's own output
for the same LoRARequest, computed before any server runs. One engine per module; each test
starts an engine loop and an HTTP server around it and leaves no adapter registered.
"""

import concurrent.futures as cf
import contextlib
import json
import os
import time
import types

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from jaxserve.cli import build_parser, main
from jaxserve.cli_lora import LoRAModule, load_lora_modules
from jaxserve.server import EngineLoop, ServerConfig
from jaxserve.server.metrics import lora_metrics
from http_server import serving
from jaxserve.testing.peft_files import write_adapter
from jaxserve.testing.tiny_chat import tiny_chat_model
from jaxserve.testing.tiny_models import TINY_CHAT

MODEL = "tiny-chat"
KEY = "lora-key"
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 1024  # room for a stream that outlives the checks made while it runs
BLOCK_SIZE = 256
MAX_LORA_RANK = 8
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def make_engine(**lora) -> LLMEngine:
    model = tiny_chat_model(seed=0)
    kv = 2 * MAX_NUM_SEQS * MAX_MODEL_LEN * TINY_CHAT.kv_bytes_per_token(4)
    # Blocks longer than any prompt here (no prefix-cache sharing between requests) and a
    # small token budget: few programs to warm up.
    return LLMEngine(EngineConfig(model=model.source, max_num_seqs=MAX_NUM_SEQS,
                                  max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
                                  block_size=BLOCK_SIZE, kv_cache_memory=kv, **lora),
                     model=model)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Adapter directories: two good ones, one of rank above max_lora_rank, one with broken
    JSON (the same weights as `sql`)."""
    root = tmp_path_factory.mktemp("adapters")
    write_adapter(root / "sql", TINY_CHAT, rank=8, targets=("q_proj", "v_proj"), seed=1)
    write_adapter(root / "poet", TINY_CHAT, rank=4, seed=2,
                  targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"))
    write_adapter(root / "wide", TINY_CHAT, rank=16, targets=("q_proj",), seed=3)
    write_adapter(root / "broken", TINY_CHAT, rank=8, targets=("q_proj", "v_proj"), seed=1)
    (root / "broken" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8,')
    return root


@pytest.fixture(scope="module")
def engine():
    return make_engine(warmup=True, enable_lora=True, max_loras=2, max_lora_rank=MAX_LORA_RANK)


def _generate(engine, prompt: str, lora: LoRARequest | None) -> str:
    params = SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"], ignore_eos=True)
    engine.add_request("ref", prompt, params, lora_request=lora)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                text = out.outputs[0].text
    return text


@pytest.fixture(scope="module")
def reference(engine, adapters):
    """The engine's own greedy texts (LLMEngine.add_request), before any loop owns it: the
    base model's and adapter `sql`'s (the LoRARequest the server will make: the first id)."""
    sql = LoRARequest("sql", 1, str(adapters / "sql"))
    chat_prompt = engine.model.tokenizer.apply_chat_template(CHAT)
    texts = {(kind, lora and lora.lora_name): _generate(engine, prompt, lora)
             for kind, prompt in (("completion", PROMPT), ("chat", chat_prompt))
             for lora in (None, sql)}
    engine.lora.remove("sql")  # the server loads it again, as a client would
    return types.SimpleNamespace(texts=texts, sql=sql)


@contextlib.contextmanager
def running(engine, **config):
    loop = EngineLoop(engine).start()
    try:
        with serving(loop, ServerConfig(served_model_name=MODEL, **config)) as s:
            s.loop = loop
            s.client = openai.OpenAI(base_url=s.url + "/v1", api_key=config.get("api_key") or
                                     "none", max_retries=0, timeout=120)
            yield s
    finally:
        loop.stop()
        if engine.lora is not None:  # the next test starts with no adapter
            for adapter in engine.lora.adapters():
                engine.lora.remove(adapter.lora_name)


@pytest.fixture
def server(engine, reference):
    with running(engine, api_key=KEY) as s:
        yield s


def post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url + path, data=data, headers=headers, timeout=120)


def load(server, name, path, key=KEY):
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                key)


def model_ids(server) -> list[str]:
    return [m.id for m in server.client.models.list().data]


def error_of(response) -> dict:
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def lora_info(server) -> list[dict]:
    text = requests.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=30).text
    return [dict(s.labels, value=s.value) for f in text_string_to_metric_families(text)
            if f.name == "vllm:lora_requests_info" for s in f.samples]


# ---- listing and selecting ----------------------------------------------------------------

def test_models_lists_the_base_and_each_adapter_with_its_parent(server, adapters):
    assert model_ids(server) == [MODEL]
    for name in ("sql", "poet"):
        assert load(server, name, adapters / name).status_code == 200
    cards = requests.get(server.url + "/v1/models", timeout=30,
                         headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert [(c["id"], c["object"], c["parent"], c["root"]) for c in cards] == [
        (MODEL, "model", None, MODEL),
        ("sql", "model", MODEL, str(adapters / "sql")),
        ("poet", "model", MODEL, str(adapters / "poet"))]
    assert all(c["owned_by"] == "jaxserve" for c in cards)
    assert cards[0]["max_model_len"] == MAX_MODEL_LEN


def test_load_use_unload_with_the_openai_client(server, adapters, reference, engine):
    client, texts = server.client, reference.texts
    assert texts["completion", "sql"] != texts["completion", None]  # the adapter matters
    assert texts["chat", "sql"] != texts["chat", None]
    done = client.post("/load_lora_adapter", cast_to=str,
                       body={"lora_name": "sql", "lora_path": str(adapters / "sql")})
    assert done == "Success: LoRA adapter 'sql' added successfully."
    assert engine.lora.get("sql") == reference.sql  # the same LoRARequest as the reference

    for name in ("sql", MODEL):  # the adapter, then the base model by its name
        key = "sql" if name == "sql" else None
        out = client.completions.create(model=name, prompt=PROMPT, **GREEDY)
        assert out.model == name and out.choices[0].text == texts["completion", key]
        chunks = list(client.completions.create(model=name, prompt=PROMPT, stream=True,
                                                **GREEDY))
        assert {c.model for c in chunks} == {name}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == \
            texts["completion", key]
        chat = client.chat.completions.create(model=name, messages=CHAT, **GREEDY)
        assert chat.model == name and chat.choices[0].message.content == texts["chat", key]
        chunks = list(client.chat.completions.create(model=name, messages=CHAT, stream=True,
                                                     **GREEDY))
        assert {c.model for c in chunks} == {name}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            texts["chat", key]

    done = client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "sql"})
    assert done == "Success: LoRA adapter 'sql' removed successfully."
    assert model_ids(server) == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found"
    metric = requests.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30).text
    assert "jaxserve_compiles_after_warmup_total 0.0" in metric  # a slot write recompiles nothing


def test_two_adapters_and_the_base_in_one_batch(server, adapters, reference):
    """Concurrent requests of two adapters and the base model each get their own output."""
    for name in ("sql", "poet"):
        assert load(server, name, adapters / name).status_code == 200
    names = ["sql", "poet", MODEL] * 2
    with cf.ThreadPoolExecutor(len(names)) as pool:
        outs = list(pool.map(lambda n: server.client.completions.create(
            model=n, prompt=PROMPT, **GREEDY).choices[0].text, names))
    assert outs[:3] == outs[3:]
    assert outs[0] == reference.texts["completion", "sql"]
    assert outs[2] == reference.texts["completion", None]
    assert len(set(outs[:3])) == 3  # poet differs from both


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True})])
def test_unknown_model_is_404_model_not_found(server, path, body):
    r = post(server, path, {"model": "no-such-adapter", **body})
    err = error_of(r)
    assert r.status_code == 404 and err["code"] == "model_not_found"
    assert err["type"] == "not_found_error" and err["param"] == "model"
    assert "'no-such-adapter'" in err["message"] and repr(MODEL) in err["message"]


# ---- load and unload: errors change nothing --------------------------------------------------

@pytest.mark.parametrize("name,directory,says", [
    ("gone", "missing", "LoRA adapter directory not found"),
    ("broken", "broken", "invalid JSON"),
    ("wide", "wide", f"rank 16 exceeds max_lora_rank {MAX_LORA_RANK}"),
])
def test_bad_adapter_is_400_naming_the_problem(server, adapters, name, directory, says):
    assert load(server, "sql", adapters / "sql").status_code == 200
    before = model_ids(server)
    r = load(server, name, adapters / directory)
    err = error_of(r)
    assert r.status_code == 400 and err["code"] == "invalid_lora_adapter", r.text
    assert says in err["message"] and str(adapters / directory) in err["message"], err
    assert model_ids(server) == before == [MODEL, "sql"]
    r = post(server, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404


@pytest.mark.parametrize("body,param,says", [
    ({"lora_name": "sql"}, "lora_path", "required"),
    ({"lora_path": "/x"}, "lora_name", "required"),
    ({"lora_name": "", "lora_path": "/x"}, "lora_name", "must not be empty"),
    ({"lora_name": 3, "lora_path": "/x"}, "lora_name", "must be a string"),
    ({"lora_name": "a", "lora_path": "/" * 5000}, "lora_path", "at most 4096"),
    ({"lora_name": "sql", "lora_path": "SQL"}, None, "already loaded"),
    ({"lora_name": MODEL, "lora_path": "SQL"}, None, "the base model's name"),
])
def test_load_arguments_are_checked(server, adapters, body, param, says):
    assert load(server, "sql", adapters / "sql").status_code == 200
    if body.get("lora_path") == "SQL":
        body = {**body, "lora_path": str(adapters / "sql")}
    r = post(server, "/v1/load_lora_adapter", body)
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == param and says in err["message"], err
    assert model_ids(server) == [MODEL, "sql"]


def test_unload_unknown_is_404_and_ids_must_agree(server, adapters):
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    r = post(server, "/v1/unload_lora_adapter", {"lora_int_id": 42})
    assert r.status_code == 404 and "42" in error_of(r)["message"]
    r = post(server, "/v1/unload_lora_adapter", {})
    assert r.status_code == 400 and error_of(r)["code"] == "missing_field"
    assert load(server, "sql", adapters / "sql").status_code == 200
    assert load(server, "poet", adapters / "poet").status_code == 200
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "sql", "lora_int_id": 2})
    assert r.status_code == 400 and "has lora_int_id 1" in error_of(r)["message"]
    r = post(server, "/v1/unload_lora_adapter", {"lora_int_id": 2})  # vLLM's other key
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'poet' removed " \
                                              "successfully."
    assert model_ids(server) == [MODEL, "sql"]
    # A new adapter never takes an unloaded one's id (the prefix cache keys blocks by id).
    assert load(server, "poet", adapters / "poet").status_code == 200
    r = post(server, "/v1/unload_lora_adapter", {"lora_int_id": 3})
    assert r.status_code == 200 and "'poet'" in r.text


def test_unload_while_streaming_is_409_and_the_stream_finishes(server, adapters):
    assert load(server, "sql", adapters / "sql").status_code == 200
    max_tokens = MAX_MODEL_LEN - 16  # seconds of decoding: outlives the checks below
    stream = server.client.completions.create(
        model="sql", prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    deadline = time.monotonic() + 30
    while not any(s["running_lora_adapters"] == "sql" for s in lora_info(server)):
        assert time.monotonic() < deadline, lora_info(server)
        time.sleep(0.02)
    [info] = lora_info(server)
    assert info["max_lora"] == "2" and info["waiting_lora_adapters"] == ""
    assert abs(info["value"] - time.time()) < 60  # a timestamp, as vLLM sets it
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    err = error_of(r)
    assert r.status_code == 409 and err["code"] == "lora_adapter_in_use", err
    assert "in use by 1 unfinished request" in err["message"]
    assert model_ids(server) == [MODEL, "sql"]
    chunks += list(stream)
    assert chunks[-1].usage.completion_tokens == max_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
    [info] = lora_info(server)
    assert info["running_lora_adapters"] == "" and info["waiting_lora_adapters"] == ""


def test_lora_routes_need_the_api_key(server, adapters):
    for key in (None, "wrong"):
        r = load(server, "sql", adapters / "sql", key=key)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    assert model_ids(server) == [MODEL]
    assert load(server, "sql", adapters / "sql").status_code == 200
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"}, key=None)
    assert r.status_code == 401
    assert model_ids(server) == [MODEL, "sql"]


# ---- a server without --enable-lora ---------------------------------------------------------

def test_server_without_enable_lora(adapters):
    engine = make_engine(warmup=False)  # nothing here generates: nothing to compile
    with running(engine) as s:
        r = post(s, "/v1/load_lora_adapter", {"lora_name": "sql",
                                              "lora_path": str(adapters / "sql")}, key=None)
        err = error_of(r)
        assert r.status_code == 400 and "--enable-lora" in err["message"], err
        r = post(s, "/v1/unload_lora_adapter", {"lora_name": "sql"}, key=None)
        assert r.status_code == 400 and "--enable-lora" in error_of(r)["message"]
        r = post(s, "/v1/completions", {"model": "sql", "prompt": PROMPT, "max_tokens": 2},
                 key=None)
        assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
        assert model_ids(s) == [MODEL]
        assert "lora_requests_info" not in requests.get(s.url + "/metrics", timeout=30).text


def test_lora_requests_info_labels_and_value():
    stats = {"max_lora": 4, "running_lora_adapters": ["a", "b"],
             "waiting_lora_adapters": ["c"], "loaded": 3, "in_host_memory": 3,
             "device_loads": 5, "host_loads": 3}
    info, *rest = lora_metrics(stats, now=lambda: 1234.5)
    [sample] = info.samples
    assert sample.name == "vllm:lora_requests_info" and sample.value == 1234.5
    assert sample.labels == {"max_lora": "4", "waiting_lora_adapters": "c",
                             "running_lora_adapters": "a,b"}
    assert {f.name: f.samples[0].value for f in rest} == {
        "jaxserve_lora_adapters_loaded": 3, "jaxserve_lora_device_loads": 5,
        "jaxserve_lora_host_loads": 3}
    assert list(lora_metrics(None)) == []


# ---- serve --enable-lora --lora-modules ------------------------------------------------------

def test_lora_modules_take_both_of_vllms_forms():
    args = build_parser().parse_args([
        "serve", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
        "--max-cpu-loras", "4", "--lora-modules", "a=/x/a",
        '{"name": "b", "path": "/x/b", "base_model_name": "m"}', "--lora-modules", "c = /x/c"])
    assert args.lora_modules == [LoRAModule("a", "/x/a"), LoRAModule("b", "/x/b", "m"),
                                 LoRAModule("c", "/x/c")]
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == \
        (True, 3, 32, 4)


@pytest.mark.parametrize("value,says", [
    ("sql", "expected NAME=PATH or a JSON object"),
    ("=/x", "expected NAME=PATH"),
    ("sql=", "expected NAME=PATH"),
    ('{"name": "sql"', "invalid JSON"),
    ('{"name": "sql"}', "'path' must be a non-empty string"),
    ('{"name": "sql", "path": "/x", "rank": 8}', "unknown key(s) ['rank']"),
    ('{"name": "sql", "path": "/x", "base_model_name": 3}', "'base_model_name' must be a "),
])
def test_bad_lora_module_values_exit_2(value, says, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", value])
    assert e.value.code == 2
    assert "argument --lora-modules" in (err := capsys.readouterr().err) and says in err, err


@pytest.mark.parametrize("argv,says", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--data-parallel-size", "2"],
     "--enable-lora with --data-parallel-size is not supported yet"),
    (["--enable-lora", "--lora-modules", "a=/x", "b=/y", "a=/z"], "names adapter 'a' twice"),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"],
     "adapter name 'm' is the served model's name"),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules",
      '{"name": "a", "path": "/x", "base_model_name": "other"}'],
     "base_model_name 'other' is not the served model ('m')"),
    (["--enable-lora", "--lora-modules", "a=/x", "--distributed-executor-backend", "ray"],
     "LoRA adapters are served on one host"),
])
def test_lora_flags_that_cannot_go_together_exit_2(argv, says, capsys):
    assert main(["serve", *argv]) == 2  # before any model is read
    assert says in capsys.readouterr().err


@pytest.fixture
def tiny_serve(monkeypatch):
    """`serve` building a tiny engine (no warm-up) and, instead of serving, recording what it
    would serve."""
    import jaxserve
    import jaxserve.server
    served = []

    def engine(config):
        return make_engine(warmup=False, enable_lora=config.enable_lora,
                           max_loras=config.max_loras, max_lora_rank=config.max_lora_rank)

    def serve(engine, host, port, config):
        served.append((engine, engine.lora.adapters(), config.served_model_name))
        engine.close()
        return 0
    monkeypatch.setattr(jaxserve, "LLMEngine", engine)
    monkeypatch.setattr(jaxserve.server, "serve", serve)
    return served


def test_lora_modules_are_loaded_at_start_with_ids_in_order(tiny_serve, adapters):
    sql, poet = adapters / "sql", adapters / "poet"
    assert main(["serve", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank",
                 str(MAX_LORA_RANK), "--lora-modules", f"sql={sql}",
                 json.dumps({"name": "poet", "path": str(poet), "base_model_name": "tiny"})]) == 0
    [(_, loaded, name)] = tiny_serve
    assert name == "tiny"
    assert loaded == [LoRARequest("sql", 1, str(sql)), LoRARequest("poet", 2, str(poet))]


def test_a_bad_start_up_adapter_stops_serve_with_its_message(tiny_serve, adapters, capsys):
    wide = adapters / "wide"
    assert main(["serve", "tiny", "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK),
                 "--lora-modules", f"sql={adapters / 'sql'}", f"wide={wide}"]) == 2
    err = capsys.readouterr().err
    assert f"error: --lora-modules wide={wide}: " in err
    assert f"rank 16 exceeds max_lora_rank {MAX_LORA_RANK}" in err
    assert tiny_serve == []  # never served


def test_ids_follow_the_start_up_adapters(adapters):
    """Adapters loaded over HTTP continue after the --lora-modules ids (1, 2, ...)."""
    engine = make_engine(warmup=False, enable_lora=True, max_loras=2,
                         max_lora_rank=MAX_LORA_RANK)
    load_lora_modules(engine.lora, [LoRAModule("sql", str(adapters / "sql"))])
    with running(engine) as s:
        assert load(s, "poet", adapters / "poet", key=None).status_code == 200
        assert engine.lora.get("poet").lora_int_id == 2
        assert model_ids(s) == [MODEL, "sql", "poet"]
    engine.close()


# ---- the web page's model picker (marker `browser`) -----------------------------------------

CHROMIUM = os.environ.get("JAXSERVE_CHROMIUM", "/usr/bin/chromium")


@pytest.mark.browser
def test_page_picks_an_adapter(server, adapters):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (scripts/setup.sh --test installs Debian's)")
    assert load(server, "sql", adapters / "sql").status_code == 200
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context()
        context.add_init_script(f"sessionStorage.setItem('jaxserve.apiKey', {json.dumps(KEY)})")
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        page.wait_for_function("document.querySelectorAll('#model option').length === 2",
                               timeout=60_000)
        options = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
        labels = page.eval_on_selector_all("#model option", "os => os.map(o => o.text)")
        assert options == [MODEL, "sql"] and labels == [MODEL, "sql (LoRA adapter)"]
        page.select_option("#model", "sql")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", str(GREEDY["max_tokens"]))
        page.fill("#prompt", CHAT[0]["content"])
        page.press("#prompt", "Enter")
        page.wait_for_selector("li.msg.assistant[data-done=true]", timeout=60_000)
        text = page.locator("li.msg.assistant .text").first.inner_text()
        browser.close()
    assert errors == []
    # The page sent `model: "sql"`: its greedy reply is the adapter's, not the base model's.
    def reply(model):
        out = server.client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                                    max_tokens=GREEDY["max_tokens"])
        return out.choices[0].message.content.strip()
    assert text.strip() == reply("sql") != reply(MODEL)
