"""Section `step_dump`: XLA's dump of every engine step the run compiled (--xla_dump_to, limited
to the step module), trimmed and summarised by the compiled-program reader."""

from __future__ import annotations

import importlib
import os
import pathlib

from jaxserve.tools.gpu_check.context import Ctx


STEP_MODULE_RE = ".*_step_impl.*"  # the runner's jitted step (jaxserve/runtime/runner.py)
MAX_DUMP_FILE_BYTES = 8 << 20       # larger dump files (e.g. a big module's PTX) are dropped
DUMP_KEEP_SUFFIXES = (".txt", ".ptx")  # HLO, buffer assignment, thunk sequence, PTX; no objects
# The compiled-program reader of scripts/gpu_step_report.py plugs in here: ("module", "function")
# pairs tried in order, the function taking the dump directory and returning a JSON-able dict.
STEP_DUMP_READERS: tuple = (("jaxserve.tools.compiled_report", "summarise_dump"),)


def step_dump_dir(args) -> pathlib.Path:
    return pathlib.Path(args.out_dir) / "xla_dump_step"


def enable_step_dump(args) -> None:
    """Before jax starts: XLA dumps each compile of the engine's step (HLO before and after
    optimisation, and on a GPU the thunk sequence with every launch) under the out dir; no
    other module is dumped."""
    if args.no_step_dump:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_dump_to={step_dump_dir(args)} "
                               f"--xla_dump_hlo_module_re={STEP_MODULE_RE}").strip()


def read_step_dump(path: pathlib.Path):
    """The first importable STEP_DUMP_READERS entry's summary of the dump, or None."""
    for module, function in STEP_DUMP_READERS:
        try:
            reader = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError):
            continue
        return {"reader": f"{module}.{function}", "summary": reader(path)}
    return None


def section_step_dump(ctx: Ctx) -> dict:
    """What XLA dumped of the steps the engine sections compiled: the files (oversized ones
    dropped so the out dir stays small) and, when available, the reader's summary."""
    d = step_dump_dir(ctx.args)
    if ctx.args.no_step_dump or not d.is_dir():
        return {"_status": "skipped", "_reason": "no dump (--no-step-dump, or no step compiled)"}
    removed = []
    for f in sorted(d.rglob("*")):
        if f.is_file() and (f.stat().st_size > MAX_DUMP_FILE_BYTES
                            or not f.name.endswith(DUMP_KEEP_SUFFIXES)):
            removed.append(f.name)
            f.unlink()
    for sub in sorted((x for x in d.rglob("*") if x.is_dir()), reverse=True):
        if not any(sub.iterdir()):  # emptied above (e.g. a module's object files)
            sub.rmdir()
    files = [f for f in d.rglob("*") if f.is_file()]
    modules = sorted({".".join(f.name.split(".")[:2]) for f in files
                      if f.name.startswith("module_")})
    res = {"dir": str(d), "files": len(files), "bytes": sum(f.stat().st_size for f in files),
           "modules": modules, "removed": len(removed), "removed_examples": removed[:10],
           "kept_suffixes": DUMP_KEEP_SUFFIXES, "max_file_bytes": MAX_DUMP_FILE_BYTES,
           "thunk_files": sorted(f.name for f in files if "thunk" in f.name)}
    try:
        res["reader"] = read_step_dump(d)
    except Exception as e:  # noqa: BLE001 - the files are there anyway
        res["reader"] = {"error": f"{type(e).__name__}: {e}"}
    return res
