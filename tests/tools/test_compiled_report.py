"""The compiled-program reader on hand-written dumps in XLA's formats (no plugin needed):
nesting, loop and branch labels, CUDA graphs, trip counts, weight copies, ptxas reports."""

from types import SimpleNamespace

from jaxserve.tools import compiled_report, thunks
from jaxserve.tools.hlo_text import Module

# A layer loop (trip count 4) whose body slices a [4, 8, 8] weight into a fresh buffer (async
# dynamic-slice copy) before a GEMM, then a sampler conditional outside any CUDA graph.
# Quirks kept from XLA's printer: "condition:" at column 0, "No thunks." before a label.
SEQUENCE = """\
000: kCommandBuffer [source       | next=007 (1)] 
    001: kCopy         [source | sink] kCopy
    002: kCustomKernel [source | sink] loop_select_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
007: kWhile         [prev=000 (1) | next=000 (1)]   
condition:
    008: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    009: kAsyncStart    [source        | next=000 (14)] stream=computation_stream[2], async_id=9
        011: kDynamicSliceFusion [source | sink] params=1, results=1
            010: kCopy [source | sink] kCopy
    012: kAsyncDone     [source        | sink         ] async_id=9
    000: kCommandBuffer [prev=037 (4)  | next=049 (2) ] 
        013: kCustomKernel [source       | next=042 (1)] gemm_fusion_dot grid: [8, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
        014: kCustomKernel [prev=041 (1) | next=045 (3)] ragged_paged_attention grid: [4, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
020: kConditional   [prev=000 (1) | next=000 (1)]   
  false_branch:
    021: kCustomKernel [source | sink] cheap grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  true_branch:
    022: kConditional   [prev=000 (1) | next=000 (1)]       
      false_branch:
        No thunks.      true_branch:
        023: kCustomKernel [source | sink] inner grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    024: kCustomKernel [source | sink] costly_a grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""

METADATA = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n'
    f'    thunk_id: {i}\n  }}\n  thunk_kind: "k"\n}}\n'
    for i, name in [(7, "while.1"), (11, "loop_dynamic_slice_fusion.1"), (13, "gemm_fusion_dot"),
                    (20, "cond.1"), (22, "cond.2")])

HLO = """\
%fused_dynamic_slice (param_0.1: bf16[4,8,8], param_1.1: s32[]) -> bf16[1,8,8] {
  ROOT %ds.1 = bf16[1,8,8]{2,1,0} dynamic-slice(%param_0.1, %param_1.1), dynamic_slice_sizes={1,8,8}
}
%gemm_computation (param_0.2: bf16[1,8,8], param_1.2: bf16[1,4,8]) -> bf16[1,4,8] {
  ROOT %dot.1 = bf16[1,4,8]{2,1,0} dot(%param_1.2, %param_0.2)
}
ENTRY %main (p: (s32[], bf16[4,8,8])) -> bf16[1,4,8] {
  %loop_dynamic_slice_fusion.1 = bf16[1,8,8]{2,1,0} fusion(%arg_tuple.7#1, %arg_tuple.7#0), kind=kLoop, calls=%fused_dynamic_slice
  %gemm_fusion_dot = bf16[1,4,8]{2,1,0} fusion(%loop_dynamic_slice_fusion.1, %x), kind=kCustom, calls=%gemm_computation
  %while.1 = (s32[], bf16[4,8,8]{2,1,0}) while(%tuple.1), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"4"}}
}
"""

PTXAS = """\
ptxas info    : Compiling entry function 'ragged_paged_attention' for 'sm_90a'
ptxas info    : Function properties for ragged_paged_attention
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 63 registers, used 1 barriers
ptxas info    : Compiling entry function 'int4_matmul' for 'sm_90a'
ptxas info    : Function properties for int4_matmul
    8 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers
