"""Section `bandwidth` (measured copy and read bandwidth, dispatch floor, bf16 matmul rate) and
the package versions preflight records."""

from __future__ import annotations

import importlib.metadata

from jaxserve.tools.gpu_check.context import Ctx, time_calls
from jaxserve.tools.gpu_check.profiles import NOMINAL_BF16_FLOPS, NOMINAL_BW


def package_versions() -> dict:
    wanted = ("jax", "jaxlib", "flax", "numpy", "orbax-checkpoint", "ml_dtypes", "torch",
              "transformers", "safetensors", "tokenizers", "gguf", "jinja2", "tqdm", "flask")
    out = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name in wanted or name.startswith(("jax-cuda", "jax_cuda", "nvidia-cuda-runtime")):
            out[name] = dist.version
    return dict(sorted(out.items()))


def section_bandwidth(ctx: Ctx) -> dict:
    import jax
    import jax.numpy as jnp
    p = ctx.prof
    n = p.copy_bytes // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    copy = time_calls(jax.jit(lambda a: a + 1.0), [(x,)], p.iters, p.reps)
    read = time_calls(jax.jit(lambda a: jnp.max(a)), [(x,)], p.iters, p.reps)
    tiny = jnp.ones((16,), jnp.float32)
    floor = time_calls(jax.jit(lambda a: a + 1.0), [(tiny,)], max(p.iters, 50), p.reps)
    m = p.matmul_n
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = time_calls(jax.jit(lambda u, v: jnp.dot(u, v)), [(a, b)], p.iters, p.reps)
    del x, a, b
    ctx.bandwidth = {"copy": 2 * p.copy_bytes / copy["median_s"],
                     "read": p.copy_bytes / read["median_s"]}
    flops = 2 * m ** 3 / mm["median_s"]
    return {"array_bytes": p.copy_bytes,
            "copy_bw_Bps": ctx.bandwidth["copy"], "copy_note": "read + write bytes / time",
            "read_bw_Bps": ctx.bandwidth["read"], "read_note": "max-reduction, bytes / time",
            "copy_vs_nominal": ctx.bandwidth["copy"] / NOMINAL_BW,
            "dispatch_floor_s": floor["median_s"],
            "dispatch_note": "per-call time of a 16-element jitted add: calls faster than "
                             "about twice this are dispatch-bound",
            "matmul_n": m, "matmul_bf16_flops": flops,
            "matmul_vs_nominal": flops / NOMINAL_BF16_FLOPS}
