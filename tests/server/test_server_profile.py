"""POST /start_profile, /stop_profile and the step / KV-memory metrics, on a tiny random model
served through the real EngineLoop and Flask app (Flask's test client, no sockets)."""

import re

import pytest

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig, create_app
from jaxserve.testing.tiny_models import TINY_GQA
from models.random_init import random_model

TINY = TINY_GQA


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=5)


def serve(model, profile_dir, **config):
    engine = LLMEngine(EngineConfig(model="tiny", block_size=4, max_num_seqs=4,
                                    max_num_batched_tokens=32, max_model_len=64,
                                    kv_cache_memory=64 * 4 * TINY.kv_bytes_per_token(4),
                                    warmup=False, profile_dir=profile_dir), model=model)
    loop = EngineLoop(engine).start()
    app = create_app(loop, ServerConfig(served_model_name="tiny", **config))
    return loop, app.test_client()


def complete(client, n_tokens=6, **headers):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8, 9],
                                             "max_tokens": n_tokens, "ignore_eos": True},
                    headers=headers)
    assert r.status_code == 200, r.get_json()
    return r.get_json()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_profile_endpoints_off_without_profile_dir(model):
    loop, client = serve(model, None)
    try:
        for route in ("/start_profile", "/stop_profile"):
            r = client.post(route)
            assert r.status_code == 404
            assert r.get_json()["error"]["code"] == "profiling_disabled"
    finally:
        loop.stop()


def test_profile_capture_over_http(model, tmp_path):
    loop, client = serve(model, str(tmp_path), api_key="k")
    auth = {"Authorization": "Bearer k"}
    try:
        complete(client, **auth)  # compile before capturing
        assert client.post("/start_profile").status_code == 401
        r = client.post("/start_profile", headers=auth)
        assert r.status_code == 200 and r.get_json()["directory"] == str(tmp_path)
        r = client.post("/start_profile", headers=auth)
        assert r.status_code == 409 and r.get_json()["error"]["code"] == "profiler_busy"
        complete(client, **auth)
        r = client.post("/stop_profile", headers=auth)
        assert r.status_code == 200
        body = r.get_json()
        assert any(f.endswith(".xplane.pb") for f in body["files"])
        assert "perfetto_trace.json.gz" in body["files"]
        assert body["trace_dir"].startswith(str(tmp_path / "plugins" / "profile"))
        r = client.post("/stop_profile", headers=auth)
        assert r.status_code == 409 and r.get_json()["error"]["code"] == "profiler_not_running"
        assert client.post("/start_profile", headers=auth,
                           data="{\"num_steps\": 0}").status_code == 400
    finally:
        loop.stop()


def test_metrics_expose_step_and_kv_stats(model):
    loop, client = serve(model, None)
    try:
        complete(client, n_tokens=6)
        complete(client, n_tokens=3)
        text = client.get("/metrics").get_data(as_text=True)
    finally:
        loop.stop()
    steps = metric(text, "jaxserve_engine_steps_total")
    stats = loop.stats()["step_totals"]
    assert steps == stats["num_steps"] > 0
    assert metric(text, "jaxserve_step_duration_seconds_count") == steps
    assert metric(text, 'jaxserve_step_duration_seconds_bucket{le="+Inf"}') == steps
    assert metric(text, "jaxserve_step_batch_size_sum") == pytest.approx(
        stats["histograms"]["batch_size"]["sum"])
    # Two requests of 5-token prompts: 5 prompt tokens each, less what the second found in
    # the prefix cache (the same prompt), and one decode per token but the last.
    hits = loop.stats()["prefix_cache_hits_tokens"]
    assert 0 < hits < 5
    prefill = metric(text, 'jaxserve_step_tokens_total{kind="prefill"}')
    decode = metric(text, 'jaxserve_step_tokens_total{kind="decode"}')
    assert prefill + decode == 2 * 5 - hits + (6 - 1) + (3 - 1)
    phases = sum(metric(text, f'jaxserve_step_phase_seconds_total{{phase="{p}"}}')
                 for p in ("schedule", "device", "postprocess"))
    assert phases == pytest.approx(metric(text, "jaxserve_step_duration_seconds_sum"))
    assert metric(text, "jaxserve_kv_tokens_stored") == 0  # both finished: nothing held
    assert metric(text, "jaxserve_kv_blocks_used") == 0
    assert metric(text, 'jaxserve_kv_contiguous_waste_ratio{reservation="max_model_len"}') == 0
    assert metric(text, "jaxserve_profiling_active") == 0
