"""Repacking Int4Weight / Int8Weight into the native CPU matmul's layout (CpuPackedWeight), at load.

The math is unchanged, only re-expressed with unsigned codes and a static zero point:
    Int4Weight  w = s u + b          = s (u - 8) + (b + 8 s)      (b None: -8 s, shift 0)
    Int8Weight  w = s c + b, c int8  = s ((c + 128) - 128) + b    (codes stored as c + 128)
The kernel forms b + 8 s itself, so scales and offsets stay the stored ones: float16 where
every value is exactly a float16 (GGUF's d and m), float32 otherwise.
so GGUF's Q4_0 / Q4_1 / Q8_0 blocks (quantization/gguf_native.py) keep llama.cpp's
dequantization x = d q + m exactly; the kernel applies it to int8 activations, never to a float
copy of the weight. Layout: jaxserve/native/cpu_quant_matmul.cc. Numpy only, once per weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.quantized import CpuPackedWeight, Int4Weight, Int8Weight

TILE = 16  # outputs per tile: one AVX-512 register of int32 lanes


def _codes_int4(packed: np.ndarray, group: int) -> np.ndarray:
    """[K/2, N] uint8 in the per-group halves layout -> codes u [N, K] uint8 in [0, 15]."""
    k2, n = packed.shape
    q = packed.reshape(2 * k2 // group, group // 2, n)  # [G, g/2, N]
    u = np.concatenate([q & 0xF, q >> 4], axis=1)  # [G, g, N]
    return np.ascontiguousarray(u.reshape(2 * k2, n).T)


def _tile(a: np.ndarray, n_pad: int, fill) -> np.ndarray:
    """[N, X] -> [N16/16, 16, X] with rows past N set to `fill`."""
    n = a.shape[0]
    a = np.concatenate([a, np.full((n_pad - n, *a.shape[1:]), fill, a.dtype)])
    return a.reshape(n_pad // TILE, TILE, *a.shape[1:])


def _pack_one(w: Int4Weight | Int8Weight) -> dict:
    """One weight without leading axes -> the CpuPackedWeight arrays (numpy)."""
    scales = np.asarray(w.scales, np.float32)  # [G, N]
    groups, n = scales.shape
    n_pad = -(-n // TILE) * TILE
    offsets = None if w.offsets is None else np.asarray(w.offsets, np.float32)
    if isinstance(w, Int4Weight):
        u = _codes_int4(np.asarray(w.packed), w.in_features // groups)  # [N, K]
        k = u.shape[1]
        t = _tile(u, n_pad, 8).reshape(n_pad // TILE, TILE, k // 8, 2, 4)  # [T, j, o, h, b]
        t = t.transpose(0, 2, 1, 4, 3)  # [T, o, j, b, h]
        codes = t[..., 0] | (t[..., 1] << 4)  # [T, K/8, 16, 4]
        bits, zero, shift = 4, 8, 0 if offsets is None else 8
    else:
        c = np.asarray(w.q8).astype(np.int16) + 128  # [N, K] in [1, 255]
        k = c.shape[1]
        t = _tile(c.astype(np.uint8), n_pad, 128).reshape(n_pad // TILE, TILE, k // 4, 4)
        codes = t.transpose(0, 2, 1, 3)  # [T, K/4, 16, 4]
        bits, zero, shift = 8, 128, 0
    floats = [a for a in (scales, offsets) if a is not None]
    dtype = (np.float16 if all(np.array_equal(a.astype(np.float16).astype(np.float32), a)
                               for a in floats) else np.float32)

    def per_tile(a):  # [G, N] -> [T, G, 16], zero past N
        if a is None:
            return None
        t = _tile(np.ascontiguousarray(a.T), n_pad, 0.0).transpose(0, 2, 1)
        return np.ascontiguousarray(t.astype(dtype))

    return dict(codes=np.ascontiguousarray(codes).reshape(n_pad // TILE, -1, 64),
                scales=per_tile(scales), offsets=per_tile(offsets), bits=bits, zero=zero,
                shift=shift, out_features=n, group_size=k // groups)


def pack_weight(w: Int4Weight | Int8Weight) -> CpuPackedWeight:
    """A quantized weight, with any leading (stacked layer) axes, in the kernel's layout."""
    lead = w.scales.shape[:-2]
    parts = [_pack_one(jax.tree.map(lambda a, i=i: np.asarray(a)[i], w))
             for i in np.ndindex(*lead)]
    arrays = {}
    for name in ("codes", "scales", "offsets"):
        if parts[0][name] is None:
            arrays[name] = None
        else:
            stacked = np.stack([p[name] for p in parts])
            arrays[name] = jnp.asarray(stacked.reshape(*lead, *stacked.shape[1:]))
    return CpuPackedWeight(**arrays, **{k: parts[0][k] for k in
                                        ("bits", "zero", "shift", "out_features",
                                         "group_size")})


def packable(w) -> bool:
    """Whether the kernel takes this weight: int4 / int8 codes with groups of a multiple of 8."""
    if not isinstance(w, (Int4Weight, Int8Weight)):
        return False
    groups = w.scales.shape[-2]
    k = w.in_features
    return k % groups == 0 and (k // groups) % 8 == 0


def repacks(w, int8_per_channel: bool = False) -> bool:
    """Whether `pack_params` repacks this leaf."""
    if not packable(w):
        return False
    return not (isinstance(w, Int8Weight) and w.scales.shape[-2] == 1 and not int8_per_channel)


def pack_params(params: dict, int8_per_channel: bool = False) -> dict:
    """params with every packable linear kernel (layers and LM head) repacked.

    Int8 weights with one scale per channel stay as they are unless `int8_per_channel`: XLA's
    own int8 dot (AMX) already serves them without a float copy (quantization/linear.py).
    """
    def convert(leaf):
        return pack_weight(leaf) if repacks(leaf, int8_per_channel) else leaf

    is_leaf = lambda x: isinstance(x, (Int4Weight, Int8Weight))  # noqa: E731
    return jax.tree.map(convert, params, is_leaf=is_leaf)
