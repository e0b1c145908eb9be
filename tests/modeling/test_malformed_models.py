"""Malformed model files: a bounded fuzz of GGUF, safetensors and config.json inputs.

Truncations, byte flips in the headers, and targeted absurdities (huge or zero dimensions,
negative counts, wrong value types, missing keys, bad dtypes, tensor offsets past the end,
shard names outside the directory) of a tiny valid file. Every mutated file is loaded in one
child process (tests/malformed_worker.py) under an address-space cap, so a loader that tries a
huge allocation fails with MemoryError instead of taking the machine, a crash shows as the exit
status and a hang as the timeout. What each load may do: load (a flip in tensor data is not
detectable) or raise the loaders' own error type (GGUFError / CheckpointError, both
ValueError) with a message naming the file. Anything else — MemoryError, IndexError,
struct.error, ZeroDivisionError, a signal — fails the test, naming the mutation.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
# Far below what a "huge dimension" allocation would need, well above what loading a tiny file
# takes (jax and numpy are imported in the child: the hf loader reads tensors through flax).
ADDRESS_SPACE_CAP = 6 << 30
QT = gguf.GGMLQuantizationType
L, D, H, KV, HD, F, V = 1, 64, 2, 1, 32, 128, 64
RNG_SEED = 1234
# Loading ~150 tiny files takes seconds; a loader stuck in a loop runs into this.
WORKER_TIMEOUT_S = 180


def hf_weights(rng) -> dict[str, np.ndarray]:
    mat = lambda *s: (0.05 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": mat(V, D), "model.norm.weight": np.ones(D, np.float32)}
    p = "model.layers.0."
    w.update({p + "input_layernorm.weight": np.ones(D, np.float32),
              p + "post_attention_layernorm.weight": np.ones(D, np.float32),
              p + "self_attn.q_proj.weight": mat(H * HD, D),
              p + "self_attn.k_proj.weight": mat(KV * HD, D),
              p + "self_attn.v_proj.weight": mat(KV * HD, D),
              p + "self_attn.o_proj.weight": mat(D, H * HD),
              p + "mlp.gate_proj.weight": mat(F, D), p + "mlp.up_proj.weight": mat(F, D),
              p + "mlp.down_proj.weight": mat(D, F)})
    return w


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight",
              **{f"model.layers.0.{h}": f"blk.0.{g}" for g, h in {
                  "attn_norm.weight": "input_layernorm.weight",
                  "ffn_norm.weight": "post_attention_layernorm.weight",
                  "attn_q.weight": "self_attn.q_proj.weight",
                  "attn_k.weight": "self_attn.k_proj.weight",
                  "attn_v.weight": "self_attn.v_proj.weight",
                  "attn_output.weight": "self_attn.o_proj.weight",
                  "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                  "ffn_down.weight": "mlp.down_proj.weight"}.items()}}
META = {"block_count": L, "context_length": 128, "embedding_length": D,
        "feed_forward_length": F, "attention.head_count": H, "attention.head_count_kv": KV,
        "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": V}


def write_gguf(path: Path, hf: dict, meta=None, skip=(), raw_meta=None) -> Path:
    """A tiny llama GGUF (matrices Q8_0, norms F32); `meta` overrides llama.* values and
    `raw_meta` adds (key, writer method, value) entries with an explicit GGUF type."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**META, **(meta or {})}.items():
        if key in skip:
            continue
        full = f"llama.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    for key, method, value in raw_meta or ():
        getattr(w, method)(key, value)
    for name, arr in hf.items():
        if arr.ndim == 2:
            w.add_tensor(GGUF_NAMES[name], gguf.quants.quantize(arr, QT.Q8_0), raw_dtype=QT.Q8_0)
        else:
            w.add_tensor(GGUF_NAMES[name], arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
             "hidden_size": D, "intermediate_size": F, "num_hidden_layers": L,
             "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
             "tie_word_embeddings": True}


def write_hf(d: Path, hf: dict, config=None, raw: bytes | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(HF_CONFIG if config is None else config))
    if raw is None:
        save_file(hf, str(d / "model.safetensors"))
    else:
        (d / "model.safetensors").write_bytes(raw)
    return d


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


# ---- the mutations -------------------------------------------------------------------------

def flips(rng, data: bytes, limit: int, count: int, label: str):
    """`count` copies of `data` with 1-4 random bytes of the first `limit` replaced."""
    for i in range(count):
        b = bytearray(data)
        for pos in rng.integers(0, min(limit, len(b)), rng.integers(1, 5)):
            b[pos] = int(rng.integers(0, 256))
        yield f"{label}-flip{i}", bytes(b)


