"""RunnerSpec and the runner factory (jaxserve/runtime/runner_spec.py, runner_factory.py): what
`from_config` resolves for a machine, the messages for values a runner cannot take, the draft
model's runner built with the target's program choices, and build_runner as the only place a
ModelRunner is constructed."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve import native
from jaxserve.config import EngineConfig
from jaxserve.quantization.paths import prepare_model
from jaxserve.runtime import backends
from jaxserve.runtime.draft_model import draft_proposer
from jaxserve.runtime.runner_factory import build_runner, prepare_weights
from jaxserve.runtime.runner_spec import RunnerSpec, StepProgram
from jaxserve.runtime.sharding import TensorParallel, make_mesh
from models.layer_layout import layer_views, unstack_layers
from models.moe import ragged_gmm
from models.quantized import CpuPackedWeight
from models.random_init import random_model
from models.config import ModelConfig
from jaxserve.testing.tiny_models import TINY_GQA, TINY_TIED

MOE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                  architecture="mixtral", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=True)
SHAPES = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=16, max_model_len=64)


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"model": "tiny", "warmup": False, **SHAPES, **kw})


@pytest.fixture
def machine(request, monkeypatch):
    """The platform jax reports: "cpu" as it is, or "gpu" (this CPU made to look like one)."""
    if request.param == "gpu":
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    return request.param


def test_from_config_takes_explicit_choices_and_the_shapes():
    c = config(attention_backend="xla", linear_backend="xla", kv_cache_dtype="bfloat16",
               layer_loop="unrolled", speculative_config={"method": "ngram",
                                                          "num_speculative_tokens": 3})
    program = StepProgram.from_config(c, poison_rows=True)
    assert program == StepProgram(
        attention_backend="xla", attention_fallback=False, linear_backend="xla",
        gpu_kernels="triton", gpu_kernels_fallback=True, unroll_layers=True, branch_free_sampling=False, fine_decode_buckets=True,
        kv_cache_dtype="bfloat16", structured_outputs=True, poison_rows=True,
        num_speculative_tokens=3)
    spec = RunnerSpec.from_config(c, num_blocks=9, max_model_len=48, eos_ids={7, 2},
                                  program=program)
    assert spec == RunnerSpec(max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
                              num_blocks=9, max_model_len=48, eos_ids=(2, 7), program=program)


@pytest.mark.parametrize("machine", ["gpu"], indirect=True)
def test_from_config_resolves_auto_for_a_gpu(machine):
    program = StepProgram.from_config(config())
    assert program == StepProgram(
        attention_backend="pallas", attention_fallback=True, linear_backend="pallas",
        gpu_kernels="triton", gpu_kernels_fallback=True,  # this CPU has no capability 9.0
        unroll_layers=True, branch_free_sampling=True, sampler_backend="pallas",
        fused_linears=True, fine_decode_buckets=False, kv_cache_dtype="auto",
        structured_outputs=True)
    # Tensor parallel keeps the layer loop; a model without a tokenizer has no grammars; a
    # draft neither grammars nor verification.
    assert not StepProgram.from_config(config(), tensor_parallel=True).unroll_layers
    assert not StepProgram.from_config(config(), tokenizer=False).structured_outputs
    # Fused linears are the Pallas kernel's: XLA linears on a GPU take none.
    assert not StepProgram.from_config(config(linear_backend="xla")).fused_linears
    assert not StepProgram.from_config(config(fused_linears=False)).fused_linears
    with pytest.raises(ValueError, match="fused_linears runs the Pallas fused-linear kernel"):
        dataclasses.replace(program, linear_backend="xla")
    draft = StepProgram.from_config(config(speculative_config={
        "method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}), draft=True)
    assert (draft.structured_outputs, draft.num_speculative_tokens) == (False, 0)


@pytest.mark.skipif(backends.native.unavailable_reason() is not None,
                    reason="the native CPU library is not built here")
def test_native_linears_pick_the_loop_before_the_weights_are_repacked():
    """The CPU unrolls weights the native matmul repacks; StepProgram knows it from the
    quantized weights, before prepare_weights repacks them."""
    quantized, _ = prepare_model(random_model(TINY_TIED), "w4a16")
    c = config(attention_backend="xla", linear_backend="cpu")
    program = StepProgram.from_config(c, params=quantized.params)
    assert program.linear_backend == "cpu" and program.unroll_layers
    prepared = prepare_weights(quantized, dataclasses.replace(program, unroll_layers=False))
    assert backends.has_packed(prepared.params)  # the prediction held
    # Int8 with a scale per channel stays XLA's int8 dot, unpacked: the scan.
    per_channel, _ = prepare_model(random_model(TINY_TIED), "w8a16")
    assert not StepProgram.from_config(c, params=per_channel.params).unroll_layers
    assert not backends.has_packed(prepare_weights(per_channel, program).params)
    # Float weights keep the scan; tensor parallel runs XLA's linears on the stored weights.
    assert not StepProgram.from_config(c, params=random_model(TINY_TIED).params).unroll_layers
    tp = StepProgram.from_config(c, params=quantized.params, tensor_parallel=True)
    assert (tp.linear_backend, tp.unroll_layers) == ("xla", False)


GOOD = dict(num_blocks=8, **SHAPES)


@pytest.mark.parametrize("kw,message", [
    (dict(attention_backend="auto"), "attention_backend must be resolved for this machine, "
                                     "got 'auto'; build the program with StepProgram"),
    (dict(linear_backend="gpu"), "linear_backend must be one of ('xla', 'cpu', 'pallas', "
                                 "'pallas-interpret'), got 'gpu'"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of"),
    (dict(unroll_layers=1), "unroll_layers must be True or False, got 1"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens must be an integer >= 0"),
    (dict(num_speculative_tokens=True), "num_speculative_tokens must be an integer >= 0"),
    (dict(sampler_backend="cpu"), "sampler_backend must be one of ('xla', 'pallas', "
                                  "'pallas-interpret'), got 'cpu'"),
    (dict(sampler_backend="pallas"), "sampler_backend='pallas' is the branch-free sampler's "
                                     "kernel: set branch_free_sampling=True"),
])
def test_program_refuses_what_no_step_compiles(kw, message):
    with pytest.raises(ValueError) as err:
        StepProgram(**kw)
    assert message in str(err.value)


@pytest.mark.parametrize("kw,message", [
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer, got 0"),
    (dict(max_model_len=2.5), "max_model_len must be a positive integer, got 2.5"),
    (dict(block_size=12), "block_size must be a power of 2"),
    (dict(num_blocks=1), "num_blocks must be an integer >= 2 (block 0 is the null block"),
    (dict(max_num_batched_tokens=2), "max_num_batched_tokens (2) must be >= max_num_seqs (4)"),
    (dict(eos_ids="2"), "eos_ids must be token ids (integers >= 0), got '2'"),
    (dict(eos_ids=(1, -1)), "eos_ids must be token ids (integers >= 0), got (1, -1)"),
    (dict(program="xla"), "program must be a StepProgram, got 'xla'"),
])
def test_spec_refuses_shapes_a_runner_cannot_take(kw, message):
    with pytest.raises(ValueError) as err:
        RunnerSpec(**{**GOOD, **kw})
    assert message in str(err.value)


def test_spec_keeps_eos_ids_as_a_tuple():
    assert RunnerSpec(**GOOD, eos_ids=[5, 3]).eos_ids == (5, 3)
    assert RunnerSpec(**GOOD).program == StepProgram()  # the plainest program


@pytest.mark.parametrize("machine", ["cpu", "gpu"], indirect=True)
def test_draft_runner_has_the_targets_program_choices(machine):
    # 32 slots: enough rows for a 3/4 decode bucket (24) where the machine wants them.
    cfg = config(kv_cache_dtype="int8", max_num_seqs=32, max_num_batched_tokens=64,
                 speculative_config={"method": "draft_model", "model": "tiny",
                                     "num_speculative_tokens": 3})
    target = random_model(TINY_GQA, seed=1)
    proposer = draft_proposer(cfg, target=target, draft=random_model(TINY_GQA, seed=2),
                              num_blocks=12, max_model_len=64)
    runner = proposer.runner
    program = StepProgram.from_config(cfg, params=target.params)  # the engine's, tokenizer on
    assert program.kv_cache_dtype == "int8" and program.num_speculative_tokens == 3
    assert runner.spec == RunnerSpec.from_config(
        cfg, num_blocks=12, max_model_len=64,
        program=dataclasses.replace(program, structured_outputs=False, num_speculative_tokens=0))
    assert runner.cache.k.dtype == np.int8 and runner.cache.k.shape[1] == 12
    assert runner.branch_free_sampling == (machine == "gpu") == runner.unroll_layers
    assert (24 in runner.token_buckets) == (machine == "cpu")  # fine decode buckets
    assert proposer.draft is runner.model  # no second copy of the draft's weights


def test_an_moe_draft_runs_its_experts_on_the_targets_grouped_matmul():
    cfg = config(attention_backend="xla", linear_backend="xla", speculative_config={
        "method": "draft_model", "model": "tiny", "num_speculative_tokens": 2})
    proposer = draft_proposer(cfg, target=random_model(MOE, seed=1), draft=random_model(MOE),
                              num_blocks=12, max_model_len=64)
    assert proposer.runner._module.grouped_matmul is not ragged_gmm  # the XLA tiled kernel


def test_build_runner_splits_the_layers_once_and_refuses_them_with_tensor_parallel():
    model = random_model(TINY_GQA)
    spec = RunnerSpec(**GOOD, program=StepProgram(unroll_layers=True))
    split = prepare_weights(model, spec.program)
    assert "layers" not in split.params and "layers_1" in split.params
    again = prepare_weights(split, spec.program)  # prepared already: nothing copied
    assert all(a is b for a, b in zip(jax.tree.leaves(again.params),
                                      jax.tree.leaves(split.params)))
    runner = build_runner(split, spec)
    assert runner.unroll_layers and "layers_0" in runner.model.params
    with pytest.raises(ValueError, match="unroll_layers runs on one device"):
        build_runner(model, spec, tp=TensorParallel(make_mesh(1)))


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="no native library")
def test_unrolled_packed_weights_stay_stacked_and_each_layer_sees_its_own():
    """The native matmul's weights and the norms stay [L, ...] (one buffer each for the step
    call, not one per layer); layer_views gives each layer what a full split would."""
    model, _ = prepare_model(random_model(TINY_GQA, seed=3), "w4a16")
    program = StepProgram(linear_backend="cpu", unroll_layers=True)
    prepared = prepare_weights(model, program).params
    is_packed = lambda x: isinstance(x, CpuPackedWeight)  # noqa: E731
    kept = jax.tree.leaves(prepared["layers"], is_leaf=is_packed)
    assert sum(map(is_packed, kept)) == 7 and all(w.codes.ndim == 4 for w in kept
                                                   if is_packed(w))
    assert not any(is_packed(w) for i in range(TINY_GQA.num_layers)
                   for w in jax.tree.leaves(prepared[f"layers_{i}"], is_leaf=is_packed))
    again = prepare_weights(dataclasses.replace(model, params=prepared), program).params
    assert jax.tree.structure(again, is_leaf=is_packed) == jax.tree.structure(
        prepared, is_leaf=is_packed)

    full = unstack_layers(backends.prepare_params("cpu", model).params, TINY_GQA.num_layers)
    views = layer_views(prepared, TINY_GQA.num_layers)
    assert len(jax.tree.leaves(prepared)) < len(jax.tree.leaves(full))
    assert jax.tree.structure(views, is_leaf=is_packed) == jax.tree.structure(
        full, is_leaf=is_packed)
    for i in range(TINY_GQA.num_layers):
        got = jax.tree.leaves(views[f"layers_{i}"], is_leaf=is_packed)
        want = jax.tree.leaves(full[f"layers_{i}"], is_leaf=is_packed)
        for g, w in zip(got, want):
            if is_packed(w):
                assert g.layer == i
                for name in ("codes", "scales", "offsets"):
                    a, b = getattr(g, name), getattr(w, name)
                    assert (a is None) == (b is None)
                    if a is not None:
                        np.testing.assert_array_equal(np.asarray(a)[i], np.asarray(b))
            else:
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_fused_linears_only_where_the_fused_block_runs_the_model():
    """backends.fused_linear_backend: the interpreted kernel for float weights of a Llama-
    family model; none for quantized weights, LoRA slots, a program without fused linears or a
    model the fused block does not cover (Gemma's norms)."""
    from jaxserve.runtime.runner_spec import LoRASlots
    program = StepProgram(linear_backend="pallas-interpret", attention_backend="xla",
                          unroll_layers=True, fused_linears=True)
    model = random_model(TINY_TIED)
    assert backends.fused_linear_backend(program, model) == backends.PallasFusedLinear(
        interpret=True)
    quantized, _ = prepare_model(model, "w8a16")
    assert backends.fused_linear_backend(program, quantized) is None
    with_lora = dataclasses.replace(program, lora=LoRASlots(max_loras=2, max_rank=8))
    assert backends.fused_linear_backend(with_lora, model) is None
    off = dataclasses.replace(program, fused_linears=False)
    assert backends.fused_linear_backend(off, model) is None
    gemma = dataclasses.replace(model, config=dataclasses.replace(
        model.config, architecture="gemma2", hidden_act="gelu_pytorch_tanh"))
    assert backends.fused_linear_backend(program, gemma) is None
    odd = dataclasses.replace(model, config=dataclasses.replace(model.config,
                                                                intermediate_size=200))
    assert backends.fused_linear_backend(program, odd) is None  # 200: not 16-column tiles
