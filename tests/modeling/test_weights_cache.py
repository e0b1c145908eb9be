"""models/weights_cache.py: a hit is the fresh conversion, a changed file or dtype misses, a
broken entry is ignored (with a warning) and rebuilt, and an unwritable cache costs nothing."""

from __future__ import annotations

import logging
import os

import ml_dtypes
import numpy as np
import pytest

from models import weights_cache
from models.model import load_model
from models.weights_cache import WEIGHTS_FILE, entry_dir, load_gguf
from test_gguf_loader import QT, gguf_tensors, hf_weights, write_gguf


def _write(path, seed, qtype=QT.Q4_1):
    write_gguf(path, gguf_tensors(hf_weights(np.random.default_rng(seed))), qtype=qtype,
               seed=seed)
    return path


def _leaves(tree, prefix=""):
    for k, v in tree.items():
        yield from (_leaves(v, f"{prefix}{k}/") if isinstance(v, dict) else [(prefix + k, v)])


def _assert_same(a, b):
    assert a.config == b.config
    la, lb = dict(_leaves(a.params)), dict(_leaves(b.params))
    assert la.keys() == lb.keys()
    for k in la:
        assert la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape, k
        np.testing.assert_array_equal(la[k], lb[k], err_msg=k)
    assert a.raw.keys() == b.raw.keys() and a.raw  # a Q4_1 file has raw blocks
    for k, t in a.raw.items():
        u = b.raw[k]
        assert (t.name, t.gguf_name, t.qtype, t.shape) == (u.name, u.gguf_name, u.qtype, u.shape)
        np.testing.assert_array_equal(t.data, u.data)
    text = "t1t2 t3<unk>t299"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    for attr in ("vocab_size", "bos_token_id", "eos_token_id", "stop_token_ids", "add_bos"):
        assert getattr(a.tokenizer, attr) == getattr(b.tokenizer, attr), attr


def test_hit_equals_fresh_conversion(tmp_path, monkeypatch):
    path = _write(tmp_path / "m.gguf", seed=0)
    fresh = load_gguf(path, np.float32, None)
    first = load_gguf(path, np.float32, tmp_path / "cache")  # miss: converts and writes
    assert entry_dir(path, np.float32, tmp_path / "cache").is_dir()
    _assert_same(first, fresh)
    monkeypatch.setattr(weights_cache, "read_gguf", None)  # a hit must not read the file
    _assert_same(load_gguf(path, np.float32, tmp_path / "cache"), fresh)


def test_changed_file_misses(tmp_path):
    path = _write(tmp_path / "m.gguf", seed=0)
    root = tmp_path / "cache"
    load_gguf(path, np.float32, root)
    old_entry = entry_dir(path, np.float32, root)
    _write(path, seed=1)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # even on a coarse clock
    assert entry_dir(path, np.float32, root) != old_entry
    _assert_same(load_gguf(path, np.float32, root), load_gguf(path, np.float32, None))
    # The new entry replaced the stale one (each is the size of the model).
    assert not old_entry.exists() and entry_dir(path, np.float32, root).is_dir()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_broken_entry_is_ignored_and_rebuilt(tmp_path, caplog, damage):
    path = _write(tmp_path / "m.gguf", seed=0)
    root = tmp_path / "cache"
    load_gguf(path, np.float32, root)
    weights = entry_dir(path, np.float32, root) / WEIGHTS_FILE
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    else:
        weights.unlink()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        got = load_gguf(path, np.float32, root)
    assert "unreadable converted-weights cache" in caplog.text
    _assert_same(got, load_gguf(path, np.float32, None))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        _assert_same(load_gguf(path, np.float32, root), got)  # rebuilt: a clean hit now
    assert not caplog.text


def test_dtype_is_part_of_the_key(tmp_path):
    path = _write(tmp_path / "m.gguf", seed=0)
    root = tmp_path / "cache"
    load_gguf(path, np.float32, root)
    first = load_gguf(path, ml_dtypes.bfloat16, root)  # a miss, not the float32 entry
    assert first.params["embedding"].dtype == ml_dtypes.bfloat16
    assert entry_dir(path, np.float32, root) != entry_dir(path, ml_dtypes.bfloat16, root)
    assert entry_dir(path, np.float32, root).is_dir()  # another dtype's entry stays
    _assert_same(load_gguf(path, ml_dtypes.bfloat16, root), first)
    assert load_gguf(path, np.float32, root).params["embedding"].dtype == np.float32


def test_unwritable_cache_still_loads(tmp_path, caplog):
    path = _write(tmp_path / "m.gguf", seed=0)
    root = tmp_path / "not-a-dir"
    root.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        got = load_gguf(path, np.float32, root)
    assert "could not write the converted-weights cache" in caplog.text
    _assert_same(got, load_gguf(path, np.float32, None))


def test_load_model_flag(tmp_path, monkeypatch):
    path = _write(tmp_path / "m.gguf", seed=0)
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    load_model(path, "float32", compilation_cache=False, weights_cache=False)
    assert not (tmp_path / "cache" / "converted").exists()
    a = load_model(path, "float32", compilation_cache=False)
    assert (tmp_path / "cache" / "converted").is_dir()
    monkeypatch.setattr(weights_cache, "read_gguf", None)
    b = load_model(path, "float32", compilation_cache=False)
    for (k, x), (_, y) in zip(_leaves(a.params), _leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=k)
