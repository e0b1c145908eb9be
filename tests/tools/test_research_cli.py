"""`jaxserve bench --profile-dir` and scripts/ablate_block_size.py --quick, on a tiny random
model."""

import csv
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

from jaxserve.tools.workload import make_workload
from models import checkpoint
from jaxserve.testing.tiny_models import TINY_GQA
from models.random_init import random_model

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = TINY_GQA


def test_bench_prints_throughput_and_writes_a_profile(tmp_path):
    model_dir = checkpoint.save(random_model(TINY, seed=1), tmp_path / "tiny")
    budget = 64 * 4 * TINY.kv_bytes_per_token(4)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "bench", str(model_dir), "--num-requests", "5",
         "--prompt-len", "4", "12", "--output-len", "2", "9", "--seed", "3", "--block-size", "4",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "64",
         "--kv-cache-memory", str(budget), "--profile-dir", str(tmp_path / "prof"),
         "--profile-steps", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = make_workload(3, 5, (4, 12), (2, 9), (100, 256))
    want = sum(r["max_tokens"] for r in work)
    prompt = sum(len(r["prompt"]) for r in work)
    assert f"5 requests, {prompt} prompt + {want} generated tokens" in proc.stdout
    assert "0 preemptions, 0 compiles" in proc.stdout  # the warm-up pass compiled everything
    assert re.search(r"step time: schedule [\d.]+%, device [\d.]+%, postprocess", proc.stdout)
    assert "KV waste (time-averaged): paged" in proc.stdout
    [run_dir] = (tmp_path / "prof" / "plugins" / "profile").iterdir()
    assert any(run_dir.glob("*.xplane.pb")) and (run_dir / "perfetto_trace.json.gz").exists()
    assert str(run_dir) in proc.stderr


def load_script():
    spec = importlib.util.spec_from_file_location("ablate_block_size",
                                                  REPO / "scripts" / "ablate_block_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ablation_quick(tmp_path):
    script = load_script()
    plot = importlib.util.find_spec("matplotlib") is not None
    argv = ["--quick", "--block-sizes", "4,64", "--out-dir", str(tmp_path)]
    rows = script.main(argv + ([] if plot else ["--no-plot"]))
    with open(tmp_path / "ablate_block_size.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["block_size"]) for r in table] == [4, 64]
    # Quick mode: max_num_seqs 4, max_model_len 64, a budget of 192 tokens.
    per_token = TINY.kv_bytes_per_token(4)
    for row, bs in zip(rows, (4, 64)):
        assert row["num_blocks"] == 192 * per_token // (bs * per_token)
        assert row["page_table_entries"] == 4 * -(-64 // bs)
        assert row["page_table_bytes"] == 4 * row["page_table_entries"]
        assert row["compiles_in_timed"] == 0  # the warm-up pass met every shape
        assert 1 <= row["max_concurrent_seqs"] <= 4
        assert 0 <= row["waste_fraction"] < 1 and 0 < row["kv_utilisation"] <= 1
        assert row["attention_device_s"] is None  # CPU
    # bs 64: 3 blocks, the null block and 2 usable: at most 2 sequences at once.
    assert rows[1]["max_concurrent_seqs"] <= 2 < rows[0]["max_concurrent_seqs"]
    assert rows[1]["waste_fraction"] > rows[0]["waste_fraction"]
    md = (tmp_path / "ablate_block_size.md").read_text()
    assert "| 4 |" in md and "| 64 |" in md and "## Conclusion" in md
    assert (tmp_path / "ablate_block_size.png").exists() == plot
    script.main(argv + ["--render-only", "--no-plot"])  # re-renders from the saved JSON
    assert (tmp_path / "ablate_block_size.md").read_text() == md