def truncations(rng, data: bytes, count: int, label: str):
    cuts = sorted({0, 4, 8, 23, len(data) - 1,
                   *rng.integers(1, len(data), count - 5).tolist()})
    for cut in cuts:
        yield f"{label}-cut{cut}", data[:cut]


def patched_u64(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + struct.pack("<Q", value) + data[offset + 8:]


def gguf_cases(tmp: Path, hf: dict, rng) -> list[dict]:
    base = write_gguf(tmp / "base.gguf", hf)
    data = base.read_bytes()
    header_end = data.index(b"token_embd.weight") + 200  # kv data and the first tensor infos
    cases = []

    def add(label, raw=None, **kw):
        path = tmp / f"{label}.gguf"
        if raw is not None:
            path.write_bytes(raw)
        else:
            write_gguf(path, hf, **kw)
        cases.append({"kind": "gguf", "label": label, "path": str(path)})

    for label, raw in [*truncations(rng, data, 14, "gguf"),
                       *flips(rng, data, header_end, 30, "gguf")]:
        add(label, raw)
    # The header's counts (after magic and version): tensors at 8, kv pairs at 16.
    for label, off, value in (("n-tensors-huge", 8, 1 << 60), ("n-kv-huge", 16, 1 << 60),
                              ("n-tensors-zero", 8, 0), ("n-kv-zero", 16, 0)):
        add(label, patched_u64(data, off, value))
    # The first tensor info: name, n_dims (u32), dims (u64 each).
    dims_at = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4
    for label, value in (("dim-huge", 1 << 40), ("dim-zero", 0), ("dim-max", (1 << 64) - 1)):
        add(label, patched_u64(data, dims_at, value))
    add("ndims-huge", data[:dims_at - 4] + struct.pack("<I", 1 << 30) + data[dims_at:])
    for label, meta in (("hidden-huge", {"embedding_length": (1 << 32) - 1}),
                        ("hidden-zero", {"embedding_length": 0}),
                        ("layers-huge", {"block_count": 1 << 31}),
                        ("heads-zero", {"attention.head_count": 0}),
                        ("kv-heads-zero", {"attention.head_count_kv": 0}),
                        ("heads-not-divisible", {"attention.head_count_kv": 3}),
                        ("vocab-huge", {"vocab_size": (1 << 32) - 1}),
                        ("ffn-string", {"feed_forward_length": "big"}),
                        ("heads-float", {"attention.head_count": 2.5}),
                        ("eps-negative", {"attention.layer_norm_rms_epsilon": -1.0}),
                        ("theta-inf", {"rope.freq_base": float("inf")}),
                        ("ctx-zero", {"context_length": 0})):
        add(label, meta=meta)
    for key in ("embedding_length", "block_count", "attention.head_count",
                "feed_forward_length"):
        add(f"missing-{key}", skip=(key,))
    add("layers-negative", skip=("block_count",),
        raw_meta=[("llama.block_count", "add_int64", -3)])
    add("heads-negative", skip=("attention.head_count",),
        raw_meta=[("llama.attention.head_count", "add_int32", -2)])
    add("heads-array", skip=("attention.head_count",),
        raw_meta=[("llama.attention.head_count", "add_array", [2, 2])])
    add("bos-string", raw_meta=[("tokenizer.ggml.bos_token_id", "add_string", "one")])
    return cases


def hf_cases(tmp: Path, hf: dict, rng) -> list[dict]:
    base = write_hf(tmp / "hf-base", hf)
    data = (base / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    cases = []

    def add(label, raw=None, config=None):
        d = write_hf(tmp / f"hf-{label}", hf, config=config, raw=raw)
        cases.append({"kind": "hf", "label": label, "path": str(d)})

    for label, raw in [*truncations(rng, data, 10, "st"), *flips(rng, data, 8 + n, 20, "st")]:
        add(label, raw)
    for label, value in (("hlen-huge", 1 << 62), ("hlen-zero", 0), ("hlen-past-end", len(data))):
        add(label, struct.pack("<Q", value) + data[8:])
    first = next(k for k in header if k != "__metadata__")

    def tensor_edit(label, **fields):
        h = json.loads(json.dumps(header))
        h[first].update(fields)
        add(label, safetensors_bytes(h, body))

    tensor_edit("dtype-bogus", dtype="X9")
    tensor_edit("dtype-bool", dtype="BOOL")
    tensor_edit("dtype-f64", dtype="F64")
    tensor_edit("shape-huge", shape=[1 << 40, 1 << 40])
    tensor_edit("shape-negative", shape=[-1, D])
    tensor_edit("shape-wrong", shape=[V // 2, 2 * D])
    tensor_edit("offsets-past-end", data_offsets=[0, len(body) + 4096])
    tensor_edit("offsets-reversed", data_offsets=[64, 0])
    add("header-not-object", struct.pack("<Q", 2) + b"[]" + body)
    for label, edit in (("vocab-huge", {"vocab_size": 10 ** 12}),
                        ("hidden-zero", {"hidden_size": 0}),
                        ("layers-negative", {"num_hidden_layers": -3}),
                        ("layers-huge", {"num_hidden_layers": 10 ** 9}),
                        ("heads-zero", {"num_attention_heads": 0, "head_dim": None}),
                        ("heads-string", {"num_attention_heads": "two"}),
                        ("heads-null", {"num_attention_heads": None}),
                        ("kv-heads-not-divisible", {"num_key_value_heads": 3}),
                        ("eps-string", {"rms_norm_eps": "tiny"}),
                        ("rope-params-list", {"rope_parameters": [1, 2]}),
                        ("rope-scaling-partial", {"rope_scaling": {"rope_type": "llama3"}}),
                        ("eos-dict", {"eos_token_id": {"a": 1}}),
                        ("model-type", {"model_type": "gpt2", "architectures": ["GPT2"]})):
        add(f"config-{label}", config={**HF_CONFIG, **edit})
    add("config-missing-vocab", config={k: v for k, v in HF_CONFIG.items() if k != "vocab_size"})
    add("config-array", config=[1, 2, 3])
    d = write_hf(tmp / "hf-config-not-json", hf)
    (d / "config.json").write_text('{"vocab_size": 64,')
    cases.append({"kind": "hf", "label": "config-not-json", "path": str(d)})
    # A shard index naming files outside the checkpoint directory, or a non-object index.
    for label, index in (("index-escapes", {"weight_map": {first: "../hf-base/model.safetensors"}}),
                         ("index-absolute", {"weight_map": {first: str(base / "model.safetensors")}}),
                         ("index-list", [1]), ("index-map-list", {"weight_map": [1]})):
        d = write_hf(tmp / f"hf-{label}", hf)
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        cases.append({"kind": "hf", "label": label, "path": str(d)})
    for c in list(cases):
        if c["label"].startswith("config-"):
            cases.append({"kind": "config", "label": "load-" + c["label"], "path": c["path"]})
    return cases


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_CAP, ADDRESS_SPACE_CAP))


@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_malformed_model_files_give_clear_errors(tmp_path):
    rng = np.random.default_rng(RNG_SEED)
    hf = hf_weights(rng)
    cases = gguf_cases(tmp_path, hf, rng) + hf_cases(tmp_path, hf, rng)
    cases.insert(0, {"kind": "gguf", "label": "valid-gguf", "path": str(tmp_path / "base.gguf")})
    cases.insert(1, {"kind": "hf", "label": "valid-hf", "path": str(tmp_path / "hf-base")})
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{TESTS}")
    rows, returncode, stderr = run_worker(cases, env)
    done = {r["label"] for r in rows}
    assert returncode == 0 and len(rows) == len(cases), (
        f"the worker died or hung (exit {returncode}) after {len(rows)} of {len(cases)} files; "
        f"on: {[c['label'] for c in cases if c['label'] not in done][:1]}\n{stderr[-2000:]}")
    by_label = {r["label"]: r for r in rows}
    assert by_label["valid-gguf"]["outcome"] == "loaded", by_label["valid-gguf"]
    assert by_label["valid-hf"]["outcome"] == "loaded", by_label["valid-hf"]
    bad = [r for r in rows if r["outcome"] != "loaded" and not clear_error(r)]
    assert not bad, "unclear failures:\n" + "\n".join(
        f"{r['label']}: {r['type']}: {r['message'][:200]}\n{r['where']}" for r in bad)
    errors = sum(r["outcome"] == "error" for r in rows)
    assert errors >= len(rows) - 40, f"only {errors} of {len(rows)} mutations were refused"


def run_worker(cases: list[dict], env: dict) -> tuple[list[dict], int | None, str]:
    """The worker's rows, its exit status (None: killed at the timeout) and its stderr."""
    proc = subprocess.Popen([sys.executable, str(TESTS / "malformed_worker.py")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_cap_memory, cwd=REPO)
    try:
        out, err = proc.communicate(json.dumps(cases), timeout=WORKER_TIMEOUT_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        code = None
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows, code, err


def clear_error(row: dict) -> bool:
    """The loaders' own error type (a ValueError), naming the file or directory."""
    ours = {"GGUFError", "CheckpointError"} & set(row["mro"])
    return bool(ours) and row["path"] in row["message"]
