"""EngineConfig.gpu_kernels: which Pallas backend (Mosaic GPU or Triton) the attention and int4
kernels lower through, chosen by the device's compute capability (faked devices: no GPU here),
and carried from the config to the runner's backends."""

import types

import pytest

from jaxserve.config import EngineConfig
from jaxserve.runtime import backends
from jaxserve.runtime.runner_factory import build_runner
from jaxserve.runtime.runner_spec import RunnerSpec, StepProgram
from models.config import ModelConfig
from models.random_init import random_model

# head_dim 64: a shape both attention kernels take.
TINY = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=256)


def device(platform: str, capability: str | None = None):
    """What jax.Device says about itself that the choice reads."""
    fake = types.SimpleNamespace(platform=platform)
    if capability is not None:
        fake.compute_capability = capability
    return fake


@pytest.mark.parametrize("dev,expected", [
    (device("gpu", "9.0"), "mosaic"),      # H100 / H200
    (device("gpu", "10.0"), "mosaic"),     # B200
    (device("gpu", "12.0"), "mosaic"),     # RTX 50xx
    (device("gpu", "8.9"), "triton"),      # L4, RTX 40xx (Ada)
    (device("gpu", "8.0"), "triton"),      # A100
    (device("gpu", "gfx90a"), "triton"),   # ROCm reports an architecture name
    (device("gpu"), "triton"),             # a GPU that reports no capability
    (device("cpu"), "triton"),             # interpreted on CPU: the Triton interpreter
])
def test_auto_picks_mosaic_from_compute_capability_9(dev, expected):
    assert backends.gpu_kernels("auto", dev) == expected


@pytest.mark.parametrize("forced", ["mosaic", "triton"])
def test_a_forced_backend_holds_on_any_device(forced):
    for dev in (device("gpu", "9.0"), device("gpu", "8.0"), device("cpu")):
        assert backends.gpu_kernels(forced, dev) == forced


def test_bad_choices_name_the_choices():
    with pytest.raises(ValueError, match=r"gpu_kernels must be one of \('auto', 'mosaic', "
                                         r"'triton'\), got 'cuda'"):
        EngineConfig(model="tiny", gpu_kernels="cuda")
    with pytest.raises(ValueError, match="gpu_kernels must be one of"):
        backends.gpu_kernels("sm90", device("gpu", "9.0"))
    with pytest.raises(ValueError, match="gpu_kernels must be one of"):
        StepProgram(gpu_kernels="auto")  # a program holds the resolved choice


def test_the_choice_reaches_the_attention_backend():
    model = random_model(TINY, seed=0)
    for requested, kernels in (("auto", "triton"), ("mosaic", "mosaic"),
                               ("triton", "triton")):
        config = EngineConfig(model="tiny", warmup=False, max_num_seqs=4,
                              max_num_batched_tokens=32, block_size=16, max_model_len=64,
                              attention_backend="pallas-interpret",
                              linear_backend="pallas-interpret", gpu_kernels=requested,
                              kv_cache_dtype="bfloat16", layer_loop="unrolled")
        program = StepProgram.from_config(config)
        assert program.gpu_kernels == kernels
        spec = RunnerSpec.from_config(config, num_blocks=8, max_model_len=64, eos_ids=(),
                                      program=program)
        runner = build_runner(model, spec)
        assert (runner.attention.kernels, runner.attention.interpret) == (kernels, True)


def test_auto_runs_the_triton_kernel_where_mosaic_cannot_and_a_forced_mosaic_says_why():
    from jaxserve.runtime.attention_backends import PallasAttention
    # A float32 cache: the Mosaic GPU kernel takes bf16 only (its wgmma would run f32 as TF32).
    auto = backends.attention_backend("pallas", TINY, 16, "pallas", gpu_kernels="mosaic",
                                      kv_dtype="float32", gpu_kernels_fallback=True)
    assert auto == PallasAttention(kernels="triton", kv_dtype="float32")
    assert backends.attention_backend("pallas", TINY, 16, "pallas", gpu_kernels="mosaic",
                                      kv_dtype="bfloat16", gpu_kernels_fallback=True) == \
        PallasAttention(kernels="mosaic", kv_dtype="bfloat16")
    with pytest.raises(ValueError, match="the Mosaic GPU kernel: q must be bfloat16.*"
                                         "gpu_kernels='triton'"):
        backends.attention_backend("pallas", TINY, 16, "pallas", gpu_kernels="mosaic",
                                   kv_dtype="float32", gpu_kernels_fallback=False)
    # An int8 cache: q stays in the model's dtype, which the Mosaic kernel takes in bf16 only.
    for model_dtype, kernels in (("bfloat16", "mosaic"), ("float32", "triton")):
        assert backends.attention_backend(
            "pallas", TINY, 16, "pallas", gpu_kernels="mosaic", kv_dtype="int8",
            model_dtype=model_dtype, gpu_kernels_fallback=True) == PallasAttention(
                kernels=kernels, kv_dtype="int8", model_dtype=model_dtype)


def test_interpreted_mosaic_kernels_ask_for_the_unrolled_layers():
    with pytest.raises(ValueError, match="layer_loop='unrolled'"):
        StepProgram(attention_backend="pallas-interpret", gpu_kernels="mosaic")
    assert StepProgram(attention_backend="pallas-interpret", gpu_kernels="mosaic",
                       unroll_layers=True).gpu_kernels == "mosaic"
    assert StepProgram(attention_backend="pallas", gpu_kernels="mosaic").gpu_kernels == "mosaic"
