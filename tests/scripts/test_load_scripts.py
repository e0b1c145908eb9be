"""scripts/stress_server.py and scripts/soak.py, run small: each starts its own loopback server
(the tiny random model) in a child process and must exit 0 with its checks passed."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


@pytest.mark.subprocess
@pytest.mark.timeout(900)
def test_stress_script_small(tmp_path):
    out = tmp_path / "stress.json"
    proc = run_script("scripts/stress_server.py", "--clients", "16", "--max-tokens", "12",
                      "--timeout", "800", "--json", str(out), timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["clients"] == 16 and s["dropped"] + s["survivors"] == 16
    assert s["survivors"] >= 1 and s["dropped"] >= 1  # seed 0 draws both kinds
    assert s["survivors_matching_solo"] == s["survivors"] and not s["violations"]
    assert s["engine_after"]["kv_blocks_in_use"] == 0 and s["statuses"] == {"200": 16}


@pytest.mark.subprocess
@pytest.mark.timeout(900)
def test_soak_script_short(tmp_path):
    # RSS still grows in the first minute (warm-up), so the short run's RSS tolerance is wide:
    # this checks the script's plumbing; the 30-minute run in docs/results/soak_30min/ checks
    # the trend.
    proc = run_script("scripts/soak.py", "--minutes", "0.3", "--rate", "3", "--sample-s", "2",
                      "--rss-tol-mib", "500", "--out-dir", str(tmp_path), timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "soak.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 5 and int(rows[-1]["completed"]) >= 10 and rows[-1]["failed"] == "0"
    assert rows[-1]["kv_blocks_in_use"] == "0"
    assert (tmp_path / "soak.png").stat().st_size > 10_000
