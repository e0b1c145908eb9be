"""Section `kernel_tests`: the kernel test suite compiled on the GPU (`pytest -m gpu`), where
pytest and the checkout's tests are there."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

from jaxserve.tools.gpu_check.context import Ctx, importable

REPO = pathlib.Path(__file__).resolve().parents[3]  # the checkout: jaxserve/tools/gpu_check/


# test_kv_int8.py: both attention kernels reading an int8 KV cache (codes + scales);
# test_fused_kv_write.py / test_kv_write.py: the KV write inside the ragged kernel / on its own;
# test_grouped_matmul.py: the MoE experts' grouped matmul kernel; test_lora_kernel.py: the
# multi-LoRA (SGMV) kernel; test_sampling_kernel.py: the GPU step's sampling kernel;
# test_fused_linear.py / test_merge_splits.py: the decode step's fused linears and the combine
# of the attention's splits.
KERNEL_TESTS = ("tests/kernels/test_paged_attention.py",
                "tests/kernels/test_ragged_paged_attention.py",
                "tests/kernels/test_fused_kv_write.py", "tests/kernels/test_kv_write.py",
                "tests/kernels/test_int4_matmul.py",
                "tests/kernels/test_kv_int8.py", "tests/kernels/test_grouped_matmul.py",
                "tests/kernels/test_lora_kernel.py", "tests/kernels/test_sampling_kernel.py",
                "tests/kernels/test_fused_linear.py", "tests/kernels/test_merge_splits.py")


def section_kernel_tests(ctx: Ctx) -> dict:
    """`pytest -m gpu` on the kernel tests: their `compiled` variants, on this GPU."""
    if ctx.args.dry_run:
        return {"_status": "skipped", "_reason": "dry run: the suite runs interpreted in the "
                                                 "CPU test tiers"}
    why = importable("pytest")
    if why:
        return {"_status": "skipped", "_reason": f"pytest not importable here ({why})"}
    budget = max(5.0, ctx.remaining())  # the section's cap: kernel work stays bounded
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           *KERNEL_TESTS]
    env = dict(os.environ, JAX_PLATFORMS="cuda")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=budget)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"_status": "partial", "_reason": f"pytest stopped at the section's cap "
                f"({budget:.0f}s; {ctx.budget_reason()})", "command": " ".join(cmd),
                "timeout_s": budget, "output_tail": out[-3000:]}
    lines = proc.stdout.strip().splitlines()
    res = {"command": " ".join(cmd), "returncode": proc.returncode,
           "summary": lines[-1] if lines else "", "seconds": time.monotonic() - t0,
           "output_tail": (proc.stdout + proc.stderr)[-3000:]}
    if proc.returncode != 0:
        res["_status"] = "failed"
    return res