"""


def parsed():
    tree = thunks.parse_sequence(SEQUENCE)
    names = thunks.parse_metadata(METADATA)
    for t, _ in thunks.walk(tree):
        t.hlo = names.get(t.id)
    return tree


def test_sequence_nesting_and_labels():
    tree = parsed()
    assert [t.kind for t in tree] == ["kCommandBuffer", "kWhile", "kConditional"]
    loop, cond = tree[1], tree[2]
    assert set(loop.children) == {"condition", "body"}
    assert [t.id for t in loop.children["condition"]] == [8]
    assert [t.kind for t in loop.children["body"]] == ["kAsyncStart", "kAsyncDone",
                                                        "kCommandBuffer"]
    assert [t.id for t in cond.children["false_branch"]] == [21]
    inner = cond.children["true_branch"][0]
    assert [t.id for t in cond.children["true_branch"]] == [22, 24]
    assert inner.children.get("false_branch", []) == []
    assert [t.id for t in inner.children["true_branch"]] == [23]
    in_graph = {t.id: g for t, g in thunks.walk(tree)}
    assert in_graph[14] and in_graph[2] and not in_graph[21]


def test_counts_of_the_hand_written_step():
    memory = SimpleNamespace(alias_size_in_bytes=100, argument_size_in_bytes=300,
                             temp_size_in_bytes=7)
    r = compiled_report.analyse(parsed(), Module.parse(HLO), num_layers=4,
                                stacked={("bf16", (4, 8, 8))}, memory=memory,
                                cache_bytes=100, ptxas_log=PTXAS)
    assert r.layer_loop and not r.layer_loop_in_graph
    assert r.weight_copies_per_layer == 1  # the slice copy; the GEMM reads its result
    assert r.copies_per_layer == 1
    assert r.kernels_per_layer == 2  # GEMM and attention (the copy is not a kernel)
    # Host launches: 1 graph + 4 x (condition kernel + slice copy + 1 graph) + the costlier
    # branch (inner conditional's kernel + costly_a).
    assert r.launches_per_step == 1 + 4 * 3 + 2
    assert r.kernels_per_step == 1 + 4 * 3 + 2
    assert r.host_sync == 2 and r.command_buffers == 2 and r.cache_aliased
    assert r.kernels == {"ragged_paged_attention": {"registers": 63, "spill_bytes": 0},
                         "int4_matmul": {"registers": 255, "spill_bytes": 28}}


def test_unrolled_layers_are_counted_by_their_ops_names():
    seq = """\
000: kCommandBuffer [source | sink] 
    001: kCustomKernel [source | sink] a grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    002: kCustomKernel [source | sink] b grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    003: kCustomKernel [source | sink] c grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""
    hlo = """\
ENTRY %main (p: f32[2]) -> f32[2] {
  %a = f32[2]{0} fusion(%p), kind=kLoop, calls=%x, metadata={op_name="jit(f)/Llama/layers_0/mlp/mul"}
  %b = f32[2]{0} fusion(%a), kind=kLoop, calls=%x, metadata={op_name="jit(f)/Llama/layers_1/mlp/mul"}
  %c = f32[2]{0} fusion(%b), kind=kLoop, calls=%x, metadata={op_name="jit(f)/sampling/max"}
}
"""
    tree = thunks.parse_sequence(seq)
    for t, _ in thunks.walk(tree):
        t.hlo = {1: "a", 2: "b", 3: "c"}.get(t.id)
    memory = SimpleNamespace(alias_size_in_bytes=0, argument_size_in_bytes=0,
                             temp_size_in_bytes=0)
    r = compiled_report.analyse(tree, Module.parse(hlo), num_layers=2, stacked=set(),
                                memory=memory, cache_bytes=0)
    assert not r.layer_loop and r.kernels_per_layer == 1 and r.kernels_per_step == 3
    assert r.launches_per_step == 1 and r.host_sync == 0


def test_dump_folder_summary_counts_the_hand_written_step(tmp_path):
    """gpu_check's reader of its XLA dump folder: the same launch, graph and sync counts as
    the by-hand figures above, found by the dump's file names."""
    name = "module_0042.jit__step_impl"
    (tmp_path / f"{name}.thunk_sequence_after_thunk_passes.txt").write_text(SEQUENCE)
    (tmp_path / f"{name}.thunk_metadata.txt").write_text(METADATA)
    (tmp_path / f"{name}.sm_9.0a_gpu_after_optimizations.txt").write_text(HLO)
    s = compiled_report.summarise_dump(tmp_path)
    assert list(s) == [name]
    got = s[name]
    assert got["launches_per_step"] == got["kernels_per_step"] == 1 + 4 * 3 + 2
    assert (got["host_sync"], got["command_buffers"], got["copies"]) == (2, 2, 1)
    assert compiled_report.summarise_dump(tmp_path / "nothing-here") == {}
