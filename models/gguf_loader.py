"""Reads a llama.cpp GGUF checkpoint into HF-named, HF-layout numpy weights plus its raw blocks.

Two llama.cpp conventions are undone here so the rest of jaxserve can treat a GGUF exactly like an
HF checkpoint: GGUF lists dimensions innermost-first (the reader already hands us row-major arrays),
and for ``llama`` the converter permutes the rows of attn_q / attn_k so that llama.cpp's
interleaved-pair RoPE sees the pairs HF's rotate-half RoPE uses. ``qwen2`` files are not permuted
(llama.cpp runs Qwen2 with NEOX, i.e. rotate-half, RoPE), so their rows are left alone; the
same holds for ``qwen3`` and ``phi3``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib

import gguf
import numpy as np

from models.config import ModelConfig, RopeScaling
from models.weights import (CheckpointError, check_fits_files, file_shapes, layer_indices,
                            unfuse)

QT = gguf.GGMLQuantizationType
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
BLOCK_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_K, QT.Q6_K)
SUPPORTED_TYPES = FLOAT_TYPES + BLOCK_TYPES
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
# llama.cpp's convert_hf_to_gguf reads `original_max_position_embeddings` from the top level of
# config.json, where Llama 3 never puts it, so every file it wrote assumed this value.
LLAMA_CPP_ORIGINAL_CONTEXT = 8192

# GGUF per-layer name -> HF per-layer name.
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"},
    **{f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3: fused, split by weights.unfuse
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# Phi-3 keeps its fused gate_up projection in ffn_up (llama.cpp splits it in the graph).
_ARCH_LAYER_NAMES = {"phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"}}
HF_LAYER = {h: g for g, h in LAYER_NAMES.items()} | {
    h: g for names in _ARCH_LAYER_NAMES.values() for g, h in names.items()}
HF_GLOBAL = {h: g for g, h in GLOBAL_NAMES.items()}


class GGUFError(CheckpointError):
    """A GGUF file jaxserve cannot load; the message names the file (and tensor, if any)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One quantized weight as stored in the file, rows already in HF order.

    ``data`` is uint8 ``[rows, bytes_per_row]``: ggml blocks run along a row, so each row is a
    self-contained run of blocks that int4/int8 kernels can consume without requantizing.
    """

    name: str                       # HF name
    gguf_name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]          # logical HF shape (rows, cols)
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """``tensors``: every model weight, HF names/layouts, in the requested dtype. ``raw``: the
    block-quantized (Q*) matrices only; F32/F16/BF16 weights have no raw entry."""

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    raw: dict[str, GGUFTensor]
    path: pathlib.Path
    # The open reader: the tokenizer reads its metadata too, and parsing costs seconds.
    reader: gguf.GGUFReader | None = dataclasses.field(default=None, repr=False, compare=False)


def _open(path: pathlib.Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises bare struct/numpy/index errors on bad bytes
        raise GGUFError(f"{path}: not a readable GGUF file (corrupt or truncated?): "
                        f"{type(e).__name__}: {e}") from e


def _metadata(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if f.types}


def _get(meta: dict, key: str, path, default=None, required=False):
    if key not in meta and required:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return meta.get(key, default)


def _head_dim(meta: dict, arch: str, hidden: int, heads: int, path) -> int:
    key_len = meta.get(f"{arch}.attention.key_length")
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if key_len is not None and rope_dim is not None and key_len != rope_dim:
        raise GGUFError(f"{path}: partial rotary embeddings (key_length {key_len} != "
                        f"rope.dimension_count {rope_dim}) are not supported")
    value = key_len if key_len is not None else rope_dim
    return int(value) if value is not None else hidden // heads


def _llama3_factors(theta: float, head_dim: int, s: RopeScaling) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3 scaling (divisors of each base frequency)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    orig = s.original_max_position_embeddings
    smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = 1.0 / ((1 - smooth) / s.factor + smooth)
    return np.where(wavelen < orig / s.high_freq_factor, 1.0,
                    np.where(wavelen > orig / s.low_freq_factor, s.factor, mid))


def _scaling_from_rope_freqs(freqs: np.ndarray, theta: float, head_dim: int, orig: int,
                             path) -> RopeScaling | None:
    """Recovers llama3 RopeScaling from the per-frequency divisors llama.cpp stores.

    Smoothly interpolated frequencies satisfy s = orig/(hf-lf) / wavelen - lf/(hf-lf), a line in
    1/wavelen; two of them fix lf and hf for the given orig (the RoPE only depends on orig/lf and
    orig/hf, so any orig reproduces it exactly).
    """
    freqs = np.asarray(freqs, np.float64).reshape(-1)
    if freqs.shape != (head_dim // 2,):
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' has {freqs.size} values, expected "
                        f"{head_dim // 2} (head_dim / 2)")
    factor = float(freqs.max())
    if np.allclose(freqs, 1.0):
        return None
    inv_wavelen = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim) / (2 * math.pi)
    mid = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    if mid.sum() < 2:
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' has {int(mid.sum())} smoothly "
                        "scaled frequencies; at least 2 are needed to recover llama3 "
                        "low/high_freq_factor")
    smooth = (1.0 / freqs[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, icept = np.polyfit(inv_wavelen[mid], smooth, 1)
    span = orig / slope
    low = -icept * span
    scaling = RopeScaling(factor=factor, low_freq_factor=float(low),
                          high_freq_factor=float(low + span),
                          original_max_position_embeddings=orig)
    if not np.allclose(_llama3_factors(theta, head_dim, scaling), freqs, rtol=1e-4):
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' does not follow llama3 RoPE "
                        "scaling; other per-frequency RoPE factors are not supported")
    return scaling


def _rope_scaling(meta: dict, arch: str, theta: float, head_dim: int, rope_freqs, path):
    pre = f"{arch}.rope.scaling."
    kind = str(meta.get(pre + "type", "none")).lower()
    if kind not in ("none", "llama3"):
        raise GGUFError(f"{path}: RoPE scaling type {kind!r} is not supported (only llama3)")
    orig = int(meta.get(pre + "original_context_length", LLAMA_CPP_ORIGINAL_CONTEXT))
    if rope_freqs is not None:
        return _scaling_from_rope_freqs(rope_freqs, theta, head_dim, orig, path)
    if kind == "none":
        return None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor")
               if pre + k not in meta]
    if missing:
        raise GGUFError(f"{path}: llama3 RoPE scaling needs {[pre + k for k in missing]} or a "
                        "'rope_freqs.weight' tensor")
    return RopeScaling(factor=float(meta[pre + "factor"]),
                       low_freq_factor=float(meta[pre + "low_freq_factor"]),
                       high_freq_factor=float(meta[pre + "high_freq_factor"]),
                       original_max_position_embeddings=orig)


def _config(meta: dict, names: dict, path, rope_freqs) -> ModelConfig:
    arch = _get(meta, "general.architecture", path, required=True)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (use one of "
                        f"{ARCHITECTURES})")
    g = lambda key, **kw: _get(meta, f"{arch}.{key}", path, **kw)  # noqa: E731
    if int(g("expert_count", default=0) or 0):  # llama.cpp's Mixtral is arch "llama" + experts
        raise GGUFError(f"{path}: mixture-of-experts GGUF files ({arch}.expert_count="
                        f"{g('expert_count')}) are not supported; load the HF safetensors "
                        "checkpoint instead")
    hidden = int(g("embedding_length", required=True))
    heads = int(g("attention.head_count", required=True))
    head_dim = _head_dim(meta, arch, hidden, heads, path)
    theta = _f32(g("rope.freq_base", default=10000.0))
    vocab = g("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    if vocab is None and "token_embd.weight" in names:
        vocab = int(names["token_embd.weight"].shape[-1])  # GGUF order: [D, V]
    if "rope_factors_short.weight" in names or "rope_factors_long.weight" in names:
        raise GGUFError(f"{path}: longrope factors (rope_factors_*.weight) in a GGUF are not "
                        "supported yet; load the HF checkpoint of this model instead")
    context = int(g("context_length", default=2048))
    window = g("attention.sliding_window")
    if arch == "phi3" and window and int(window) < context:
        # As models/hf_config.py: served where the window never cuts.
        context = int(window)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta]
    try:
        return ModelConfig(
            vocab_size=int(vocab or 0), hidden_size=hidden,
            intermediate_size=int(g("feed_forward_length", required=True)),
            num_layers=int(g("block_count", required=True)),
            num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", default=heads)),
            head_dim=head_dim,
            rms_norm_eps=_f32(g("attention.layer_norm_rms_epsilon", default=1e-5)),
            rope_theta=theta,
            rope_scaling=_rope_scaling(meta, arch, theta, head_dim, rope_freqs, path),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in names,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
            qk_norm="per_head" if "blk.0.attn_q_norm.weight" in names else "none",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
            architecture=arch)
    except ValueError as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{path}: metadata describes an invalid model: {e}") from e


def _f32(value) -> float:
    # GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06. The shortest decimal that
    # round-trips through float32 is the value the converter was given.
    return float(str(np.float32(value)))


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    names = {**LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None  # e.g. rope_freqs.weight: folded into the config, not a model weight


def _gguf_name(hf_name: str) -> str:
    if hf_name in HF_GLOBAL:
        return HF_GLOBAL[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    return f"blk.{i}.{HF_LAYER[rest]}"


def _unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row index list turning llama.cpp's permuted Q/K rows back into HF order.

    llama.cpp wrote ``w.reshape(n_head, 2, hd//2, ...).swapaxes(1, 2)``: row (h, j, p) of the file
    holds HF row (h, p, j). Reading the file at (h, j, p) for every HF (h, p, j) undoes it.
    """
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


