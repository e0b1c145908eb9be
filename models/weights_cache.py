"""Converted GGUF weights on disk, so that a second start skips parsing and dequantization.

Reading a GGUF file means parsing its metadata (the tokenizer's vocabulary and merges are
~100k strings), dequantizing every matrix and rearranging the result into the Flax params
tree. A start that finds this cache reads the finished tree (safetensors, memory-mapped,
no pickle), the raw quantized blocks and the tokenizer files instead.

An entry lives in `<cache root>/converted/<file stem>-<dtype>-<key>/` and its key covers the
GGUF file (resolved path, size, modification time), the dtype, this format's version and the
source of the modules that do the conversion, so editing the file or the loader misses; the
entry written then replaces the older ones of the same file stem and dtype.
An entry that cannot be read is removed with a warning and rebuilt; a cache directory that
cannot be written only costs the speed-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile

import numpy as np
import safetensors
import safetensors.numpy

from models.config import ModelConfig
from models.gguf_loader import QT, GGUFTensor, read_gguf
from models.tokenizer import Tokenizer
from models.weights import param_shapes, params_from_hf

log = logging.getLogger("jaxserve")

FORMAT_VERSION = 1
WEIGHTS_FILE = "weights.safetensors"
META_KEY = "jaxserve"
# The modules whose code decides what a GGUF file converts to.
CONVERTER_SOURCES = ("gguf_loader.py", "weights.py", "tokenizer.py", "config.py",
                     "weights_cache.py")


@dataclasses.dataclass(frozen=True)
class Converted:
    """What loading a GGUF file produces: config, numpy params tree, tokenizer, raw blocks."""

    config: ModelConfig
    params: dict
    tokenizer: Tokenizer
    raw: dict[str, GGUFTensor]


def cache_key(path: pathlib.Path, dtype) -> str:
    path = pathlib.Path(path).resolve()
    st = path.stat()
    here = pathlib.Path(__file__).parent
    code = hashlib.sha256()
    for name in CONVERTER_SOURCES:
        code.update((here / name).read_bytes())
    ident = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
             "dtype": np.dtype(dtype).name, "format": FORMAT_VERSION, "code": code.hexdigest()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def _prefix(path: pathlib.Path, dtype) -> str:
    return f"{pathlib.Path(path).stem}-{np.dtype(dtype).name}-"


def entry_dir(path: pathlib.Path, dtype, root: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(root) / "converted" / (_prefix(path, dtype) + cache_key(path, dtype))


def load_gguf(path: pathlib.Path, dtype, root: pathlib.Path | None) -> Converted:
    """Loads a GGUF file through the cache under `root` (None: no cache)."""
    entry = None if root is None else entry_dir(path, dtype, root)
    if entry is not None and entry.is_dir():
        hit = _read(entry, dtype)
        if hit is not None:
            return hit
    ckpt = read_gguf(path)
    converted = Converted(config=ckpt.config,
                          params=params_from_hf(ckpt.tensors, ckpt.config, dtype,
                                                source=str(path)),
                          tokenizer=Tokenizer.from_gguf(ckpt.reader), raw=ckpt.raw)
    if entry is not None:
        _write(entry, converted, dtype, _prefix(path, dtype))
    return converted


# ---- reading ------------------------------------------------------------------------------

def _read(entry: pathlib.Path, dtype) -> Converted | None:
    """The entry's contents, or None (and the entry removed) when it is unreadable."""
    try:
        with safetensors.safe_open(str(entry / WEIGHTS_FILE), framework="numpy") as f:
            meta = json.loads(f.metadata()[META_KEY])
            arrays = {k: f.get_tensor(k) for k in f.keys()}
        return _converted(meta, arrays, entry, dtype)
    except Exception as e:  # truncated, edited or partly deleted: rebuild rather than fail
        log.warning("jaxserve: ignoring unreadable converted-weights cache %s (%s: %s); "
                    "rebuilding it from the GGUF file", entry, type(e).__name__, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _converted(meta: dict, arrays: dict, entry: pathlib.Path, dtype) -> Converted:
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT_VERSION}")
    config = ModelConfig.from_dict(meta["config"])
    params: dict = {}
    for name, shape in param_shapes(config).items():
        x = arrays[f"params/{name}"]
        if x.shape != shape or x.dtype != np.dtype(dtype):
            raise ValueError(f"params/{name} is {x.dtype}{list(x.shape)}, expected "
                             f"{np.dtype(dtype)}{list(shape)}")
        *parents, leaf = name.split("/")
        node = params
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = x
    raw = {}
    for name, (gguf_name, qtype, shape) in meta["raw"].items():
        raw[name] = GGUFTensor(name, gguf_name, QT(qtype), tuple(shape), arrays[f"raw/{name}"])
    return Converted(config=config, params=params, tokenizer=Tokenizer.from_hf_dir(entry),
                     raw=raw)


# ---- writing ------------------------------------------------------------------------------

def _flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, name + "/") if isinstance(value, dict) else {name: value})
    return out


def _remove_older(entry: pathlib.Path, prefix: str) -> None:
    """Removes the entries of the same file and dtype that an edit of the file or of the
    loader left behind (each is the size of the model)."""
    for old in entry.parent.iterdir():
        if old.name.startswith(prefix) and old != entry and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _write(entry: pathlib.Path, c: Converted, dtype, prefix: str) -> None:
    """Writes the entry into a temporary directory, then renames it into place (atomic, so
    a concurrent start sees the whole entry or none)."""
    arrays = {f"params/{k}": np.ascontiguousarray(v) for k, v in _flat(c.params).items()}
    arrays.update({f"raw/{n}": np.ascontiguousarray(t.data) for n, t in c.raw.items()})
    meta = {"format": FORMAT_VERSION, "dtype": np.dtype(dtype).name,
            "config": c.config.to_dict(),
            "raw": {n: [t.gguf_name, int(t.qtype), list(t.shape)] for n, t in c.raw.items()}}
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        safetensors.numpy.save_file(arrays, str(tmp / WEIGHTS_FILE),
                                    metadata={META_KEY: json.dumps(meta)})
        c.tokenizer.save(tmp)
        try:
            os.replace(tmp, entry)
        except OSError:
            if entry.is_dir():  # another start got there first: its entry is as good
                return
            raise
        tmp = None
        log.info("jaxserve: cached converted weights in %s", entry)
        _remove_older(entry, prefix)
    except OSError as e:
        log.warning("jaxserve: could not write the converted-weights cache %s (%s); the next "
                    "start converts the GGUF file again", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
