"""GGUF-native weights: the file's own Q4_0 / Q4_1 / Q8_0 blocks as quantized weights, as is.

A ggml block covers 32 consecutive inputs (K) of one output row (N), so the blocks of an
HF-layout [N, K] matrix map onto the [K, N] weight with groups of 32 along K:
    Q4_0 (d f16, qs[16]):          w = d (u - 8)  -> Int4Weight(packed, scales=d)  (offsets -8 d)
    Q4_1 (d f16, m f16, qs[16]):   w = d u + m    -> Int4Weight(packed, scales=d, offsets=m)
    Q8_0 (d f16, qs int8[32]):     w = d c        -> Int8Weight(q8=the file's rows, scales=d)
qs[i] holds element i in its low nibble and element i + 16 in its high one: exactly the int4
kernel's per-group halves layout at g = 32 (pallas_kernels/int4_matmul.py), so the packed bytes
are the file's bytes, transposed. The loader has already put the Q/K rows in HF order
(models/gguf_loader.py), and rows are output channels: the same reorder carries over.
"""

from __future__ import annotations

import dataclasses
import logging

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quantization.rtn import HF_LINEARS, LINEARS
from models.gguf_loader import GGUFTensor
from models.quantized import Int4Weight, Int8Weight, QuantizedWeight

log = logging.getLogger("jaxserve")

QT = gguf.GGMLQuantizationType
NATIVE_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q8_0)
BLOCK = 32


def _blocks(t: GGUFTensor, block_bytes: int) -> np.ndarray:
    n, k = t.shape
    return np.asarray(t.data).reshape(n, k // BLOCK, block_bytes)  # [N, K/32, bytes]


def _f16(b: np.ndarray) -> np.ndarray:
    """[N, G, 2] bytes -> [G, N] float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32).T


def native_weight(t: GGUFTensor) -> QuantizedWeight:
    """One Q4_0/Q4_1/Q8_0 tensor (HF layout [N, K]) -> the quantized weight of its [K, N] kernel
    (numpy arrays)."""
    n, k = t.shape
    if t.qtype == QT.Q8_0:
        b = _blocks(t, 34)
        q8 = np.ascontiguousarray(b[..., 2:]).view(np.int8)  # [N, K/32, 32]
        # rows as in the file
        return Int8Weight(q8=q8.reshape(n, k), scales=_f16(b[..., :2]), group_size=BLOCK)
    if t.qtype in (QT.Q4_0, QT.Q4_1):
        head = 2 if t.qtype == QT.Q4_0 else 4
        b = _blocks(t, head + BLOCK // 2)
        packed = np.ascontiguousarray(b[..., head:].reshape(n, k // 2).T)  # [K/2, N]
        offsets = _f16(b[..., 2:4]) if t.qtype == QT.Q4_1 else None  # [K/32, N]
        return Int4Weight(packed=packed, scales=_f16(b[..., :2]), offsets=offsets,
                          group_size=BLOCK)
    raise ValueError(f"{t.gguf_name}: {t.qtype.name} has no native quantized path "
                     f"(native: {', '.join(q.name for q in NATIVE_TYPES)})")


def _stack(trees: list[QuantizedWeight]) -> QuantizedWeight:
    return jax.tree.map(lambda *a: jnp.asarray(np.stack(a)), *trees)  # [L, ...]


def _family(qtype) -> str | None:
    return {QT.Q4_0: "int4", QT.Q4_1: "int4", QT.Q8_0: "int8"}.get(qtype)


def stacked_native(raw: dict[str, GGUFTensor], names: list[str]):
    """The [L, ...] weight of one projection over layers, or None when it cannot stay native.

    Layers must agree on the code width; Q4_0 layers mixed with Q4_1 ones get explicit
    offsets (-8 d) so the stacked weight has one structure.
    """
    tensors = [raw.get(name) for name in names]
    if any(t is None for t in tensors):
        return None
    families = {_family(t.qtype) for t in tensors}
    if len(families) != 1 or None in families:
        return None
    trees = [native_weight(t) for t in tensors]
    if families == {"int4"} and any(t.offsets is not None for t in trees):
        trees = [t if t.offsets is not None else dataclasses.replace(t, offsets=-8.0 * t.scales)
                 for t in trees]
    return _stack(trees)


def gguf_native_params(params: dict, raw: dict[str, GGUFTensor], config) -> dict:
    """params with every linear kernel whose GGUF blocks are native replaced by its weight.

    The rest (other block types, float tensors, norms, the embedding lookup) stay the float
    weights the loader dequantized; one log line names what was not served natively.
    """
    layers = {block: dict(params["layers"][block]) for block in params["layers"]}
    fallback = []
    for (block, name), hf in zip(LINEARS, HF_LINEARS):
        names = [f"model.layers.{i}.{hf}" for i in range(config.num_layers)]
        tree = stacked_native(raw, names)
        if tree is None:
            kinds = sorted({raw[n].qtype.name if n in raw else "float" for n in names})
            fallback.append(f"{hf} ({'/'.join(kinds)})")
            continue
        layers[block][name] = dict(layers[block][name], kernel=tree)
    out = dict(params, layers=layers)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    t = raw.get(head)
    if t is not None and t.qtype in NATIVE_TYPES:
        out["lm_head"] = {"kernel": jax.tree.map(jnp.asarray, native_weight(t))}
    else:
        fallback.append(f"lm head ({t.qtype.name if t is not None else 'float'})")
    if fallback:
        log.info("gguf: served as dequantized float (no native quantized path): %s",
                 ", ".join(fallback))
    return out