def _row_order(gguf_name: str, rows: int, cfg: ModelConfig) -> np.ndarray | None:
    if cfg.architecture != "llama":
        return None
    if ".attn_q." in gguf_name:
        return _unpermute_rows(rows, cfg.num_heads)
    if ".attn_k." in gguf_name:
        return _unpermute_rows(rows, cfg.num_kv_heads)
    return None


def _load_tensor(t, name: str, cfg: ModelConfig, expected, dtype, path):
    """Returns (HF-layout array, raw GGUFTensor or None) for one file tensor."""
    qtype = QT(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise GGUFError(f"{path}: tensor {t.name!r} has type {qtype.name}, which jaxserve does "
                        f"not load (supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists the innermost dim first
    if shape != expected:
        raise GGUFError(f"{path}: tensor {t.name!r} ({name}) has shape {shape}, but the "
                        f"metadata implies {expected}")
    try:
        # A plain view of the memory map: gguf dequantizes in groups of rows, and slicing a
        # np.memmap subclass costs more per group than the decoding itself.
        values = gguf.quants.dequantize(np.asarray(t.data), qtype).reshape(shape)
    except Exception as e:
        raise GGUFError(f"{path}: tensor {t.name!r} ({qtype.name}) cannot be decoded: {e}") from e
    order = _row_order(t.name, shape[0], cfg)
    if order is not None:
        values = values[order]
    raw = None
    if qtype in BLOCK_TYPES and len(shape) == 2:
        # Stays a view of the memory map unless rows had to be reordered.
        blocks = t.data.reshape(shape[0], -1)
        raw = GGUFTensor(name, t.name, qtype, shape, blocks if order is None else blocks[order])
    out = values.astype(dtype, order="C", copy=False)
    # F32 tensors come back as read-only views of the memory map; callers get their own arrays.
    return (out if out.flags.writeable else out.copy()), raw


def _as_dtype(dtype):
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes  # numpy has no bfloat16; jax ships ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _reader_config(reader: gguf.GGUFReader, by_name: dict, path) -> ModelConfig:
    rope_freqs = by_name.get("rope_freqs.weight")
    rope_freqs = None if rope_freqs is None else gguf.quants.dequantize(
        rope_freqs.data, QT(rope_freqs.tensor_type))
    try:
        return _config(_metadata(reader), by_name, path, rope_freqs)
    except (TypeError, ArithmeticError, AttributeError) as e:  # e.g. a list or 0 for a count
        raise GGUFError(f"{path}: metadata has a value of the wrong type or range "
                        f"({type(e).__name__}: {str(e)[:200]})") from e


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The model config of a GGUF file from its metadata alone (no weight is read)."""
    path = pathlib.Path(path)
    reader = _open(path)
    return _reader_config(reader, {t.name: t for t in reader.tensors}, path)


def read_gguf(path: str | os.PathLike, dtype=np.float32) -> GGUFCheckpoint:
    """Loads a llama / qwen2 / qwen3 / phi3 GGUF file: config, dequantized HF-layout weights
    (Phi-3's fused projections split), raw blocks."""
    path = pathlib.Path(path)
    dtype = _as_dtype(dtype)
    reader = _open(path)
    by_name = {t.name: t for t in reader.tensors}
    cfg = _reader_config(reader, by_name, path)
    try:
        check_fits_files(cfg, len(layer_indices(by_name, "blk.")), path.stat().st_size,
                         str(path))
    except CheckpointError as e:
        raise GGUFError(str(e)) from None
    expected = file_shapes(cfg)
    hf_to_gguf = {h: n for n in by_name if (h := _hf_name(n, cfg.architecture)) is not None}
    missing = [f"{n} ({_gguf_name(n)})" for n in expected if n not in hf_to_gguf]
    if missing:
        raise GGUFError(f"{path}: missing tensors {missing[:8]}"
                        f"{' ...' if len(missing) > 8 else ''}")
    extra = sorted(hf_to_gguf[n] for n in hf_to_gguf if n not in expected)
    if extra:
        raise GGUFError(f"{path}: tensors {extra[:8]} do not fit the metadata "
                        f"({cfg.num_layers} layers, attention_bias={cfg.attention_bias})")
    tensors, raw = {}, {}
    for name in expected:
        tensors[name], r = _load_tensor(by_name[hf_to_gguf[name]], name, cfg, expected[name],
                                        dtype, path)
        if r is not None:
            raw[name] = r
    return GGUFCheckpoint(config=cfg, tensors=unfuse(tensors, cfg), raw=_unfuse_raw(raw, cfg),
                          path=path, reader=reader)


def _unfuse_raw(raw: dict[str, GGUFTensor], cfg: ModelConfig) -> dict[str, GGUFTensor]:
    """Fused block-quantized matrices split by rows like their float copies (weights.unfuse):
    ggml blocks run along a row, so each part keeps whole rows of blocks."""
    suffixes = ("qkv_proj.weight", "gate_up_proj.weight")
    fused = {n: t for n, t in raw.items() if n.endswith(suffixes)}
    if not fused:
        return raw
    # Split row numbers the way the tensors were split (every fused name, float ones too).
    rows = unfuse({n: np.arange(shape[0])[:, None] for n, shape in file_shapes(cfg).items()
                   if n.endswith(suffixes)}, cfg)
    out = {n: t for n, t in raw.items() if n not in fused}
    for name, idx in rows.items():
        src = next((t for n, t in fused.items()
                    if n.rsplit(".", 2)[0] == name.rsplit(".", 2)[0]), None)
        if src is None:  # a float fused tensor: no raw blocks
            continue
        idx = idx[:, 0]
        out[name] = GGUFTensor(name, src.gguf_name, src.qtype, (len(idx), src.shape[1]),
                               src.data[idx[0]:idx[-1] + 1])
    return out
