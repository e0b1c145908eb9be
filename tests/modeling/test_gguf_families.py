"""Qwen3 and Phi-3 GGUF files: written from the tiny HF models of test_model_families under
llama.cpp's own tensor names (gguf-py's TensorNameMap) and metadata keys per architecture,
read back by models/gguf_loader.py; logits must equal transformers' on the source model."""



import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from models.gguf_loader import GGUFError, read_gguf
from models.model import Model, _to_device
from models.weights import params_from_hf
from test_gguf_loader import QT, write_gguf
from test_model_families import ATOL, BASE, PROMPTS, reference  # noqa: F401 (fixture)

pytestmark = pytest.mark.hf_ref
ARCH = {"qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3}


def _meta(arch: str, head_dim: int, theta: float, eps: float, kv: int) -> dict:
    """llama.cpp's metadata keys for `arch` (convert_hf_to_gguf writes these)."""
    return {f"{arch}.block_count": BASE["num_hidden_layers"], f"{arch}.context_length": 256,
            f"{arch}.embedding_length": BASE["hidden_size"],
            f"{arch}.feed_forward_length": BASE["intermediate_size"],
            f"{arch}.attention.head_count": BASE["num_attention_heads"],
            f"{arch}.attention.head_count_kv": kv,
            f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
            f"{arch}.rope.dimension_count": head_dim, f"{arch}.rope.freq_base": theta,
            f"{arch}.attention.layer_norm_rms_epsilon": eps,
            f"{arch}.vocab_size": BASE["vocab_size"]}


def _write(reference, name, arch, path, qtype=QT.F32, **meta):
    hf = load_file(reference["workdir"] / name / "model.safetensors")
    names = gguf.get_tensor_name_map(ARCH[arch], BASE["num_hidden_layers"])
    tensors = {names.get_name(k, try_suffixes=(".weight", ".bias")): v for k, v in hf.items()}
    assert None not in tensors, sorted(k for k in hf if names.get_name(
        k, try_suffixes=(".weight", ".bias")) is None)
    head_dim = 32 if name == "qwen3" else 16
    theta, eps = (1e6, 1e-6) if arch == "qwen3" else (10000.0, 1e-5)
    kv = 4 if name == "phi3_plain" else BASE["num_key_value_heads"]
    write_gguf(path, tensors, arch=arch, qtype=qtype,
               meta={**_meta(arch, head_dim, theta, eps, kv), **meta})
    return path


def _model(ckpt) -> Model:
    params = params_from_hf(ckpt.tensors, ckpt.config, np.float32)
    return Model(config=ckpt.config, params=_to_device(params, "float32"), tokenizer=None,
                 dtype="float32", source=str(ckpt.path), raw=ckpt.raw)


@pytest.mark.parametrize("name, arch", [("qwen3", "qwen3"), ("phi3_plain", "phi3")])
def test_gguf_logits_match_hf(reference, tmp_path, name, arch):
    ckpt = read_gguf(_write(reference, name, arch, tmp_path / f"{name}.gguf"))
    assert ckpt.config.architecture == arch
    assert ckpt.config.qk_norm == ("per_head" if arch == "qwen3" else "none")
    model = _model(ckpt)
    for i, ids in enumerate(PROMPTS):
        np.testing.assert_allclose(model.forward_logits(ids), reference[f"{name}/{i}"],
                                   atol=ATOL, rtol=0)


def test_phi3_fused_q8_0_blocks_split_by_rows(reference, tmp_path):
    """The raw Q8_0 blocks of the fused qkv / gate_up matrices split like their float copies:
    served GGUF-native, the model computes the dequantized model's logits."""
    from jaxserve.quantization.paths import prepare_model
    ckpt = read_gguf(_write(reference, "phi3_plain", "phi3", tmp_path / "q8.gguf", QT.Q8_0))
    q = "model.layers.1.self_attn.k_proj.weight"
    raw = ckpt.raw[q]
    assert raw.shape == ckpt.tensors[q].shape
    np.testing.assert_array_equal(
        gguf.quants.dequantize(raw.data, raw.qtype).reshape(raw.shape), ckpt.tensors[q])
    import jax.numpy as jnp
    from jaxserve.runtime import backends
    model = _model(ckpt)
    native, _ = prepare_model(model, "gguf")
    assert type(native.params["layers"]["attn"]["q_proj"]["kernel"]).__name__ == "Int8Weight"
    ids = jnp.asarray([PROMPTS[0]], jnp.int32)  # [1, T]
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    module = native.module(linear=backends.linear_backend("xla"))
    got = module.apply({"params": native.params}, ids, positions)[0][0]
    np.testing.assert_allclose(got, model.forward_logits(PROMPTS[0]), atol=ATOL, rtol=0)


def test_phi3_gguf_window_caps_context(reference, tmp_path):
    path = _write(reference, "phi3_plain", "phi3", tmp_path / "w.gguf",
                  **{"phi3.attention.sliding_window": 48})
    assert read_gguf(path).config.max_position_embeddings == 48


def test_phi3_gguf_longrope_factors_refused(reference, tmp_path):
    path = tmp_path / "lr.gguf"
    hf = load_file(reference["workdir"] / "phi3_plain" / "model.safetensors")
    names = gguf.get_tensor_name_map(ARCH["phi3"], BASE["num_hidden_layers"])
    tensors = {names.get_name(k, try_suffixes=(".weight", ".bias")): v for k, v in hf.items()}
    tensors["rope_factors_long.weight"] = np.ones(8, np.float32)
    write_gguf(path, tensors, arch="phi3", meta=_meta("phi3", 16, 10000.0, 1e-5, 4))
    with pytest.raises(GGUFError, match="longrope factors"):
        read_gguf(path)

