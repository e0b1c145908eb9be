"""The int4 weights as the GPU kernel reads them: scales in bfloat16, offsets in float32.

Stored weights (models/quantized.py, checkpoints, the CPU paths) keep float32 scales and
offsets. The Pallas W4A16 kernel (pallas_kernels/int4_matmul.py) reads any float dtype and
applies them in float32 after its dot, so at load the engine's GPU program gets its scales in
bfloat16: 2 bytes per group and column instead of 4. Offsets stay float32: an offset is a
group's minimum, ~7.5 steps from zero, so its bfloat16 rounding (~0.015 step) is shared by
all g weights of the group and adds up over activations whose group sums do not cancel
(+0.03-0.05 relative output error at mean-1 activations, against int4's own 0.1-0.2); the
scales' rounding is re-centred into them (below). docs/quantization.md, "Scales on the
GPU", has the measured table (scripts/int4_scale_dtype_error.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.quantized import Int4Weight

GPU_SCALE_DTYPE = jnp.bfloat16


def _cast(x, dtype):
    if x is None:
        return None
    if isinstance(x, jax.ShapeDtypeStruct):  # abstract params (the deviceless step report)
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return jnp.asarray(x, dtype)


# Codes are 0..15: rounding a scale moves s * u by (s16 - s) * u, which for u far from the
# middle adds up over a group when the activations' group sums do not cancel. Moving the
# offset by (s - s16) * 7.5 centres that error on the codes' mid-range, as symmetric codes'
# s * (u - 8) already are.
_MID_CODE = 7.5


def gpu_int4(w: Int4Weight) -> Int4Weight:
    """`w` with bfloat16 scales and, with offsets, float32 offsets re-centred for them."""
    s16 = _cast(w.scales, GPU_SCALE_DTYPE)
    if w.offsets is None or isinstance(s16, jax.ShapeDtypeStruct):
        return dataclasses.replace(w, scales=s16)
    shift = (w.scales.astype(jnp.float32) - s16.astype(jnp.float32)) * _MID_CODE
    return dataclasses.replace(w, scales=s16,
                               offsets=w.offsets.astype(jnp.float32) + shift)


def gpu_params(params):
    """Every Int4Weight in `params` as `gpu_int4` makes it; other leaves as they are."""
    return jax.tree.map(lambda w: gpu_int4(w) if isinstance(w, Int4Weight) else w, params,
                        is_leaf=lambda x: isinstance(x, Int4Weight))
