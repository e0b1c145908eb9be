"""The model-server protocol gauges of Kubernetes inference gateways (vLLM's names) on /metrics.

The engine is stepped by the test itself, so the scrape and the engine's counters are taken at
the same point: each scrape is compared with the engine's stats then, and with what the test
knows independently (how many requests it queued, the batch limit, the block manager's count
of held blocks).
"""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.server import EngineLoop, ServerConfig, create_app
from jaxserve.server.metrics import ServerMetrics
from jaxserve.testing.tiny_models import TINY_GQA
from models.random_init import random_model

BS = 4
MAX_NUM_SEQS = 2
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def engine():
    model = random_model(TINY_GQA, seed=5)
    return LLMEngine(EngineConfig(model="tiny", block_size=BS, max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=32, max_model_len=64, warmup=False,
                                  kv_cache_memory=64 * BS * TINY_GQA.kv_bytes_per_token(4)),
                     model=model)


class SteppedLoop:
    """What the collector reads of an EngineLoop, for an engine the test steps itself."""

    alive = True

    def __init__(self, engine):
        self.stats = engine.stats


def scrape(metrics: ServerMetrics) -> dict:
    """name -> list of (labels, value) of every sample in the exposition."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(samples: dict, name: str) -> float:
    (labels, v), = samples[name]
    assert labels == {}, name
    return v


def test_protocol_gauges_track_the_engine_under_load(engine):
    metrics = ServerMetrics(SteppedLoop(engine))
    bm = engine.scheduler.block_manager
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    num_requests = 5
    for i in range(num_requests):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9, 10], params)
    seen_queue, finished, steps = False, 0, 0
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step())
        steps += 1
        samples, stats = scrape(metrics), engine.stats()
        running = value(samples, "vllm:num_requests_running")
        waiting = value(samples, "vllm:num_requests_waiting")
        assert running == stats["running"] == engine.scheduler.num_running
        assert waiting == stats["waiting"] == engine.scheduler.num_waiting
        assert running <= MAX_NUM_SEQS
        # Every queued request is running, waiting, or finished (one sequence each).
        assert running + waiting + finished == num_requests
        usage = value(samples, "vllm:kv_cache_usage_perc")
        assert usage == pytest.approx(bm.num_used_blocks / bm.num_usable_blocks)
        assert 0.0 <= usage <= 1.0
        seen_queue |= waiting > 0 and running == MAX_NUM_SEQS and usage > 0
    assert seen_queue, "the batch never filled with requests still queued"
    assert finished == num_requests and steps > 1
    samples = scrape(metrics)
    assert [value(samples, g) for g in GAUGES] == [0, 0, 0]


def test_cache_config_info_carries_block_size_and_blocks(engine):
    samples = scrape(ServerMetrics(SteppedLoop(engine)))
    (labels, v), = samples["vllm:cache_config_info"]
    assert v == 1.0
    assert labels == {"block_size": str(BS),
                      "num_gpu_blocks": str(engine.scheduler.block_manager.num_usable_blocks)}


def test_served_over_http_next_to_the_jaxserve_names(engine):
    loop = EngineLoop(engine).start()
    try:
        client = create_app(loop, ServerConfig(served_model_name="tiny")).test_client()
        text = client.get("/metrics").get_data(as_text=True)
    finally:
        loop.stop()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert set(GAUGES) | {"vllm:cache_config_info"} <= names
    assert {"jaxserve_num_requests_running", "jaxserve_kv_cache_usage_ratio"} <= names
