"""Security of the HTTP surface: with an API key set, every route but the open ones (health
and the web page's static files) refuses a request without it, including routes added later
(the test walks the app's url_map); the key check is constant-time; no route reads a file
named by the request (but POST /v1/load_lora_adapter on a server started with --enable-lora,
tests/server/test_lora_server.py). Flask's test client over a tiny chat model (no compile
needed: nothing here generates)."""

import hmac
import inspect

import pytest

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig, create_app
from jaxserve.server import app as app_module
from jaxserve.server.app import OPEN_ENDPOINTS
from jaxserve.testing.tiny_chat import tiny_chat_model
from jaxserve.testing.tiny_models import TINY_CHAT

KEY = "s3cret"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model = tiny_chat_model(seed=0)
    engine = LLMEngine(EngineConfig(
        model=model.source, warmup=False, max_num_seqs=2, max_model_len=64,
        max_num_batched_tokens=16, block_size=64, structured_outputs=False,
        profile_dir=str(tmp_path_factory.mktemp("profiles")),
        kv_cache_memory=4 * 64 * TINY_CHAT.kv_bytes_per_token(4)), model=model)
    loop = EngineLoop(engine).start()
    yield create_app(loop, ServerConfig(served_model_name="tiny-chat", api_key=KEY))
    loop.stop()


def _example_path(rule) -> str:
    return rule.build({name: "x" for name in rule.arguments})[1]


def _method(rule) -> str:
    return sorted(rule.methods - {"HEAD", "OPTIONS"})[0]


def test_every_route_but_the_open_ones_needs_the_key(app):
    client, rules = app.test_client(), list(app.url_map.iter_rules())
    assert {r.endpoint for r in rules} >= OPEN_ENDPOINTS | {
        "metrics", "start_profile", "stop_profile", "engine_state", "load_lora_adapter",
        "unload_lora_adapter"}
    for rule in rules:
        path, method = _example_path(rule), _method(rule)
        r = client.open(path, method=method)
        if rule.endpoint in OPEN_ENDPOINTS:
            assert r.status_code != 401, (rule, r.status_code)
            continue
        assert r.status_code == 401, (rule, r.status_code)
        assert r.get_json()["error"]["code"] == "invalid_api_key"
        wrong = client.open(path, method=method, headers={"Authorization": "Bearer s3cres"})
        assert wrong.status_code == 401, rule
        right = client.open(path, method=method, headers={"Authorization": f"Bearer {KEY}"})
        assert right.status_code != 401, rule


def test_key_is_compared_in_constant_time():
    source = inspect.getsource(app_module._check_api_key)
    assert "hmac.compare_digest(" in source and "==" not in source
    assert hmac.compare_digest(b"a", b"a")  # the function it relies on is the stdlib's


@pytest.mark.parametrize("path", ["/ui/../app.py", "/ui/%2e%2e/app.py", "/ui/..%2fapp.py",
                                  "/ui//etc/passwd", "/ui/%2fetc%2fpasswd", "/static/app.py"])
def test_no_route_serves_a_file_outside_the_page(app, path):
    r = app.test_client().get(path, follow_redirects=True)
    assert r.status_code == 404 and b"import" not in r.data and b"root:" not in r.data


def test_no_route_takes_a_path_from_the_request(app):
    client, auth = app.test_client(), {"Authorization": f"Bearer {KEY}"}
    r = client.post("/start_profile", json={"directory": "/tmp/evil"}, headers=auth)
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "directory"
    r = client.post("/v1/completions", headers=auth,
                    json={"model": "/etc/passwd", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404 and r.get_json()["error"]["code"] == "model_not_found"
    # The one route that reads a directory a request names is off without --enable-lora.
    r = client.post("/v1/load_lora_adapter", headers=auth,
                    json={"lora_name": "x", "lora_path": "/etc"})
    assert r.status_code == 400 and "--enable-lora" in r.get_json()["error"]["message"]
