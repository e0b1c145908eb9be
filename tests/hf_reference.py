"""Runs HF transformers (CPU torch) as an independent reference, in a separate Python.

torch's CPU wheel exists on these machines only for Python 3.11, while jax >= 0.11 needs 3.12,
so the reference lives in its own virtualenv (`.venv-ref`, made by scripts/setup.sh --test).
Each reference script under tests/reference/ reads a JSON request and writes an .npz; results are
cached by the hash of (script source, request, input files) so a second test run skips torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE_DIR = pathlib.Path(__file__).resolve().parent / "reference"


def reference_python() -> pathlib.Path | None:
    path = os.environ.get("JAXSERVE_REF_PYTHON")
    candidate = pathlib.Path(path) if path else ROOT / ".venv-ref" / "bin" / "python"
    return candidate if candidate.exists() else None


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("JAXSERVE_CACHE_DIR", os.path.expanduser("~/.cache/jaxserve"))
    return pathlib.Path(base) / "hf_reference"


def _file_digest(path: pathlib.Path) -> str:
    st = path.stat()
    # Size and mtime identify an input file cheaply; content hashing 100 MB each run is not needed.
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def run_reference(script: str, request: dict, input_files: list[pathlib.Path] = ()) -> dict:
    """Runs tests/reference/<script>.py on `request`; returns its arrays and JSON payload.

    The returned dict maps array names to numpy arrays; key "json" holds the decoded JSON
    payload the script wrote (or {}), key "workdir" a directory the script may fill with files
    (e.g. checkpoints it saved), kept with the cached result.
    """
    py = reference_python()
    if py is None:
        pytest.skip("HF reference environment missing: run `bash scripts/setup.sh --test` "
                    "(or set JAXSERVE_REF_PYTHON)")
    src = (REFERENCE_DIR / f"{script}.py").read_text()
    common = (REFERENCE_DIR / "common.py").read_text()
    key_material = json.dumps(request, sort_keys=True) + src + common + "".join(
        _file_digest(pathlib.Path(f)) for f in input_files)
    key = hashlib.sha256(key_material.encode()).hexdigest()[:24]
    out = _cache_dir() / f"{script}-{key}.npz"
    workdir = _cache_dir() / f"{script}-{key}"
    if not (out.exists() and workdir.exists()):
        workdir.mkdir(parents=True, exist_ok=True)
        req_path = out.with_suffix(".request.json")
        req_path.write_text(json.dumps(dict(request, workdir=str(workdir))))
        tmp = out.with_name(out.stem + ".tmp.npz")
        env = dict(os.environ, PYTHONPATH=str(REFERENCE_DIR), TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run([str(py), str(REFERENCE_DIR / f"{script}.py"), str(req_path),
                               str(tmp)], capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise RuntimeError(f"reference script {script} failed (exit {proc.returncode}): "
                               f"{proc.stderr[-2000:]}")
        tmp.rename(out)
    with np.load(out, allow_pickle=False) as data:
        result = {k: data[k] for k in data.files if k != "__json__"}
        result["json"] = json.loads(str(data["__json__"])) if "__json__" in data.files else {}
    result["workdir"] = workdir
    return result
