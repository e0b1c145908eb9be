"""Attention backends as objects (jaxserve/runtime/attention_backends.py): the runner follows
what a backend declares (step metadata layout, per-shard under tensor parallel, supported
shapes), whatever object carries the declaration."""

import dataclasses
import functools

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.runtime.attention import ragged_attention_xla
from jaxserve.runtime.attention_backends import PallasAttention, XlaAttention
from jaxserve.runtime.backends import attention_backend
from jaxserve.runtime.step_call import StepCall
from jaxserve.runtime.runner_factory import build_runner
from jaxserve.runtime.runner_spec import RunnerSpec
from jaxserve.runtime.sharding import TensorParallel, make_mesh
from models.config import ModelConfig
from models.random_init import random_model

# head_dim 64: a shape the kernel supports, so both backends can run it.
TINY = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=256)
SPEC = RunnerSpec(max_num_seqs=4, max_num_batched_tokens=32, block_size=16, num_blocks=64,
                  max_model_len=64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubclassedXla(XlaAttention):
    """Another object that declares the XLA backend's layout: not the XLA function itself."""


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=5)


def decode_calls(model, attention):
    """Greedy tokens of an engine whose runner uses `attention`, and its StepCalls."""
    engine = LLMEngine(EngineConfig(model="tiny", warmup=False, max_num_seqs=4, block_size=16,
                                    max_model_len=64, max_num_batched_tokens=32,
                                    kv_cache_memory=64 * 16 * TINY.kv_bytes_per_token(4)),
                       model=model)
    engine.runner = build_runner(model, SPEC, attention=attention)
    calls = []
    engine.runner.before_call = calls.append  # sees every device call (the broadcast hook)
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, n in enumerate((5, 21)):
        engine.add_request(str(i), rng.integers(1, 256, n).tolist(), params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    steps = [c for c in calls if isinstance(c, StepCall)]
    assert steps
    return [done["0"], done["1"]], steps


@pytest.mark.parametrize("attention", [XlaAttention(merge_kv_heads=False), SubclassedXla()],
                         ids=["xla-no-merge", "subclass"])
def test_layout_follows_the_declaration(model, attention):
    want, base = decode_calls(model, XlaAttention())
    got, calls = decode_calls(model, attention)
    assert got == want
    for c in base + calls:  # the flat pair and chunk lists, not the page table
        t = c.shape[0]
        assert c.inputs.pairs is not None and c.inputs.pages.shape[0] == t // 16


def test_kernel_backend_gets_the_page_table(model):
    want, _ = decode_calls(model, XlaAttention())
    got, calls = decode_calls(model, PallasAttention(interpret=True))
    assert got == want
    assert all(c.inputs.pairs is None for c in calls)
    # The page table: a row per step row, max_model_len / 16 columns.
    assert {c.inputs.pages.shape for c in calls} <= {(min(c.shape[0], 4), 4) for c in calls}


def test_kernel_backend_with_a_bf16_cache_writes_inside_the_kernel():
    """A bf16 model (bf16 cache): the kernel that attends also writes the step's keys and
    values (ragged_paged_attention_write); greedy tokens as the XLA backend's."""
    model = random_model(TINY, "bfloat16", seed=5)
    want, _ = decode_calls(model, XlaAttention())
    got, _ = decode_calls(model, PallasAttention(interpret=True))
    assert got == want


def test_a_bare_function_is_refused_not_run_on_a_slow_path(model):
    with pytest.raises(TypeError, match="must be an AttentionBackend"):
        build_runner(model, SPEC, attention=functools.partial(ragged_attention_xla))


def test_supports_reports_what_the_kernel_cannot_run():
    odd = dataclasses.replace(TINY, head_dim=32)
    kernel_reasons = ("head_dim 32 (kernel: (64, 128))",
                      "block_size 4 (kernel: (8, 16, 32, 64, 128))")
    assert PallasAttention().supports(odd, 4) == kernel_reasons
    assert PallasAttention().supports(TINY, 16) == ()
    assert XlaAttention().supports(odd, 4) == ()
    # auto falls back to XLA; an explicit choice is an error naming every reason.
    assert attention_backend("pallas", odd, 4, "auto") == XlaAttention()
    assert attention_backend("pallas-interpret", TINY, 16, "auto") == \
        PallasAttention(interpret=True)
    with pytest.raises(ValueError) as err:
        attention_backend("pallas", odd, 4, "pallas")
    assert str(err.value) == (f"attention_backend='pallas' cannot run {', '.join(kernel_reasons)}"
                              "; use attention_backend='xla'")


def test_runner_refuses_a_backend_that_cannot_run_the_model(model):
    with pytest.raises(ValueError, match="'pallas' cannot run block_size 4"):
        build_runner(model, dataclasses.replace(SPEC, block_size=4),
                     attention=PallasAttention())


def test_tensor_parallel_wraps_as_each_backend_declares():
    tp = TensorParallel(make_mesh(1))
    xla = tp.attention(SubclassedXla())
    # Annotated, with K kept a batch axis (no all-gather of a K-split cache).
    assert (xla.name, xla.layout, xla.per_shard) == ("xla", "ragged", False)
    assert xla.inner == SubclassedXla(merge_kv_heads=False)
    kernel = tp.attention(PallasAttention(interpret=True))
    assert (kernel.name, kernel.layout, kernel.per_shard) == \
        ("pallas-interpret", "page_table", True)
    assert kernel.inner == PallasAttention(interpret=True)
