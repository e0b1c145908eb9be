"""Quantized linear weights as registered pytrees: the data and its layout, no math.

A linear kernel w [K, N] (in, out) quantized with groups of g rows along K stands for
    w[k, n] = scales[k // g, n] * code[k, n] + offsets[k // g, n]
(the formulas, producers and matmuls are in jaxserve/quantization/). Every array may carry
leading axes (the decoder's stacked [L, ...] layer axis), so shapes below count from the end.

Why the types live in models/: models/llama.py's Linear must tell a quantized kernel from a
float one, and models/checkpoint.py must restore one; models/ imports neither jaxserve nor
pallas_kernels, while jaxserve may import models. So the containers are here and
jaxserve/quantization builds and consumes them.

On disk (orbax) a weight is the dict of its array fields (None where absent); `from_stored`
turns such dicts back into weights by their field names, the one place that reads keys, and
derives the static group size from the shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

# The axes of each array field, counted from the end: "in" runs along K (or K/2, K/g),
# "out" along N. Tensor parallelism splits one of them (jaxserve/runtime/sharding.py).
Layout = tuple[str, str]
# Float fields, kept in float32 whatever the model dtype (codes keep their integer dtypes).
FLOAT32_FIELDS = ("scales", "offsets")


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


class _Weight:
    """Shared accessors; subclasses are frozen, keyword-only, registered dataclasses."""

    BITS: ClassVar[int]
    CODES: ClassVar[str]  # the name of the code array field
    LAYOUT: ClassVar[dict[str, Layout]]

    def arrays(self) -> dict[str, Any]:
        """The array fields that are present, by name (offsets may be absent)."""
        names = (self.CODES, "scales", "offsets")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def out_features(self) -> int:
        return self.scales.shape[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Int4Weight(_Weight):
    """int4 codes u in [0, 15], two per byte (pallas_kernels/int4_matmul.py's packed layout)."""

    BITS: ClassVar[int] = 4
    CODES: ClassVar[str] = "packed"
    LAYOUT: ClassVar[dict[str, Layout]] = {
        "packed": ("in", "out"), "scales": ("in", "out"), "offsets": ("in", "out")}

    packed: Any                # [..., K/2, N] uint8
    scales: Any                # [..., K/g, N] float32
    offsets: Any = None        # [..., K/g, N] float32; None: -8 * scales (symmetric codes)
    group_size: int = _static()  # g

    @property
    def in_features(self) -> int:
        return 2 * self.packed.shape[-2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Int8Weight(_Weight):
    """Signed int8 codes stored output-major (q8[n, k] = code[k, n]): GGUF Q8_0's row layout,
    and the one XLA's CPU int8 dot runs fastest (jaxserve/quantization/linear.py)."""

    BITS: ClassVar[int] = 8
    CODES: ClassVar[str] = "q8"
    LAYOUT: ClassVar[dict[str, Layout]] = {
        "q8": ("out", "in"), "scales": ("in", "out"), "offsets": ("in", "out")}

    q8: Any                    # [..., N, K] int8
    scales: Any                # [..., K/g, N] float32 (K/g = 1: per output channel)
    offsets: Any = None        # [..., K/g, N] float32; None: 0 (symmetric codes)
    group_size: int = _static()  # g (= K per channel)

    @property
    def in_features(self) -> int:
        return self.q8.shape[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuPackedWeight:
    """An Int4Weight or Int8Weight repacked at load for the native CPU matmul
    (jaxserve/native/cpu_quant_matmul.cc has the layout; jaxserve/quantization/cpu_packed.py
    packs it). Outputs in tiles of 16 (N padded up to a multiple of 16):
        w[k, n] = scales[G, n] (u[k, n] - zero) + offsets[G, n] + shift scales[G, n]
    (u unsigned codes; scales and offsets float16 where they are exactly so, e.g. GGUF's).
    Never stored on disk and never sharded: it exists only inside a CPU engine's params."""

    codes: Any                 # [..., N16/16, K/8 (4 bits) or K/4 (8 bits), 64] uint8
    scales: Any                # [..., N16/16, K/g, 16] float32 or float16
    offsets: Any = None        # like scales, or None (0)
    bits: int = _static()      # 4 or 8
    zero: int = _static()      # 8 (int4) or 128 (int8 codes stored as u = c + 128)
    shift: int = _static()     # 8 for int4 with offsets (w = s u + o), else 0
    out_features: int = _static()  # N (the padded outputs are cut off)
    group_size: int = _static()
    # Inside a step only: the arrays are the whole [L, ...] stack and this is layer `layer`'s
    # weight, which the kernel reads in place (models/layer_layout.py layer_views).
    layer: int | None = _static(default=None)

    @property
    def in_features(self) -> int:
        return self.codes.shape[-2] * (8 if self.bits == 4 else 4)

    def at_layer(self, layer: int) -> "CpuPackedWeight":
        """Layer `layer`'s weight of a stack `[L, ...]`, without slicing (no copy)."""
        if self.codes.ndim != 4:
            raise ValueError(f"at_layer needs stacked codes [L, N/16, K/c, 64], got "
                             f"{self.codes.shape}")
        return dataclasses.replace(self, layer=layer)


WEIGHT_TYPES = (Int4Weight, Int8Weight)  # the stored types (from_stored, sharding)
QuantizedWeight = Int4Weight | Int8Weight


def is_quantized(x) -> bool:
    return isinstance(x, (*WEIGHT_TYPES, CpuPackedWeight))


def make_weight(cls, **arrays) -> QuantizedWeight:
    """A weight of type `cls` from its arrays, with the group size read from their shapes."""
    w = cls(**arrays, group_size=0)
    return dataclasses.replace(w, group_size=w.in_features // w.scales.shape[-2])


def _stored_type(node: dict):
    keys = set(node)
    for cls in WEIGHT_TYPES:
        fields = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("static")}
        if {cls.CODES, "scales"} <= keys <= fields:
            return cls
    return None


def from_stored(tree):
    """A params tree restored as plain dicts, with each stored weight rebuilt as its type."""
    if not isinstance(tree, dict):
        return tree
    cls = _stored_type(tree)
    if cls is not None:
        return make_weight(cls, **{k: v for k, v in tree.items() if v is not None})
    return {k: from_stored(v) for k, v in tree.items()}
