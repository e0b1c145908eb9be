"""models/gguf_loader.py against HF transformers' GGUF loading and against numpy facts.

Tiny random Llama files are written here with gguf.GGUFWriter, with Q/K rows permuted exactly as
llama.cpp's convert_hf_to_gguf does, so the un-permutation is checked against weights we chose.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from hf_reference import run_reference
from models.config import ModelConfig, RopeScaling
from models.gguf_loader import GGUFError, read_gguf

QT = gguf.GGMLQuantizationType
# K-quant blocks hold 256 values, so every matrix's inner dimension must be a multiple of 256.
L, D, H, KV, HD, F, V = 2, 256, 4, 2, 64, 512, 300
THETA, EPS, CTX = 10000.0, 1e-5, 512
TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_K, QT.Q6_K]
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
UNTIED = (QT.F16, QT.Q8_0, QT.Q4_K)  # these files carry output.weight

LAYER = {"attn_norm.weight": "input_layernorm.weight",
         "ffn_norm.weight": "post_attention_layernorm.weight",
         "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
         "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute, verbatim."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_weights(rng, bias=False, tied=True) -> dict[str, np.ndarray]:
    """Random float weights in HF names and layouts."""
    mat = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": mat(V, D), "model.norm.weight": norm()}
    if not tied:
        w["lm_head.weight"] = mat(V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                  p + "self_attn.q_proj.weight": mat(H * HD, D),
                  p + "self_attn.k_proj.weight": mat(KV * HD, D),
                  p + "self_attn.v_proj.weight": mat(KV * HD, D),
                  p + "self_attn.o_proj.weight": mat(D, H * HD),
                  p + "mlp.gate_proj.weight": mat(F, D), p + "mlp.up_proj.weight": mat(F, D),
                  p + "mlp.down_proj.weight": mat(D, F)})
        if bias:
            for n, k in (("q", H), ("k", KV), ("v", KV)):
                w[p + f"self_attn.{n}_proj.bias"] = mat(k * HD)
    return w


def gguf_tensors(hf: dict, arch="llama") -> dict[str, np.ndarray]:
    """HF weights -> GGUF names, Q/K rows permuted for llama as llama.cpp's converter does."""
    out = {"token_embd.weight": hf["model.embed_tokens.weight"],
           "output_norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        out["output.weight"] = hf["lm_head.weight"]
    layer = dict(LAYER, **{f"attn_{n}.bias": f"self_attn.{n}_proj.bias" for n in "qkv"})
    for i in range(L):
        for g, h in layer.items():
            if (name := f"model.layers.{i}.{h}") not in hf:
                continue
            t = hf[name]
            if arch == "llama" and g.startswith(("attn_q.", "attn_k.")):
                t = llama_cpp_permute(t, H if g.startswith("attn_q.") else KV)
            out[f"blk.{i}.{g}"] = t
    return out


def random_kquant_blocks(rng, qtype, rows, cols) -> np.ndarray:
    """Valid random K-quant bytes (gguf-py cannot quantize K types) with small finite scales."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    half = lambda: rng.uniform(1e-3, 1e-2, (rows, cols // elems)).astype(  # noqa: E731
        np.float16).view(np.uint8).reshape(rows, cols // elems, 2)
    if qtype == QT.Q6_K:
        b[..., 208:210] = half()        # d sits after ql[128], qh[64], scales[16]
    else:
        b[..., 0:2], b[..., 2:4] = half(), half()  # d, dmin
    return b.reshape(rows, -1)


def encode(rng, arr: np.ndarray, qtype) -> np.ndarray:
    if qtype == QT.F32:
        return arr.astype(np.float32)
    if qtype == QT.F16:
        return arr.astype(np.float16)
    if qtype in K_QUANTS:
        return random_kquant_blocks(rng, qtype, *arr.shape)
    return gguf.quants.quantize(arr, qtype)


def write_gguf(path, tensors: dict, *, arch="llama", qtype=QT.F32, types=None, meta=None,
               skip_meta=(), seed=0) -> dict[str, np.ndarray]:
    """Writes a GGUF; returns what each tensor decodes to, in GGUF names and file row order.

    Matrices use `qtype` (or types[name]); 1-D tensors stay F32, as llama.cpp keeps them.
    """
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    kv = {"general.name": "tiny-test", f"{arch}.block_count": L, f"{arch}.context_length": CTX,
          f"{arch}.embedding_length": D, f"{arch}.feed_forward_length": F,
          f"{arch}.attention.head_count": H, f"{arch}.attention.head_count_kv": KV,
          f"{arch}.rope.freq_base": THETA, f"{arch}.attention.layer_norm_rms_epsilon": EPS,
          f"{arch}.rope.dimension_count": HD, f"{arch}.vocab_size": V,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    kv.update(meta or {})
    for key, value in kv.items():
        if key in skip_meta:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    decoded = {}
    for name, arr in tensors.items():
        t = (types or {}).get(name, qtype if arr.ndim == 2 else QT.F32)
        data = encode(rng, arr, t)
        if t in (QT.F32, QT.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=t)
        decoded[name] = gguf.quants.dequantize(data, t).reshape(arr.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """One tiny llama file per supported type, plus a qwen2 file with q/k/v biases."""
    d = tmp_path_factory.mktemp("gguf")
    files = {}
    for i, qt in enumerate(TYPES):
        hf = hf_weights(np.random.default_rng(i), tied=qt not in UNTIED)
        decoded = write_gguf(d / f"tiny-{qt.name}.gguf", gguf_tensors(hf), qtype=qt, seed=i)
        files[qt.name] = (d / f"tiny-{qt.name}.gguf", hf, decoded)
    hf = hf_weights(np.random.default_rng(99), bias=True)
    decoded = write_gguf(d / "tiny-qwen2.gguf", gguf_tensors(hf, "qwen2"), arch="qwen2")
    files["qwen2"] = (d / "tiny-qwen2.gguf", hf, decoded)
    return files


@pytest.fixture(scope="module")
def hf_tiny(tiny_files):
    names = list(tiny_files)
    ref = run_reference("ref_gguf", {"files": [{"path": str(tiny_files[n][0])} for n in names]},
                        [tiny_files[n][0] for n in names])
    return {n: ({k.split("/", 1)[1]: v for k, v in ref.items() if k.startswith(f"{i}/")},
                ref["json"]["files"][i]) for i, n in enumerate(names)}


@pytest.mark.parametrize("kind", [t.name for t in TYPES] + ["qwen2"])
@pytest.mark.hf_ref
def test_tensors_match_hf(kind, tiny_files, hf_tiny):
    ckpt = read_gguf(tiny_files[kind][0])
    hf_state, hf_info = hf_tiny[kind]
    ours = dict(ckpt.tensors)
    if ckpt.config.tie_word_embeddings:  # HF's state dict lists the tied head as well
        ours["lm_head.weight"] = ours["model.embed_tokens.weight"]
    assert set(ours) == set(hf_state)
    for name, ref in hf_state.items():
        assert ours[name].dtype == np.float32
        np.testing.assert_allclose(ours[name], ref, rtol=0, atol=1e-6, err_msg=name)
    c = hf_info["config"]
    assert (ckpt.config.vocab_size, ckpt.config.hidden_size, ckpt.config.num_layers) == (
        c["vocab_size"], c["hidden_size"], c["num_layers"])
    assert ckpt.config.tie_word_embeddings == c["tie_word_embeddings"]


def test_float_file_unpermutes_exactly(tiny_files):
    """Loading an F32 file gives back exactly the HF weights we permuted before writing."""
    path, hf, _ = tiny_files["F32"]
    ckpt = read_gguf(path)
    assert set(ckpt.tensors) == set(hf)
    for name, ref in hf.items():
        np.testing.assert_array_equal(ckpt.tensors[name], ref, err_msg=name)
    assert ckpt.raw == {}  # nothing quantized


def test_qwen2_is_not_unpermuted_and_keeps_biases(tiny_files):
    path, hf, _ = tiny_files["qwen2"]
    ckpt = read_gguf(path)
    assert ckpt.config.architecture == "qwen2" and ckpt.config.attention_bias
    for name, ref in hf.items():
        np.testing.assert_array_equal(ckpt.tensors[name], ref, err_msg=name)


def test_llama_biases_are_unpermuted(tmp_path):
    hf = hf_weights(np.random.default_rng(5), bias=True)
    write_gguf(tmp_path / "b.gguf", gguf_tensors(hf))
    ckpt = read_gguf(tmp_path / "b.gguf")
    assert ckpt.config.attention_bias
    for n in ("q", "k", "v"):
        name = f"model.layers.1.self_attn.{n}_proj.bias"
        np.testing.assert_array_equal(ckpt.tensors[name], hf[name])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_unpermute_and_raw_blocks(kind, tiny_files):
    path, _, decoded = tiny_files[kind]
    ckpt = read_gguf(path)
    qt = QT[kind]
    for i in range(L):
        for g, h in LAYER.items():
            name, gname = f"model.layers.{i}.{h}", f"blk.{i}.{g}"
            ours = ckpt.tensors[name]
            if g.startswith(("attn_q.", "attn_k.")):  # re-permuting must give the file's rows
                ours = llama_cpp_permute(ours, H if g.startswith("attn_q.") else KV)
            np.testing.assert_array_equal(ours, decoded[gname], err_msg=name)
    expected_raw = {n for n, a in ckpt.tensors.items() if a.ndim == 2}
    assert set(ckpt.raw) == expected_raw
    for name, r in ckpt.raw.items():
        assert r.qtype == qt and r.name == name and r.shape == ckpt.tensors[name].shape
        assert r.data.dtype == np.uint8
        elems, nbytes = gguf.GGML_QUANT_SIZES[qt]
        assert r.data.shape == (r.shape[0], r.shape[1] // elems * nbytes)
        np.testing.assert_array_equal(gguf.quants.dequantize(np.asarray(r.data), qt),
                                      ckpt.tensors[name], err_msg=name)
    assert ckpt.raw["model.layers.0.self_attn.q_proj.weight"].gguf_name == "blk.0.attn_q.weight"


@pytest.mark.hf_ref
def test_config_from_metadata(tiny_files, hf_tiny):
    ckpt = read_gguf(tiny_files["Q4_1"][0])
    assert ckpt.config == ModelConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_layers=L, num_heads=H,
        num_kv_heads=KV, head_dim=HD, rms_norm_eps=EPS, rope_theta=THETA, rope_scaling=None,
        max_position_embeddings=CTX, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,), architecture="llama")
    c = hf_tiny["Q4_1"][1]["config"]
    assert (c["num_heads"], c["num_kv_heads"], c["head_dim"], c["intermediate_size"]) == (
        H, KV, HD, F)
    assert math.isclose(c["rope_theta"], THETA) and math.isclose(c["rms_norm_eps"], EPS,
                                                                 rel_tol=1e-6)


def test_vocab_falls_back_to_token_list(tmp_path):
    hf = hf_weights(np.random.default_rng(1))
    write_gguf(tmp_path / "v.gguf", gguf_tensors(hf), skip_meta=("llama.vocab_size",))
    assert read_gguf(tmp_path / "v.gguf").config.vocab_size == V


def test_bfloat16_output_dtype(tiny_files):
    import ml_dtypes
    ckpt = read_gguf(tiny_files["F32"][0], dtype="bfloat16")
    emb = ckpt.tensors["model.embed_tokens.weight"]
    assert emb.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        emb, tiny_files["F32"][1]["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16))


# --- RoPE scaling -------------------------------------------------------------------------------

def llama_cpp_rope_freqs(factor, low, high, orig, theta=THETA, dim=HD) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.generate_extra_tensors, in numpy."""
    out = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def hf_llama3_inv_freq(s: RopeScaling, theta=THETA, dim=HD) -> np.ndarray:
    """transformers' _compute_llama3_parameters, in numpy."""
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    wavelen = 2 * math.pi / inv
    lo_wl = s.original_max_position_embeddings / s.low_freq_factor
    hi_wl = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > lo_wl, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_mid = ~(wavelen < hi_wl) & ~(wavelen > lo_wl)
    return np.where(is_mid, smoothed, scaled)


@pytest.mark.parametrize("orig,meta", [(8192, {}), (2048, {
    "llama.rope.scaling.original_context_length": 2048})])
def test_llama3_scaling_from_rope_freqs(tmp_path, orig, meta):
    hf = hf_weights(np.random.default_rng(2))
    tensors = dict(gguf_tensors(hf), **{"rope_freqs.weight": llama_cpp_rope_freqs(8.0, 1.0, 4.0,
                                                                                 orig)})
    write_gguf(tmp_path / "r.gguf", tensors, meta=meta)
    ckpt = read_gguf(tmp_path / "r.gguf")
    s = ckpt.config.rope_scaling
    assert s.original_max_position_embeddings == orig
    assert s.factor == pytest.approx(8.0) and s.low_freq_factor == pytest.approx(1.0, rel=1e-3)
    assert s.high_freq_factor == pytest.approx(4.0, rel=1e-3)
    truth = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=orig)
    np.testing.assert_allclose(hf_llama3_inv_freq(s), hf_llama3_inv_freq(truth), rtol=1e-5)
    assert "rope_freqs.weight" not in ckpt.tensors


