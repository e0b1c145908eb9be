"""Section `step_dump`: XLA's dump of every engine step the run compiled (--xla_dump_to, limited
to the step module), written to the scratch folder (never under --out-dir: only the bundle goes
there), summarised by the compiled-program reader, with each engine variant's modules and the
ptxas register / spill counts the ptxas wrapper logged."""

from __future__ import annotations

import importlib
import os
import pathlib
import shutil

from jaxserve.tools.gpu_check.context import Ctx


STEP_MODULE_RE = ".*_step_impl.*"  # the runner's jitted step (jaxserve/runtime/runner.py)
# The compiled-program reader of scripts/gpu_step_report.py plugs in here: ("module", "function")
# pairs tried in order, the function taking the dump directory and returning a JSON-able dict.
STEP_DUMP_READERS: tuple = (("jaxserve.tools.compiled_report", "summarise_dump"),)


def dump_dir(scratch: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(scratch) / "xla_dump"


def stderr_log(scratch: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(scratch) / "stderr.log"


def ptxas_log(scratch: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(scratch) / "ptxas.log"


def enable_step_dump(args, scratch: pathlib.Path) -> str | None:
    """Before jax starts the backend: XLA dumps each compile of the engine's step (HLO before
    and after optimisation, and on a GPU the thunk sequence with every launch, and the PTX)
    under the scratch folder; no other module is dumped. On a GPU with a CUDA toolkit, XLA is
    handed the toolkit through the ptxas wrapper of jaxserve/tools/deviceless.py, which appends
    every kernel's `ptxas -v` report (registers, spills) to scratch/ptxas.log. Returns why no
    ptxas report will be captured, if none will (recorded by preflight)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not args.no_step_dump:
        flags += (f" --xla_dump_to={dump_dir(scratch)} "
                  f"--xla_dump_hlo_module_re={STEP_MODULE_RE}")
    note = None
    if args.dry_run:
        note = "dry run: no ptxas on CPU"
    else:
        from jaxserve.tools import deviceless  # imports jax: JAX_PLATFORMS is set by now
        root = deviceless.cuda_root()
        if root is None:
            note = "no CUDA toolkit with bin/ptxas found ($CUDA_HOME, /usr/local/cuda...)"
        else:
            work = pathlib.Path(scratch) / "ptxas_wrapper"
            shutil.rmtree(work, ignore_errors=True)  # a reused --scratch-dir
            work.mkdir(parents=True)
            cuda = deviceless._ptxas_wrapper_dir(root, work, ptxas_log(scratch))
            flags += f" --xla_gpu_cuda_data_dir={cuda}"
    os.environ["XLA_FLAGS"] = flags.strip()
    return note


def module_name(file_name: str) -> str | None:
    """'module_0042.jit__step_impl' from any file XLA dumped for that module."""
    if not file_name.startswith("module_"):
        return None
    return ".".join(file_name.split(".")[:2])


def traced_dump_names(trace_modules: dict) -> list[str]:
    """The dump names ('module_0042.jit__step_impl') of the modules a trace saw run, from the
    trace summary's {'jit__step_impl#42': events} (the profiler's program_id is the module's
    unique id, which XLA's dump names carry)."""
    names = []
    for label in trace_modules:
        module, _, pid = label.rpartition("#")
        if pid.isdigit():
            names.append(f"module_{int(pid):04d}.{module}")
    return names


def dump_modules(ctx: Ctx) -> set[str]:
    """The step modules dumped so far (empty without a scratch folder or a dump)."""
    if ctx.scratch is None:
        return set()
    d = dump_dir(ctx.scratch)
    if not d.is_dir():
        return set()
    return {m for m in (module_name(f.name) for f in d.iterdir()) if m}


def read_step_dump(path: pathlib.Path):
    """The first importable STEP_DUMP_READERS entry's summary of the dump, or None."""
    for module, function in STEP_DUMP_READERS:
        try:
            reader = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError):
            continue
        return {"reader": f"{module}.{function}", "summary": reader(path)}
    return None


def ptxas_summary(scratch: pathlib.Path) -> dict:
    """Registers and spills per kernel from the ptxas output in the stderr log: the kernels
    with the most registers and every one that spills."""
    from jaxserve.tools.compiled_report import ptxas_kernels
    log = ptxas_log(scratch)
    if not log.is_file():
        return {"kernels": 0, "note": "no ptxas log (see preflight's ptxas_note)"}
    kernels = ptxas_kernels(log.read_text(errors="replace"))
    spilling = {k: v for k, v in kernels.items() if v["spill_bytes"]}
    by_regs = sorted(kernels.items(), key=lambda kv: -(kv[1]["registers"] or 0))[:10]
    return {"kernels": len(kernels), "spilling": spilling,
            "most_registers": dict(by_regs)}


def section_step_dump(ctx: Ctx) -> dict:
    """What XLA dumped of the steps the engine sections compiled: the modules (and which engine
    variant compiled each), the reader's summary and the ptxas register / spill counts. The
    files stay in the scratch folder; the bundle takes a filtered copy."""
    d = dump_dir(ctx.scratch) if ctx.scratch else None
    if ctx.args.no_step_dump or d is None or not d.is_dir():
        return {"_status": "skipped", "_reason": "no dump (--no-step-dump, or no step compiled)"}
    files = [f for f in d.rglob("*") if f.is_file()]
    res = {"dir": str(d), "files": len(files), "bytes": sum(f.stat().st_size for f in files),
           "modules": sorted(dump_modules(ctx)), "variant_modules": ctx.step_modules,
           "traced_modules": ctx.decode_trace.get("modules", {}),
           "thunk_files": sorted(f.name for f in files if "thunk_sequence" in f.name),
           "ptx_files": sorted(f.name for f in files if f.name.endswith(".ptx"))[:50],
           "ptxas": ptxas_summary(ctx.scratch)}
    try:
        res["reader"] = read_step_dump(d)
    except Exception as e:  # noqa: BLE001 - the files are there anyway
        res["reader"] = {"error": f"{type(e).__name__}: {e}"}
    return res


def md_step_dump(r: dict) -> list[str]:
    out = [f"- `{r['dir']}`: {r['files']} files, {r['bytes'] / 2**20:.1f} MiB, modules: "
           f"{', '.join(r['modules']) or 'none'}",
           f"- per engine variant: {r.get('variant_modules')}",
           f"- ptxas: {r['ptxas'].get('kernels', 0)} kernels read, spilling: "
           f"{r['ptxas'].get('spilling') or 'none'}"]
    if r.get("reader"):
        import json
        out.append(f"- reader: {json.dumps(r['reader'], default=str)[:1500]}")
    return out
