"""The engine in its GPU configuration, run on CPU, against HF transformers' greedy tokens.

The GPU program (unrolled layers over per-layer weights, the branch-free sampler, the Pallas
attention kernel and Pallas linears; `backends.gpu_step()` true) with the kernels in interpret
mode, float32 so the tokens can be compared exactly with HF's float32 full recompute. The
models have head_dim 64, which the attention kernel takes (the family tests' tiny models use
16 and 32, which fall back to XLA attention)."""

import pytest

from test_model_families import (BASE, GREEDY_PROMPTS, GREEDY_TOKENS, engine_greedy,
                                 run_reference)

pytestmark = pytest.mark.hf_ref

MODELS = [
    # 2 queries per KV head, rope scaling on.
    {"name": "llama_hd64", "model_type": "llama", "seed": 20, "greedy": True, "config": dict(
        BASE, head_dim=64, rope_scaling={"rope_type": "linear", "factor": 2.0})},
    # 3 queries per KV head (SmolLM2's grouping, padded to 4 inside the kernel), q/k norms.
    {"name": "qwen3_hd64", "model_type": "qwen3", "seed": 21, "greedy": True, "config": dict(
        BASE, num_attention_heads=6, num_key_value_heads=2, head_dim=64, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True)},
]
# bf16, for the Mosaic GPU kernels (bf16 only): weights drawn 20x wider than HF's default make
# logits peaked enough (smallest top-2 gap 0.24 along the greedy tokens) that the bf16 step's
# rounding cannot flip them; the engine's bf16 XLA path checks that in the same test.
# 2 queries per KV head: JAX's GPU interpreter runs a program's G + 1 warpgroups as threads,
# and with 4 (G = 3) it can stall on this 2-core machine before the producer warpgroup's first
# instruction (docs/gpu.md); G = 3 is covered by the kernel tests' mixes that do not stall.
BF16_MODEL = {"name": "qwen3_hd64_peaked", "model_type": "qwen3", "seed": 26, "greedy": True,
              "config": dict(BASE, num_attention_heads=6, num_key_value_heads=3, head_dim=64,
                             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             initializer_range=2.0)}
# fp32 vs fp32: logits agree to summation order; a top-2 gap over this cannot flip.
MIN_MARGIN = 4e-4
BF16_MIN_MARGIN = 0.1


@pytest.fixture(scope="module")
def reference():
    return run_reference("ref_families", {
        "models": MODELS + [BF16_MODEL], "prompts": [], "greedy_prompts": GREEDY_PROMPTS,
        "greedy_tokens": GREEDY_TOKENS})


@pytest.mark.parametrize("name", [m["name"] for m in MODELS])
def test_gpu_program_greedy_matches_hf(reference, name, monkeypatch):
    from jaxserve import EngineConfig, LLMEngine
    from jaxserve.runtime import backends
    from models import load_model
    assert reference["json"]["margins"][name] > MIN_MARGIN
    monkeypatch.setattr(backends, "gpu_step", lambda: True)
    model = load_model(reference["workdir"] / name, dtype="float32")
    engine = LLMEngine(EngineConfig(
        model=model.source, dtype="float32", warmup=False, block_size=8, max_num_seqs=4,
        max_num_batched_tokens=16, max_model_len=64, attention_backend="pallas-interpret",
        linear_backend="pallas-interpret"), model=model)
    runner = engine.runner
    assert runner.unroll_layers and runner.branch_free_sampling
    assert runner.attention.name.startswith("pallas")
    # Every step here has <= 16 tokens: each block's linears run the fused-linear kernel.
    assert runner.fused_linear is not None and runner.fused_linear.interpret
    for i, got in enumerate(engine_greedy(engine)):
        assert got == reference[f"{name}/greedy/{i}"].tolist(), (name, i)


def bf16_two_row_greedy(model, prompts, new, **kw):
    """Greedy tokens of `prompts` (lists of ids), two rows at a time, from a bf16 GPU-program
    engine with `kw`'s backends; and its runner. The cache holds both rows at max_model_len
    and a spare block, not the CPU default of 1 GiB: the GPU interpreter copies the kernel's
    cache operands into every warpgroup thread's buffers on each call, which with 1 GiB took
    most of a test's minutes."""
    from jaxserve import EngineConfig, LLMEngine, SamplingParams
    kv_memory = (2 * 64 // 16 + 1) * 16 * model.config.kv_bytes_per_token(2)
    engine = LLMEngine(EngineConfig(
        model=model.source, dtype="bfloat16", warmup=False, block_size=16, max_num_seqs=2,
        max_num_batched_tokens=16, max_model_len=64, kv_cache_memory=kv_memory, **kw),
        model=model)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step()
                    if o.finished})
    return [got[f"r{i}"] for i in range(len(prompts))], engine.runner