def test_llama3_scaling_from_metadata_keys(tmp_path):
    hf = hf_weights(np.random.default_rng(3))
    p = "llama.rope.scaling."
    write_gguf(tmp_path / "m.gguf", gguf_tensors(hf), meta={
        p + "type": "llama3", p + "factor": 32.0, p + "low_freq_factor": 1.0,
        p + "high_freq_factor": 4.0, p + "original_context_length": 8192})
    assert read_gguf(tmp_path / "m.gguf").config.rope_scaling == RopeScaling(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)


def test_unsupported_rope_scaling_type(tmp_path):
    hf = hf_weights(np.random.default_rng(3))
    path = tmp_path / "lin.gguf"
    write_gguf(path, gguf_tensors(hf), meta={"llama.rope.scaling.type": "linear",
                                              "llama.rope.scaling.factor": 2.0})
    with pytest.raises(ValueError, match="linear") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


# --- bad files ----------------------------------------------------------------------------------

def _expect_error(path, *needles):
    with pytest.raises(ValueError) as e:
        read_gguf(path)
    assert isinstance(e.value, GGUFError)
    for needle in (str(path),) + needles:
        assert needle in str(e.value)
    return e.value


def test_truncated_file(tiny_files, tmp_path):
    data = tiny_files["Q4_0"][0].read_bytes()
    for cut in (len(data) // 2, 100, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        _expect_error(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _expect_error(path, "not a readable GGUF")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _expect_error(empty)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_wrong_architecture(tmp_path, arch):
    hf = hf_weights(np.random.default_rng(4))
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, gguf_tensors(hf), arch=arch)
    _expect_error(path, repr(arch))


