"""Lowers (and, with jax-cuda13-plugin installed, compiles) jitted code for an H200 from a CPU.

Lowering catches Triton-backend errors (non-power-of-2 blocks, unsupported ops) without a GPU;
see ../shared/design/GPU.md.
"""

from __future__ import annotations

import jax

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def lower_for_h200(fn, *args):
    """Lowers `jax.jit(fn)` for CUDA; args are jax.ShapeDtypeStruct (or arrays). Returns text."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()