def test_gpu_program_on_mosaic_gpu_kernels_greedy_matches_hf(reference, monkeypatch):
    """The GPU program with the Mosaic GPU attention kernel (Hopper's, gpu_kernels="mosaic")
    in JAX's GPU interpret mode, bf16, against HF's float32 greedy tokens: prefill chunks of
    16 tokens over cached pages beside decodes, 2 queries per KV head. The engine's bf16 XLA
    path runs first, the control that bf16 alone flips nothing on this model."""
    from jaxserve.runtime import backends
    from models import load_model
    name = BF16_MODEL["name"]
    assert reference["json"]["margins"][name] > BF16_MIN_MARGIN
    monkeypatch.setattr(backends, "gpu_step", lambda: True)
    model = load_model(reference["workdir"] / name, dtype="bfloat16")
    # Two prompts, 5 and 19 tokens, two at a time: the 19 are two chunks (the second over a
    # cached page) while the other row decodes. Four tokens each: the interpreter runs every
    # warpgroup of every program as a thread (minutes per prompt on 2 cores).
    prompts, new = (0, 3), 4
    want = [reference[f"{name}/greedy/{i}"].tolist()[:new] for i in prompts]
    for attention, kernels in (("xla", "auto"), ("pallas-interpret", "mosaic")):
        got, runner = bf16_two_row_greedy(model, [GREEDY_PROMPTS[i] for i in prompts], new,
                                          attention_backend=attention, linear_backend="xla",
                                          gpu_kernels=kernels)
        assert runner.unroll_layers and runner.branch_free_sampling
        assert runner.attention.name == attention
        if attention != "xla":
            assert runner.attention.kernels == "mosaic"
        assert got == want, attention


# A Qwen3-MoE-shaped bf16 model the Mosaic GPU kernels take whole: head_dim 64 with 2 queries
# per KV head (the attention kernel), and expert widths 64 (D) and 128 (F), multiples of 64
# (the grouped matmul kernel, every projection). Peaked as BF16_MODEL; seed 28 is the first
# from 27 whose bf16 XLA control (below) keeps HF's tokens (27, 29 and 30 flip one: a near-tie
# of the router or of the logits in bf16).
BF16_MOE_MODEL = {"name": "qwen3_moe_hd64_peaked", "model_type": "qwen3_moe", "seed": 28,
                  "greedy": True, "config": dict(
                      BASE, head_dim=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=128, norm_topk_prob=True, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=2.0)}


# The prompts and tokens compared (interpreting every kernel takes minutes a prompt): a
# 5-token prompt and a 19-token one (two chunks, the second over a cached page) beside it.
MOE_PROMPTS, MOE_TOKENS = [GREEDY_PROMPTS[0], GREEDY_PROMPTS[3]], 4


@pytest.fixture(scope="module")
def moe_reference():
    return run_reference("ref_families", {
        "models": [BF16_MOE_MODEL], "prompts": [], "greedy_prompts": MOE_PROMPTS,
        "greedy_tokens": MOE_TOKENS})


def test_gpu_program_moe_on_mosaic_gpu_kernels_greedy_matches_hf(moe_reference, monkeypatch):
    """The GPU program of a MoE model with the Mosaic GPU attention and grouped matmul kernels
    (gpu_kernels="mosaic", linear_backend="pallas-interpret") in JAX's GPU interpret mode,
    bf16, against HF's float32 greedy tokens; the Triton grouped matmul must not run. The
    engine's bf16 XLA path runs first, the control that bf16 alone flips nothing here."""
    from jaxserve.runtime import backends
    from jaxserve.runtime import grouped_matmul as gmm_backend
    from models import load_model
    name = BF16_MOE_MODEL["name"]
    assert moe_reference["json"]["margins"][name] > BF16_MIN_MARGIN
    monkeypatch.setattr(backends, "gpu_step", lambda: True)

    def triton(*a, **kw):
        raise AssertionError("the Triton grouped matmul ran where the Mosaic GPU one takes "
                             "the projection")
    monkeypatch.setattr(gmm_backend, "grouped_matmul", triton)
    traced, mosaic = [], gmm_backend.grouped_matmul_mgpu
    monkeypatch.setattr(gmm_backend, "grouped_matmul_mgpu",
                        lambda *a, **kw: traced.append(a[1].shape) or mosaic(*a, **kw))
    model = load_model(moe_reference["workdir"] / name, dtype="bfloat16")
    assert model.config.num_experts == 4
    want = [moe_reference[f"{name}/greedy/{i}"].tolist() for i in range(len(MOE_PROMPTS))]
    for backend, kernels in (("xla", "auto"), ("pallas-interpret", "mosaic")):
        got, runner = bf16_two_row_greedy(model, MOE_PROMPTS, MOE_TOKENS,
                                          attention_backend=backend, linear_backend=backend,
                                          gpu_kernels=kernels)
        assert runner.unroll_layers and runner.attention.name == backend
        assert got == want, backend
    # Every layer's three projections (gate/up [E, 64, 128], down [E, 128, 64]) in each
    # traced step program.
    assert set(traced) == {(4, 64, 128), (4, 128, 64)} and len(traced) % 9 == 0, traced
