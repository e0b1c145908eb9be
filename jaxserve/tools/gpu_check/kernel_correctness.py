"""Section `kernel_correctness`: paged attention (decode and ragged), the int4 matmul and the
multi-LoRA kernel on the device against their jax.numpy references (the ragged attention and
int4 cases on both Pallas backends, Triton and Mosaic GPU, where Mosaic takes the case), within the kernel tests'
tolerances; plus an f32 ragged step and one over a > 4 GiB cache (Pallas indexes it with 64-bit
offsets); plus every check a kernel registers in `pallas_kernels.cases.GPU_CHECK_CASES`.

The registry is how a new kernel joins without editing this file: a dict in
pallas_kernels/cases.py, name -> `check(interpret: bool, small: bool) -> dict`, where the dict
holds at least `within_tol` (bool) and `max_abs_err` (float), built from the kernel tests' own
inputs and tolerances; `small` asks for dry-run sizes. Each check runs once, under the budget."""

from __future__ import annotations

import gc

from jaxserve.tools.gpu_check.context import Ctx, run_cases
from jaxserve.tools.gpu_check.kernel_inputs import attention_case, int4_case, ragged_step_case
from jaxserve.tools.gpu_check.lora_kernel import check_lora
from pallas_kernels.cases import ATTENTION_TOLERANCE, INT4_TOLERANCE


def check_attention(ctx: Ctx, model: str, block: int, batch: int) -> dict:
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    c = attention_case(ctx, model, block, batch)
    layer = jnp.int32(c["layers"] - 1)
    args = (c["q"], c["k"], c["v"], layer, c["page_table"], c["context_lens"])
    out = np.asarray(paged_attention(*args, interpret=ctx.prof.interpret), np.float32)
    ref = np.asarray(paged_attention_reference(*args), np.float32)
    tol = ATTENTION_TOLERANCE["bfloat16"]
    err = np.abs(out - ref)
    finite = bool(np.isfinite(out).all())
    ok = finite and bool(np.all(err <= tol["atol"] + tol["rtol"] * np.abs(ref)))
    return {**c["desc"], "dtype": "bfloat16", "finite": finite,
            "max_abs_err": float(np.nanmax(err)) if finite else float("nan"),
            "max_rel_err": float(np.nanmax(err / np.maximum(np.abs(ref), tol["atol"]))),
            "max_abs_ref": float(np.max(np.abs(ref))), "tolerance": tol, "within_tol": ok}


