"""Section `preflight`, first and cheap: nvidia-smi (when present), jax.devices(), versions and
device memory. Without a GPU (and not a dry run) it fails with the reason, and the driver stops
there: a lent machine whose GPU jax cannot see costs seconds, not the whole call."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess

from jaxserve.tools.gpu_check.context import Ctx, importable
from jaxserve.tools.gpu_check.environment import package_versions

SMI_QUERY = ("name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,"
             "clocks.max.mem,power.limit,temperature.gpu,utilization.gpu")


def nvidia_smi() -> dict:
    """nvidia-smi's plain table and a CSV query of the fields a timing depends on (clocks,
    power limit), or why there is none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"available": False, "reason": "nvidia-smi not on PATH"}
    out = {"available": True, "path": exe}
    for key, cmd in (("table", [exe]),
                     ("query", [exe, f"--query-gpu={SMI_QUERY}", "--format=csv"])):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
            out[key] = (proc.stdout.strip() or proc.stderr.strip())[-4000:]
        except (OSError, subprocess.SubprocessError) as e:
            out[key] = f"failed: {type(e).__name__}: {e}"
    return out


def section_preflight(ctx: Ctx) -> dict:
    import jax
    devices = jax.devices()
    res = {"python": platform.python_version(), "platform": platform.platform(),
           "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
           "packages": package_versions(), "default_backend": jax.default_backend(),
           "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices],
           "cpu_count": os.cpu_count(), "dry_run": ctx.args.dry_run,
           "xla_env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_",
                                                                             "TF_CPP"))},
           "importable": {m: importable(m) or "ok" for m in
                          ("gguf", "jinja2", "tqdm", "torch", "transformers", "pytest")},
           "nvidia_smi": nvidia_smi(), "scratch_dir": str(ctx.scratch),
           "ptxas_log": ctx.ptxas_note or "ptxas -v reports go to the scratch ptxas.log"}
    stats = devices[0].memory_stats() or {}
    res["device_memory"] = {k: stats[k] for k in ("bytes_limit", "bytes_in_use",
                                                  "peak_bytes_in_use") if k in stats}
    if not ctx.args.dry_run and jax.default_backend() != "gpu":
        res["_status"] = "failed"
        res["_reason"] = (f"no GPU visible to jax (backend {jax.default_backend()!r}, devices "
                          f"{res['devices']}); nvidia-smi: "
                          f"{'present' if res['nvidia_smi']['available'] else 'absent'}. "
                          "Nothing else runs; use --dry-run on a CPU machine")
    return res


def md_preflight(r: dict) -> list[str]:
    mem = r.get("device_memory", {})
    smi = r.get("nvidia_smi", {})
    lines = [f"- python {r['python']}, jax {r['jax']}, jaxlib {r['jaxlib']}, backend "
             f"{r['default_backend']}", f"- devices: {', '.join(r['devices'])}",
             f"- device memory limit: {mem.get('bytes_limit', 0) / 2**30:.3g} GiB",
             f"- packages: {', '.join(f'{k} {v}' for k, v in r['packages'].items())}",
             f"- importable: {r['importable']}"]
    if smi.get("available"):
        lines += ["- nvidia-smi:", "```", smi.get("query", ""), "```"]
    else:
        lines.append(f"- nvidia-smi: {smi.get('reason')}")
    return lines
