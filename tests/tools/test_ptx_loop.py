"""PTX main-loop counting (jaxserve/tools/ptx_loop.py) on a hand-written kernel."""

import pytest

from jaxserve.tools import ptx_loop

PTX = """
.visible .entry k(
\t.param .u64 k_param_0
)
.reqntid 128, 1, 1
{
\tmov.u32 \t%r1, 0;
$L__BB0_1:
\tshr.u32 \t%r2, %r1, 4;
\tand.b32 \t%r3, %r2, 983055;
\t@%p1 or.b32 \t%r4, %r3, 1124090624;
\tadd.s32 \t%r1, %r1, 1;
\tsetp.lt.u32 \t%p1, %r1, 8;
\t@%p1 bra \t$L__BB0_1;
\tret;
}
"""


def test_main_loop_counts_the_span_between_label_and_back_branch():
    body = ptx_loop.kernel_body(PTX, "k")
    loop, looped = ptx_loop.main_loop(body)
    assert looped
    ops = ptx_loop.opcodes(loop)
    assert ops == {"shr.u32": 1, "and.b32": 1, "or.b32": 1, "add.s32": 1, "setp.lt.u32": 1,
                   "bra": 1}
    assert ptx_loop.threads_per_block(body) == 128


def test_kernel_without_a_loop_counts_its_body():
    body = ptx_loop.kernel_body(PTX.replace("@%p1 bra \t$L__BB0_1;", ""), "k")
    loop, looped = ptx_loop.main_loop(body)
    assert not looped and ptx_loop.opcodes(loop)["mov.u32"] == 1


def test_entry_ptx_names_the_missing_entry(tmp_path):
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "0.ptx").write_text(PTX)
    assert ptx_loop.entry_ptx(tmp_path, "k") == PTX
    with pytest.raises(FileNotFoundError, match="int4_matmul"):
        ptx_loop.entry_ptx(tmp_path, "int4_matmul")