def test_missing_tensor(tmp_path):
    tensors = gguf_tensors(hf_weights(np.random.default_rng(4)))
    del tensors["blk.1.ffn_up.weight"]
    path = tmp_path / "missing.gguf"
    write_gguf(path, tensors)
    _expect_error(path, "blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight")


def test_shape_mismatch(tmp_path):
    tensors = gguf_tensors(hf_weights(np.random.default_rng(4)))
    tensors["blk.0.attn_k.weight"] = np.zeros((KV * HD + HD, D), np.float32)
    path = tmp_path / "shape.gguf"
    write_gguf(path, tensors)
    _expect_error(path, "blk.0.attn_k.weight", str((KV * HD + HD, D)), str((KV * HD, D)))


def test_unsupported_tensor_type(tmp_path):
    tensors = gguf_tensors(hf_weights(np.random.default_rng(4)))
    path = tmp_path / "q5.gguf"
    write_gguf(path, tensors, types={"blk.1.ffn_gate.weight": QT.Q5_0})
    _expect_error(path, "blk.1.ffn_gate.weight", "Q5_0")


def test_extra_layer_tensor(tmp_path):
    tensors = gguf_tensors(hf_weights(np.random.default_rng(4)))
    tensors["blk.2.ffn_up.weight"] = tensors["blk.1.ffn_up.weight"]
    path = tmp_path / "extra.gguf"
    write_gguf(path, tensors)
    _expect_error(path, "blk.2.ffn_up.weight")


