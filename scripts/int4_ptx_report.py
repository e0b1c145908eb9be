"""PTX instruction counts of the int4 W4A16 kernel's main loop per packed weight byte, and
ptxas registers/spills, for the engine's GEMM shapes, compiled deviceless for sm_90a.

  .venv/bin/python scripts/int4_ptx_report.py [--cases 16x4096x4096 ...] [--kernel FILE]

`--kernel` loads another version of pallas_kernels/int4_matmul.py (e.g. a main checkout's)
for a before/after table. Bit ops: and/or/shr/shl/prmt/bfe on any width, bf16 adds and
conversions, single-byte shared loads (the unpacking's instructions, plus the loop's few
address computations of the same kinds). docs/perf_kernels.md has the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile

from jaxserve.tools import cuda_plugin

cuda_plugin.use_setup_plugin()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.tools import deviceless, ptx_loop  # noqa: E402

CASES = ["1x576x1536", "16x576x1536", "64x576x1536", "16x1536x576", "1x4096x4096",
         "16x4096x4096", "32x4096x4096", "64x4096x4096", "64x4096x14336", "512x4096x14336"]
BIT_OPS = re.compile(r"^(and|or|shr|shl|prmt|bfe)\.|^add\.rn\.bf16|^cvt\.rn\.bf16|"
                     r"^ld\.shared\.b8")


def _module(path: str | None):
    if path is None:
        from pallas_kernels import int4_matmul
        return int4_matmul
    spec = importlib.util.spec_from_file_location("int4_kernel_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ptxas(log: str) -> str:
    part = log.split("Compiling entry function 'int4_matmul'")[-1]
    regs = re.search(r"Used (\d+) registers", part)
    spill = re.search(r"(\d+) bytes spill stores", part)
    return f"{regs.group(1) if regs else '?'} regs, {spill.group(1) if spill else '?'} B spill"


def report(mod, m: int, k: int, n: int, scale_dtype, num_warps: int | None = None) -> dict:
    g = 64 if k == 576 else 128
    s = jax.ShapeDtypeStruct
    args = [s((m, k), jnp.bfloat16), s((k // 2, n), jnp.uint8), s((k // g, n), scale_dtype),
            s((k // g, n), jnp.float32)]  # offsets: float32, as the engine passes them
    with tempfile.TemporaryDirectory(prefix="int4-ptx-") as dump:
        out = deviceless.compile_for_h200(
            lambda x, p, sc, o: mod.int4_matmul(x, p, sc, o, group_size=g,
                                                num_warps=num_warps), args,
            dump_dir=dump, keep_ptx=True)
        ptx = ptx_loop.entry_ptx(dump, "int4_matmul")
    body = ptx_loop.kernel_body(ptx, "int4_matmul")
    loop, looped = ptx_loop.main_loop(body)
    ops = ptx_loop.opcodes(loop)
    bm, bn, bk, sk = mod.pick_blocks(m, k, n, g)
    rows = bk // 2 if looped else k // sk // 2  # packed rows per counted span
    per_thread = rows * bn / ptx_loop.threads_per_block(body)
    bit = sum(c for op, c in ops.items() if BIT_OPS.match(op))
    return dict(case=f"{m}x{k}x{n}", blocks=(bm, bn, bk, sk), bytes=per_thread,
                total=sum(ops.values()) / per_thread, bit=bit / per_thread,
                ptxas=_ptxas(out.ptxas_log))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=CASES, help="MxKxN, bf16 activations")
    ap.add_argument("--kernel", help="another int4_matmul.py to count instead")
    ap.add_argument("--num-warps", type=int, help="Triton warps (default: the kernel's)")
    ap.add_argument("--scale-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = ap.parse_args(argv)
    mod = _module(a.kernel)
    print("| M x K x N | blocks (m, n, k, split) | packed B/thread/iter | PTX instr/B | "
          "bit ops/B | ptxas |")
    print("|---|---|---|---|---|---|")
    for case in a.cases:
        m, k, n = map(int, case.split("x"))
        r = report(mod, m, k, n, jnp.dtype(a.scale_dtype), a.num_warps)
        print(f"| {r['case']} | {r['blocks']} | {r['bytes']:g} | {r['total']:.2f} | "
              f"{r['bit']:.2f} | {r['ptxas']} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
