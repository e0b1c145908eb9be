"""`jaxserve quantize` end to end on a tiny random model: orbax checkpoint -> LLM(model=DIR)."""

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.cli import main
from models import load_model
from models.checkpoint import save
from jaxserve.testing.tiny_models import TINY_TIED
from models.random_init import random_model

TINY = TINY_TIED
ENGINE = dict(block_size=16, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
              warmup=False)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return str(save(random_model(TINY, seed=11), tmp_path_factory.mktemp("float") / "m"))


def greedy(llm):
    prompts = [[5, 17, 99, 3], list(range(30, 52))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("argv,path", [(["--bits", "4"], "w4a16"),
                                       (["--bits", "8"], "w8a16"),
                                       (["--bits", "8", "--activation-bits", "8"], "w8a8")])
def test_rtn_checkpoint_serves_its_path(float_dir, tmp_path, capsys, argv, path):
    out = str(tmp_path / "q")
    assert main(["quantize", float_dir, "--method", "rtn", *argv, "--out", out]) == 0
    assert path in capsys.readouterr().out
    restored = load_model(out)
    assert restored.quantization == path
    layers = restored.params["layers"]
    kernel = layers["mlp"]["down_proj"]["kernel"]
    if path == "w4a16":
        assert kernel.packed.dtype == np.uint8 and kernel.scales.shape == (2, 2, 128)
        assert "lm_head" not in restored.params
    else:
        assert kernel.q8.dtype == np.int8 and kernel.scales.shape == (2, 1, 128)
        assert restored.params["lm_head"]["kernel"].q8.shape == (256, 128)
    assert kernel.scales.dtype == np.float32
    served = LLM(out, **ENGINE)
    assert served.engine.quantization == path
    # The same RTN done at load time on the float model gives the same tokens.
    assert greedy(served) == greedy(LLM(float_dir, quantization=path, **ENGINE))
    with pytest.raises(ValueError, match="cannot be served as gguf"):
        LLM(out, quantization="gguf", **ENGINE)


def test_unknown_method_and_bad_combinations_are_clear_errors(float_dir, tmp_path, capsys):
    assert main(["quantize", float_dir, "--method", "nope", "--out", str(tmp_path / "a")]) == 2
    assert "method 'nope' is not available" in capsys.readouterr().err
    assert main(["quantize", float_dir, "--bits", "4", "--group-size", "0",
                 "--out", str(tmp_path / "b")]) == 2
    assert "int4 weights are per group" in capsys.readouterr().err
    assert main(["quantize", float_dir, "--bits", "8", "--group-size", "64",
                 "--activation-bits", "8", "--out", str(tmp_path / "c")]) == 2
    assert "W8A8" in capsys.readouterr().err


def test_engine_rejects_unknown_quantization_with_choices():
    with pytest.raises(ValueError, match="w8a16.*w4a16.*w8a8.*gguf"):
        LLM(random_model(TINY), quantization="int3", **ENGINE)
    with pytest.raises(ValueError, match="has none"):  # gguf needs a .gguf file's blocks
        LLM(random_model(TINY), quantization="gguf", **ENGINE)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_are_registered_and_serve(float_dir, tmp_path, capsys, method):
    from jaxserve.quantization.calibration import random_calibration
    from jaxserve.quantization.convert import quantize_model
    from jaxserve.quantization.core import QuantSpec, dequantize_weight
    # The tiny model has no tokenizer: the CLI says so instead of failing inside the method.
    assert main(["quantize", float_dir, "--method", method, "--out", str(tmp_path / "x")]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    model = load_model(float_dir)
    spec = QuantSpec(bits=8, granularity="channel", symmetric=True)
    q = quantize_model(model, method, spec, 16, random_calibration(TINY.vocab_size))
    out = save(q, tmp_path / method)
    served = LLM(str(out), **ENGINE)
    assert served.engine.quantization == "w8a16"
    # GPTQ's int8 kernel stays within a few int8 steps of the float one (AWQ rescales inputs
    # first, so its kernels are not comparable to the float ones element-wise).
    w = np.asarray(model.params["layers"]["mlp"]["down_proj"]["kernel"])[0]
    wq = np.asarray(dequantize_weight(
        jax.tree.map(lambda v: v[0], q.params["layers"]["mlp"]["down_proj"]["kernel"])))
    if method == "gptq":
        assert np.abs(wq - w).max() < 0.02 * np.abs(w).max()
    restored = load_model(str(out)).params["layers"]["mlp"]["down_proj"]["kernel"]
    np.testing.assert_array_equal(restored.q8,
                                  q.params["layers"]["mlp"]["down_proj"]["kernel"].q8)
