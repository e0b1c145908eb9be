"""Sections `environment` (versions, devices, device memory) and `bandwidth` (measured copy and
read bandwidth, dispatch floor, bf16 matmul rate)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess

from jaxserve.tools.gpu_check.context import Ctx, importable, time_calls
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


def section_environment(ctx: Ctx) -> dict:
    import jax
    dev = jax.devices()
    res = {"python": platform.python_version(), "platform": platform.platform(),
           "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
           "packages": package_versions(), "default_backend": jax.default_backend(),
           "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in dev],
           "cpu_count": os.cpu_count(), "dry_run": ctx.args.dry_run,
           "xla_env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_"))},
           "importable": {m: importable(m) or "ok" for m in
                          ("gguf", "jinja2", "tqdm", "torch", "transformers")}}
    stats = dev[0].memory_stats() or {}
    res["device_memory"] = {k: stats[k] for k in ("bytes_limit", "bytes_in_use",
                                                  "peak_bytes_in_use") if k in stats}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                              "clocks.max.sm,clocks.max.mem,power.limit", "--format=csv"],
                             capture_output=True, text=True, timeout=20)
        res["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except Exception as e:  # noqa: BLE001 - CPU machines have no nvidia-smi
        res["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    return res


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