def check_ragged(ctx: Ctx, model: str, block: int, max_ctx: int, decode: int,
                 dtype: str = "bfloat16", cache_gib: float = 0.0) -> dict:
    """The Triton kernel, and the Mosaic GPU one where it takes the case (`mosaic`), vs the
    reference on one step; within_tol holds for both. cache_gib > 0 builds a cache over that
    size (Pallas indexes it with 64-bit offsets above 4 GiB) and frees it afterwards."""
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import ragged_paged_attention_mgpu as mgpu
    from pallas_kernels.mosaic_interpret import interpret_stall, mosaic_interpret
    from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                       ragged_paged_attention_reference)
    c = ragged_step_case(ctx, model, block, max_ctx, decode, dtype, cache_gib)
    q, k, v, table, qs, lens = c["args"]
    args = (q, k, v, jnp.int32(c["layers"] - 1), table, qs, lens)
    ref = np.asarray(ragged_paged_attention_reference(*args), np.float32)
    tol = ATTENTION_TOLERANCE[dtype]

    def judged(out) -> dict:
        out = np.asarray(out, np.float32)
        err = np.abs(out - ref)
        finite = bool(np.isfinite(out).all())
        return {"finite": finite,
                "max_abs_err": float(np.nanmax(err)) if finite else float("nan"),
                "max_rel_err": float(np.nanmax(err / np.maximum(np.abs(ref), tol["atol"]))),
                "within_tol": finite and bool(np.all(err <= tol["atol"]
                                                     + tol["rtol"] * np.abs(ref)))}

    row = {**c["desc"], "dtype": dtype,
           **judged(ragged_paged_attention(*args, interpret=ctx.prof.interpret)),
           "max_abs_ref": float(np.max(np.abs(ref))), "tolerance": tol}
    why = mgpu.unsupported(q.shape[1], k.shape[3], q.shape[2], k.shape[2], q.dtype,
                           kv_dtype=k.dtype)
    stall = interpret_stall(ctx.prof.interpret, q.shape[1] // k.shape[3] + 1)
    if why is None and stall is not None:
        row["mosaic"] = {"skipped": stall}
    elif why is None:
        row["mosaic"] = judged(mgpu.ragged_paged_attention_mgpu(
            *args, interpret=mosaic_interpret(ctx.prof.interpret)))
        row["within_tol"] = row["within_tol"] and row["mosaic"]["within_tol"]
    else:
        row["mosaic"] = {"unsupported": why}
    return row


def check_int4(ctx: Ctx, model: str, k: int, n: int, m: int) -> dict:
    """The Triton kernel, and the Mosaic GPU one where it takes the shape (`mosaic`), against
    the f32 reference; within_tol holds for both."""
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import int4_matmul_mgpu as mgpu
    from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_reference
    from pallas_kernels.cases import int4_error_bound
    from pallas_kernels.mosaic_interpret import mosaic_interpret
    c = int4_case(ctx, model, k, n, m)
    packed, scales, offsets = c["weights"][0]
    g = c["group_size"]
    ref = np.asarray(int4_matmul_reference(c["x"].astype(jnp.float32), packed, scales, offsets,
                                           group_size=g))
    tol = INT4_TOLERANCE["bfloat16"]
    scale = float(np.max(np.abs(ref)))

    def judged(y) -> dict:
        y = np.asarray(y.astype(jnp.float32))
        err = np.abs(y - ref)
        finite = bool(np.isfinite(y).all())
        return {"finite": finite, "max_abs_err": float(err.max()),
                "max_rel_err": float(err.max() / scale),
                "within_tol": finite and bool(np.all(err < int4_error_bound(ref, jnp.bfloat16)))}

    row = {**c["desc"], "dtype": "bfloat16", **judged(int4_matmul(
        c["x"], packed, scales, offsets, group_size=g, interpret=ctx.prof.interpret)),
           "rel_err_note": "normalised by max|reference|", "tolerance": tol}
    why = mgpu.unsupported(m, k, n, g, c["x"].dtype)
    if why is None:
        row["mosaic"] = judged(mgpu.int4_matmul_mgpu(
            c["x"], packed, scales, offsets, group_size=g,
            interpret=mosaic_interpret(ctx.prof.interpret)))
        row["within_tol"] = row["within_tol"] and row["mosaic"]["within_tol"]
    else:
        row["mosaic"] = {"unsupported": why}
    return row


REGISTRY = "GPU_CHECK_CASES"  # in pallas_kernels.cases, see the module docstring


def registered_checks() -> dict:
    import pallas_kernels.cases as cases
    return dict(getattr(cases, REGISTRY, {}))


def check_registered(ctx: Ctx, name: str) -> dict:
    row = registered_checks()[name](interpret=ctx.prof.interpret, small=ctx.args.dry_run)
    missing = {"within_tol", "max_abs_err"} - set(row)
    if missing:
        raise ValueError(f"{REGISTRY}[{name!r}] returned no {sorted(missing)}: a check returns "
                         "at least within_tol and max_abs_err")
    return {"case": name, **row}


# (result key, Profile field with the cases, check): the kernels gpu_check knows itself. The f32
# ragged step (the kernel's other dtype) and the > 4 GiB cache (64-bit offsets) are ragged_extra.
BUILTIN = (("paged_attention", "attn_cases", check_attention),
           ("int4_matmul", "int4_cases", check_int4),
           ("ragged_attention", "ragged_cases", check_ragged),
           ("ragged_extra", "ragged_extra_cases", check_ragged),
           ("lora_sgmv", "lora_cases", check_lora))


def section_kernel_correctness(ctx: Ctx) -> dict:
    res, rows, skipped = {}, [], []
    for key, field, check in BUILTIN:
        res[key], s = run_cases(ctx, getattr(ctx.prof, field), check, key)
        rows, skipped = rows + res[key], skipped + s
    reg = [(name,) for name in sorted(registered_checks())]
    res["registered"], s = run_cases(ctx, reg, check_registered, REGISTRY)
    rows, skipped = rows + res["registered"], skipped + s
    gc.collect()
    bad = [r for r in rows if "error" in r or not r.get("within_tol")]
    res.update(num_cases=len(rows), num_bad=len(bad), registry=REGISTRY,
               registered_names=[k[0] for k in reg])
    if skipped:
        res["skipped_cases"] = skipped
    if bad:
        res["_status"] = "failed"
    elif skipped:
        res["_status"], res["_reason"] = "partial", skipped[0]["reason"]
    return res
