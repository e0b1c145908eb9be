"""GuideLLM, the third-party load client of scripts/bench_serving_peers.py, against the server:
the script's own scenario and report parsing, run for real (GuideLLM in .venv-bench) on an
in-process server over the tiny chat model. GuideLLM sends streaming /v1/completions with
`stream_options` and `ignore_eos` and counts tokens with the model's tokenizer, so this shows
the benchmark measures what it says: every request completes, with exactly the prompt and
output token counts asked for, and its latencies hang together. The report's ratio columns are
checked on made-up figures."""

import importlib.util
import pathlib

import pytest

from http_server import serving, tiny_chat_loop
from jaxserve.server import ServerConfig
from jaxserve.testing.tiny_chat import tiny_tokenizer

pytestmark = pytest.mark.subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]
GUIDELLM = REPO / ".venv-bench" / "bin" / "guidellm"
MODEL = "tiny-chat"


def bench_script():
    spec = importlib.util.spec_from_file_location(
        "bench_serving_peers", REPO / "scripts" / "bench_serving_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server():
    # warmed up: a first-use compile would outlast the short run
    with tiny_chat_loop(max_num_seqs=4, max_model_len=256, warmup=True) as loop:
        with serving(loop, ServerConfig(served_model_name=MODEL)) as s:
            yield s


def run_point(server, tmp_path, options: list[str], label: str):
    """GuideLLM through the script on the tiny server at the `--quick` point named `label`:
    (the script's module, its args, the profile, the point's figures)."""
    if not GUIDELLM.exists():
        pytest.skip("GuideLLM missing: run `bash scripts/setup.sh --test` (it installs "
                    "tests/requirements-bench.txt into .venv-bench)")
    bench = bench_script()
    args = bench.parse_args(["--quick", "--llama-server", "none", "--guidellm", str(GUIDELLM),
                             "--transient", "0", *options])
    tiny_tokenizer().save(tmp_path / "tokenizer")
    profile, = [prof for name, prof in bench.points(args) if name == label]
    report = bench.run_guidellm(
        args.guidellm, bench.scenario(server.url, str(tmp_path / "tokenizer"), profile, args,
                                      seed=0, model=MODEL), timeout_s=300)
    return bench, args, profile, bench.figures(report)


def test_guidellm_runs_every_request_at_the_asked_token_counts(server, tmp_path):
    _, args, _, f = run_point(server, tmp_path, ["--seconds", "6"], "concurrency 4")
    assert f["errored"] == 0 and f["completed"] >= 4, f
    assert f["prompt_tokens_per_request"] == args.prompt_tokens == 32
    assert f["output_tokens_per_request"] == args.output_tokens == 8  # ignore_eos honoured
    assert 0 < f["ttft_ms"]["p50"] <= f["e2e_s"]["p50"] * 1000
    assert 0 < f["itl_ms"]["p50"] < f["e2e_s"]["p99"] * 1000
    # throughput counts the tokens streamed in the window; the completed requests' tokens differ
    # from them only by the requests crossing its two edges (at most 4 streams at each, each at
    # most 8 tokens). A ">=" does not hold: a request finishing inside began before it.
    edge_tokens = 2 * 4 * args.output_tokens
    assert abs(f["output_tok_s"] * f["duration_s"] - f["completed"] * args.output_tokens) \
        <= edge_tokens, f


def test_a_rate_point_offers_the_rate_it_names(server, tmp_path):
    # --rates given with --quick is kept (--quick once replaced it with 1/s)
    bench, _, profile, f = run_point(server, tmp_path, ["--seconds", "8", "--rates", "2"],
                                     "rate 2/s")
    assert f["errored"] == 0 and f["completed"] >= 8, f
    assert f["sent_req_s"] == pytest.approx(2.0, rel=0.25), f
    bench.check_rate("rate 2/s", profile, f)


def test_a_rate_point_that_sent_another_rate_is_refused():
    bench = bench_script()
    profile = {"kind": "constant", "rate": [0.5]}
    bench.check_rate("rate 0.5/s", profile, {"sent_req_s": 0.55})
    # GuideLLM 0.8.1's Poisson race: hundreds of requests in the first second
    with pytest.raises(RuntimeError, match="sent 10.23 requests/s, asked 0.5/s"):
        bench.check_rate("rate 0.5/s", profile, {"sent_req_s": 10.23})
    bench.check_rate("concurrency 8", {"kind": "concurrent", "streams": [8]}, {"sent_req_s": 9.0})


def test_report_ratios_put_jaxserve_over_the_peer():
    bench = bench_script()

    def point(tok_s, ttft_ms):
        return {"output_tok_s": tok_s, "ttft_ms": {"p50": ttft_ms, "p99": 2 * ttft_ms},
                "itl_ms": {"p50": 10.0, "p99": 20.0}, "e2e_s": {"p50": 1.0, "p99": 2.0},
                "completed": 10, "errored": 0, "sent_req_s": 1.0, "load_avg_1m_before": 0.1}

    results = {"startup_s": {"jaxserve": 30.0, "llama-server": 2.0},
               "commands": {"jaxserve": "jaxserve serve", "llama-server": "llama-server"},
               "points": [{"label": "concurrency 8", "systems": {
                   "jaxserve": point(300.0, 50.0), "llama-server": point(100.0, 200.0)}}]}
    env = {"machine": "test CPU", "load_avg_start": (0.1, 0.1, 0.1),
           "load_avg_end": (0.2, 0.2, 0.2), "versions": {"guidellm": "0"}, "prompt_tokens": 32,
           "output_tokens": 8, "seconds_per_point": 6, "long_seconds": 12, "transient": 0.1,
           "gguf": "m.gguf", "parallel": 8, "max_model_len": 256, "kv_cache_dtype": "bfloat16"}
    md = bench.render_markdown(env, results, "cmd")
    assert "| concurrency 8 | 3.00x | 0.25x | 1.00x | 1.00x |" in md
    # a peer that finished nothing in the window has no latencies, not zeros
    results["points"][0]["systems"]["llama-server"]["completed"] = 0
    md = bench.render_markdown(env, results, "cmd")
    assert "| concurrency 8 | 3.00x | - | - | - |" in md
    assert "| concurrency 8 | llama-server | 100.0 | - | - | - |" in md
    assert "test CPU" in md and "0.10, 0.10, 0.10" in md
