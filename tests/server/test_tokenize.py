"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's routes) on the tiny chat
model: ids against an independent `tokenizers` instance of the same tokenizer, chat prompts
against the text the template must give and against what /v1/chat/completions feeds the
engine, round trips, and every bad input a 400 (or 401/404) naming its field. Flask's test
client; nothing here generates, so the engine is not warmed up."""

import copy

import pytest
from tokenizers import Tokenizer as HFTokenizer

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig, create_app
from jaxserve.server.fields import Fields
from jaxserve.server.protocol import ModelInfo, parse_chat
from jaxserve.server.tokenize_routes import _prompt_ids
from jaxserve.testing.tiny_chat import CHAT_TEMPLATE, tiny_chat_model, tiny_tokenizer
from jaxserve.testing.tiny_models import TINY_CHAT

MODEL = "tiny-chat"
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 64
TEXT = "The capital of France is Paris. Roses are red!"
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."}]
# What the tiny ChatML template must render for CHAT (written out, not rendered).
CHAT_TEXT = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour."
             "<|im_end|>\n")
GENERATION = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def loop():
    model = tiny_chat_model(seed=0)
    engine = LLMEngine(EngineConfig(
        model=model.source, warmup=False, max_num_seqs=2, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=16, block_size=MAX_MODEL_LEN, structured_outputs=False,
        kv_cache_memory=4 * MAX_MODEL_LEN * TINY_CHAT.kv_bytes_per_token(4)), model=model)
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


def app_client(loop, **config):
    app = create_app(loop, ServerConfig(served_model_name=MODEL, api_key=KEY, **config))
    return app.test_client()


@pytest.fixture(scope="module")
def client(loop):
    return app_client(loop)


@pytest.fixture(scope="module")
def hf():
    """The same tokenizer as a plain `tokenizers` object: the independent reference."""
    return HFTokenizer.from_str(tiny_tokenizer().to_json())


def post(client, path, body):
    return client.post(path, json=body, headers=AUTH)


def test_tokenize_prompt_matches_the_tokenizer(client, hf):
    r = post(client, "/tokenize", {"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.get_json()
    body = r.get_json()
    want = hf.encode(TEXT, add_special_tokens=False).ids
    assert len(want) > 5
    assert body == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want,
                    "token_strs": None}
    assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]  # vLLM's order
    strs = post(client, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).get_json()
    assert strs["tokens"] == want  # `model` is optional
    assert strs["token_strs"] == [hf.id_to_token(i) for i in want]
    # What lm-eval's remote tokenizer sends; special tokens in the text are matched whole.
    eos = post(client, "/tokenize", {"prompt": "<|endoftext|>", "add_special_tokens": False})
    assert eos.get_json()["tokens"] == [hf.token_to_id("<|endoftext|>")] == [0]
    empty = post(client, "/tokenize", {"prompt": ""}).get_json()
    assert empty["count"] == 0 and empty["tokens"] == []


def test_tokenize_chat_renders_the_template(client, hf, loop):
    r = post(client, "/tokenize", {"model": MODEL, "messages": CHAT})
    assert r.status_code == 200, r.get_json()
    ids = r.get_json()["tokens"]
    assert ids == hf.encode(CHAT_TEXT + GENERATION, add_special_tokens=False).ids
    assert ids[0] == hf.token_to_id("<|im_start|>") and r.get_json()["count"] == len(ids)
    # Exactly the prompt /v1/chat/completions hands the engine for the same messages.
    served = loop.model
    info = ModelInfo(served.tokenizer, served.vocab_size, served.max_model_len)
    chat = parse_chat({"model": MODEL, "messages": CHAT, "max_tokens": 1},
                      ServerConfig(served_model_name=MODEL), info)
    assert chat.prompts == [ids]
    bare = post(client, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert bare.get_json()["tokens"] == hf.encode(CHAT_TEXT, add_special_tokens=False).ids


def test_tokenize_chat_continues_the_final_message(client, hf):
    prefill = CHAT + [{"role": "assistant", "content": "Gre"}]
    r = post(client, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                   "continue_final_message": True})
    assert r.status_code == 200, r.get_json()
    text = CHAT_TEXT + "<|im_start|>assistant\nGre"  # no <|im_end|> after the prefill
    assert r.get_json()["tokens"] == hf.encode(text, add_special_tokens=False).ids
    both = post(client, "/tokenize", {"messages": prefill, "continue_final_message": True})
    assert both.status_code == 400
    assert both.get_json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("text", [TEXT, "def add(a, b):\n    return a + b\n", "  x  y  ",
                                  "<|im_start|>user\nhi<|im_end|>"])
def test_round_trip(client, hf, text):
    ids = post(client, "/tokenize", {"prompt": text}).get_json()["tokens"]
    r = post(client, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.get_json()
    assert r.get_json() == {"prompt": text}
    assert hf.decode(ids, skip_special_tokens=False) == text


def test_detokenize_matches_the_tokenizer(client, hf):
    ids = [5, 17, 200, 1, 2, 0, 255]  # specials are kept, as vLLM's detokenize keeps them
    r = post(client, "/detokenize", {"tokens": ids})
    assert r.get_json()["prompt"] == hf.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in r.get_json()["prompt"]
    assert post(client, "/detokenize", {"tokens": []}).get_json() == {"prompt": ""}


VOCAB = TINY_CHAT.vocab_size
BAD = [  # (id, path, body, status, param)
    ("not-an-object", "/tokenize", [1, 2], 400, None),
    ("neither", "/tokenize", {"model": MODEL}, 400, "prompt"),
    ("both", "/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("prompt-not-text", "/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("special-not-bool", "/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400,
     "add_special_tokens"),
    ("strs-not-bool", "/tokenize", {"prompt": "x", "return_token_strs": 1}, 400,
     "return_token_strs"),
    ("messages-not-list", "/tokenize", {"messages": "hi"}, 400, "messages"),
    ("messages-bad-role", "/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages"),
    ("unknown-model", "/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("model-not-text", "/tokenize", {"model": 7, "prompt": "x"}, 400, "model"),
    ("missing-tokens", "/detokenize", {"model": MODEL}, 400, "tokens"),
    ("tokens-not-list", "/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("id-over-vocab", "/detokenize", {"tokens": [1, VOCAB]}, 400, "tokens"),
    ("id-negative", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("id-huge", "/detokenize", {"tokens": [10 ** 30]}, 400, "tokens"),
    ("id-float", "/detokenize", {"tokens": [1.5]}, 400, "tokens"),
    ("id-bool", "/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("id-text", "/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("too-many", "/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)}, 400, "tokens"),
    ("unknown-model", "/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
]


@pytest.mark.parametrize("case", BAD, ids=[f"{c[1][1:]}-{c[0]}" for c in BAD])
def test_bad_input_is_refused(client, case):
    _, path, body, status, param = case
    r = post(client, path, body)
    assert r.status_code == status, r.get_json()
    assert r.get_json()["error"]["param"] == param


def test_bad_json_and_no_key(client):
    r = client.post("/tokenize", data=b'{"prompt": ', headers=AUTH)
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "invalid_json"
    for path in ("/tokenize", "/detokenize"):
        r = client.post(path, json={"prompt": "x", "tokens": [1]})
        assert r.status_code == 401, path
    assert client.get("/tokenizer_info").status_code == 401


def test_tokenizer_info_is_opt_in(client, loop, hf):
    r = client.get("/tokenizer_info", headers=AUTH)
    assert r.status_code == 404
    assert "--enable-tokenizer-info-endpoint" in r.get_json()["error"]["message"]
    r = app_client(loop, enable_tokenizer_info_endpoint=True).get("/tokenizer_info",
                                                                  headers=AUTH)
    assert r.status_code == 200
    info = r.get_json()
    assert info["eos_token"] == "<|endoftext|>" == hf.id_to_token(0)
    assert info["bos_token"] is None and info["chat_template"] == CHAT_TEMPLATE
    assert info["model_max_length"] == MAX_MODEL_LEN and info["tokenizer_class"]


def test_add_special_tokens_adds_the_models_bos():
    """A model that starts prompts with BOS (Llama's) gets it from `add_special_tokens`, by
    default for text and on request for a chat (whose template writes its own)."""
    tok = copy.copy(tiny_tokenizer())
    tok.add_bos, tok.bos_token_id = True, 1
    info = ModelInfo(tok, VOCAB, MAX_MODEL_LEN)
    plain = tok.encode(TEXT)
    assert _prompt_ids(Fields({"prompt": TEXT}), info) == [1] + plain
    assert _prompt_ids(Fields({"prompt": TEXT, "add_special_tokens": False}), info) == plain
    chat = tok.encode(CHAT_TEXT + GENERATION)
    assert _prompt_ids(Fields({"messages": CHAT}), info) == chat
    assert _prompt_ids(Fields({"messages": CHAT, "add_special_tokens": True}), info) == \
        [1] + chat