# --- the real SmolLM2-135M file ------------------------------------------------------------------

SMOL_COMPARE = ["model.layers.7.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight", "model.layers.29.mlp.down_proj.weight",
                "model.layers.3.input_layernorm.weight", "model.norm.weight"]
SMOL_ROWS = [0, 1, 2, 100, 12345, 49151]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return read_gguf(smollm2_path)


def test_smollm2_config(smollm2):
    assert smollm2.config == ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, rope_scaling=None,
        max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,), architecture="llama")
    assert smollm2.raw["model.embed_tokens.weight"].qtype == QT.Q8_0
    assert smollm2.raw["model.layers.0.self_attn.q_proj.weight"].qtype == QT.Q4_1
    assert smollm2.raw["model.layers.0.self_attn.q_proj.weight"].data.shape == (576, 576 // 32 * 20)


@pytest.mark.hf_ref
def test_smollm2_matches_hf(smollm2, smollm2_path):
    ref = run_reference("ref_gguf", {"files": [{
        "path": str(smollm2_path), "tensors": SMOL_COMPARE,
        "rows": {"model.embed_tokens.weight": SMOL_ROWS}}]}, [smollm2_path])
    shapes = ref["json"]["files"][0]["shapes"]
    ours = {k: list(v.shape) for k, v in smollm2.tensors.items()}
    ours["lm_head.weight"] = ours["model.embed_tokens.weight"]  # tied: HF lists it too
    assert ours == shapes
    for name in SMOL_COMPARE:
        np.testing.assert_allclose(smollm2.tensors[name], ref[f"0/{name}"], rtol=0, atol=1e-6,
                                   err_msg=name)
    np.testing.assert_allclose(smollm2.tensors["model.embed_tokens.weight"][SMOL_ROWS],
                               ref["0/model.embed_tokens.weight@rows"], rtol=0, atol=1e-6)
