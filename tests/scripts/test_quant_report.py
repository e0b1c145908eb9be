"""scripts/quant_report.py end to end on a tiny random model (the quick path of the report)."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from jaxserve.quantization.calibration import random_calibration
from models.config import ModelConfig
from models.random_init import random_model

# K = 192 (group 64, as SmolLM2's 576) and K = 256 (group 128); 3 query heads per KV head.
TINY = ModelConfig(vocab_size=256, hidden_size=192, intermediate_size=256, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=32, max_position_embeddings=256)
SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "quant_report.py"


@pytest.fixture(scope="module")
def report_mod():
    spec = importlib.util.spec_from_file_location("quant_report", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["quant_report"] = mod  # dataclasses resolve annotations through it
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(report_mod, tmp_path_factory):
    model = random_model(TINY, seed=2)
    heldout = np.random.default_rng(1).integers(0, TINY.vocab_size, (3, 32)).astype(np.int32)
    report = report_mod.run_report(model, random_calibration(TINY.vocab_size, 6, 32), heldout,
                                   progress=False, error_windows=2)
    prefix = tmp_path_factory.mktemp("report") / "quant_report"
    written = report_mod.write_outputs(report, prefix, "test", "test")
    return model, heldout, report, written


def rows(report):
    return {r["variant"]: r for r in report["rows"]}


def test_float_row_is_the_teacher(run):
    model, heldout, report, _ = run
    r = rows(report)["float32"]
    assert abs(r["kl"]) < 1e-6 and r["top1"] == 1.0
    # Perplexity again, from the model's own dense forward and a numpy log-softmax.
    nll = []
    for seq in heldout:
        logits = model.forward_logits(seq).astype(np.float64)  # [T, V]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                keepdims=True)) - logits.max(-1, keepdims=True)
        nll.extend(-logp[np.arange(len(seq) - 1), seq[1:]])
    np.testing.assert_allclose(r["ppl"], np.exp(np.mean(nll)), rtol=1e-4)


def test_int8_beats_int4_and_errors_are_consistent(run):
    _, _, report, _ = run
    r = rows(report)
    for method in ("RTN", "GPTQ", "AWQ"):
        assert r[f"{method} int8 per-channel"]["kl"] < r[f"{method} int4 g128"]["kl"]
        e4 = np.asarray(report["layer_errors"][f"{method} int4 g128"])
        e8 = np.asarray(report["layer_errors"][f"{method} int8 per-channel"])
        assert e4.shape == e8.shape == (TINY.num_layers, 7)
        assert (e8 < e4).all() and (e4 > 0).all()
    for row in report["rows"]:
        assert row["ppl"] > 1 and 0 <= row["top1"] <= 1 and row["kl"] >= 0


def test_memory_and_groups(run):
    model, _, report, _ = run
    assert report["groups"]["q_proj"] == {"K": 192, "int4_group": 64}
    assert report["groups"]["down_proj"] == {"K": 256, "int4_group": 128}
    kernels = [model.params["layers"][b][n]["kernel"].shape for b, n in
               [("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")]]
    float_bytes = sum(4 * l * k * n for l, k, n in kernels)
    g = {192: 64, 256: 128}
    # int4: a nibble per weight plus float32 scale and offset per group and column.
    int4_bytes = sum(l * (k * n // 2 + 2 * 4 * (k // g[k]) * n) for l, k, n in kernels)
    int8_bytes = sum(l * (k * n + 4 * n) for l, k, n in kernels)  # symmetric: scales only
    r = rows(report)
    assert r["float32"]["linear_bytes"] == float_bytes
    assert r["GPTQ int4 g128"]["linear_bytes"] == int4_bytes
    assert r["AWQ int8 per-channel"]["linear_bytes"] == int8_bytes


def test_outputs_written(run):
    _, _, report, written = run
    md = next(p for p in written if p.suffix == ".md").read_text()
    for row in report["rows"]:
        assert f"| {row['variant']} |" in md
    assert "### GPTQ int4 g128: per layer" in md
    assert next(p for p in written if p.suffix == ".json").stat().st_size > 0
