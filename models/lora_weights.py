"""Loads a LoRA adapter saved by PEFT (adapter_config.json + adapter_model.safetensors) into
per-module stacked factors for our `[in, out]` kernels: `delta(x) = x @ A @ B`.

PEFT stores `lora_A.weight [r, in]` and `lora_B.weight [out, r]` under the transformers module
name (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`, some versions with
the adapter name before `.weight`) and computes `x @ A^T @ B^T * scaling`; here A is stored
transposed `[K, r]`, B transposed with the scaling folded in `[r, N]`, each layer's rank
zero-padded to the engine's max rank, so every adapter has the same shapes. Phi-3's fused
`qkv_proj` / `gate_up_proj` adapters are split like the base weights (models/weights.py): B's
rows per projection, A shared, which is exact. Plain numpy: no jax.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Mapping

import numpy as np
from safetensors import SafetensorError, deserialize, safe_open

from models.lora_names import LORA_TARGETS, LoRAError, module_shapes
from models.config import ModelConfig
from models.peft_config import PeftLoraConfig, read_peft_config

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# `<module>.lora_A.weight` or `<module>.lora_A.<adapter name>.weight`.
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_PREFIX = "base_model.model."  # PeftModel -> the transformers model inside it
# Fused projections in a checkpoint (models/weights.py _FUSED) -> our modules, in row order.
_FUSED = {"phi3": {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                   "gate_up_proj": ("gate_proj", "up_proj")}}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclasses.dataclass(frozen=True)
class AdapterWeights:
    """One adapter's factors, ready to stack with others of the same max rank.

    rank: the adapter's largest rank (its r, or the largest rank_pattern value).
    scaling: adapter_config.json's lora_alpha / r (rsLoRA: / sqrt(r)); with rank or alpha
        patterns each module's own scaling differs and is already folded into its B.
    modules: our module name -> (A `[L, K, r_max]`, B `[L, r_max, N]`) float32, B times its
        scaling; only the modules the adapter adapts; ranks past the module's r and layers
        it does not adapt are zeros."""

    rank: int
    scaling: float
    modules: Mapping[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def module_shape(config: ModelConfig, name: str) -> tuple[int, int]:
    """(K, N) of our kernel `name` `[in, out]`."""
    return module_shapes(config)[name]


def _file_modules(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The adaptable modules as the checkpoint names them -> the modules of ours they feed."""
    names = _ATTN if config.num_experts else LORA_TARGETS  # MoE: the experts are not adapted
    modules = {n: (n,) for n in names}
    for fused, parts in _FUSED.get(config.architecture, {}).items():
        for part in parts:
            del modules[part]
        modules[fused] = parts
    return modules


def _hf_name(module: str, layer: int) -> str:
    block = "self_attn" if module in _ATTN or module == "qkv_proj" else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def _not_adapted(config: ModelConfig) -> dict[str, str]:
    """Modules of the transformers model an adapter may name but we do not adapt -> why."""
    out = {"lm_head": "heads and embeddings are not adapted",
           "model.embed_tokens": "heads and embeddings are not adapted"}
    if config.num_experts:
        for i in range(config.num_layers):
            out[f"model.layers.{i}.mlp.gate"] = "a mixture-of-experts router is not adapted"
    return out


def load_peft_adapter(path, config: ModelConfig, *, max_rank: int,
                      target_modules=LORA_TARGETS) -> AdapterWeights:
    """Reads the PEFT LoRA adapter in directory `path` for a base model of `config`.

    max_rank: the engine's max_lora_rank (the padded rank r_max); target_modules: the modules
    the engine allocated adapter slots for. Every problem is a LoRAError naming it and the file.
    """
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise LoRAError(f"{directory}: LoRA adapter directory not found")
    modules = _file_modules(config)
    peft = read_peft_config(directory / CONFIG_FILE, tuple(modules) + (
        ("gate",) if config.num_experts else ()))
    source = directory / WEIGHTS_FILE
    expected = _expected(peft, config, modules, directory / CONFIG_FILE)
    _check_fits(expected, modules, directory / CONFIG_FILE, max_rank, target_modules)
    keys = _read_keys(source, directory)
    _check_keys(keys, expected, config, source)
    tensors = _read(source, keys, expected, config, modules)
    return AdapterWeights(rank=max(expected.values()), scaling=peft.scaling(),
                          modules=_stack(tensors, peft, config, modules, max_rank, source))


def _expected(peft: PeftLoraConfig, config: ModelConfig, modules, where) -> dict[str, int]:
    """HF module name -> rank of every module the config adapts."""
    if peft.layers_to_transform and max(peft.layers_to_transform) >= config.num_layers:
        raise LoRAError(f"{where}: layers_to_transform names layer "
                        f"{max(peft.layers_to_transform)}; the base model has "
                        f"{config.num_layers} layers")
    for name, why in _not_adapted(config).items():
        if peft.targets(name):
            raise LoRAError(f"{where}: target_modules selects {name!r}: {why}")
    expected = {}
    for layer in range(config.num_layers):
        for module in modules:
            name = _hf_name(module, layer)
            if peft.targets(name):
                expected[name] = peft.rank_alpha(name)[0]
    if not expected:
        raise LoRAError(f"{where}: target_modules {peft.target_modules!r} selects no module of "
                        f"this {config.architecture} model (adaptable: {sorted(modules)})")
    return expected


def _check_fits(expected, modules, where, max_rank: int, target_modules) -> None:
    """The adapter fits the engine: its rank within max_rank, its modules among the slots."""
    rank = max(expected.values())
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}; restart with "
                        f"--max-lora-rank {rank}")
    used = {part for name in expected for part in modules[name.rsplit(".", 1)[1]]}
    outside = sorted(used - set(target_modules))
    if outside:
        raise LoRAError(f"{where}: the adapter adapts {outside}, which this engine has no LoRA "
                        f"slots for (allocated: {list(target_modules)})")


def _read_keys(source: pathlib.Path, directory: pathlib.Path) -> dict[str, tuple]:
    """Tensor name -> (shape, dtype) from the file's header, before any data is read."""
    if not source.is_file():
        pickled = [p.name for p in directory.glob("*.bin")]
        extra = (f"; {pickled} are PyTorch pickles, which are not loaded (they can run code): "
                 "save the adapter with safe_serialization=True") if pickled else ""
        raise LoRAError(f"{directory}: no {WEIGHTS_FILE}{extra}")
    try:
        with safe_open(str(source), framework="numpy") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                    for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise LoRAError(f"{source}: not a readable safetensors file ({e})") from e


def _split_key(key: str) -> tuple[str, str, str | None] | None:
    """(HF module name, "A" | "B", adapter name or None) of a LoRA weight key, else None."""
    match = _KEY.match(key)
    if match is None:
        return None
    module = match["module"]
    module = module[len(_PREFIX):] if module.startswith(_PREFIX) else module
    return module, match["ab"], match["adapter"]


def _check_keys(keys: Mapping[str, tuple], expected: Mapping[str, int], config, source) -> None:
    """Every tensor is a lora_A/lora_B of an expected module, and every expected one is there."""
    adapters = set()
    found = set()
    for key, (shape, dtype) in keys.items():
        parts = _split_key(key)
        if parts is None:
            raise LoRAError(f"{source}: unexpected tensor {key!r}: {_why_unexpected(key)}")
        module, ab, adapter = parts
        adapters.add(adapter)
        if module not in expected:
            raise LoRAError(f"{source}: tensor {key!r}: {_why_not_expected(module, config)}")
        if dtype not in _DTYPES:
            raise LoRAError(f"{source}: tensor {key!r} has dtype {dtype}; LoRA factors must be "
                            f"floating point ({', '.join(_DTYPES)})")
        found.add((module, ab))
    if len(adapters) > 1:
        raise LoRAError(f"{source}: holds tensors of several adapters {sorted(map(str, adapters))}"
                        "; save one adapter per directory")
    for module in expected:
        for ab in "AB":
            if (module, ab) not in found:
                raise LoRAError(f"{source}: missing tensor '{_PREFIX}{module}.lora_{ab}.weight' "
                                "(adapter_config.json targets this module)")


def _why_unexpected(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
        return "heads and embeddings are not adapted"
    if "lora_magnitude_vector" in key:
        return "DoRA adapters are not supported"
    if ".lora_B." in key and key.endswith(".bias"):
        return "lora_bias adapters are not supported"
    return "a LoRA adapter holds only <module>.lora_A.weight and <module>.lora_B.weight"


def _why_not_expected(module: str, config: ModelConfig) -> str:
    match = re.fullmatch(r"model\.layers\.(\d+)\..+", module)
    if match and int(match[1]) >= config.num_layers:
        return f"layer {match[1]} is out of range: the base model has {config.num_layers} layers"
    if ".experts." in module or module.endswith(".mlp.gate") or "block_sparse_moe" in module:
        return "mixture-of-experts MLPs are not adapted (attention projections are)"
    if module.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens"):
        return "heads and embeddings are not adapted"
    return (f"module {module!r} is not among the modules adapter_config.json targets in this "
            f"{config.architecture} model")


_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": None}


def _to_float32(raw: bytes, dtype: str, shape) -> np.ndarray:
    if dtype == "BF16":  # numpy has no bfloat16: its bits are a float32's upper half
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=np.dtype(_DTYPES[dtype]).newbyteorder("<")).astype(
        np.float32).reshape(shape)


def _read(source, keys, expected, config, modules) -> dict[tuple[str, str], np.ndarray]:
    """(HF module name, "A" | "B") -> float32 tensor in PEFT's layout, shapes checked."""
    for key, (shape, _) in keys.items():
        module, ab, _ = _split_key(key)
        kind = module.rsplit(".", 1)[1]
        r = expected[module]
        k = module_shape(config, modules[kind][0])[0]
        n = sum(module_shape(config, part)[1] for part in modules[kind])
        want = (r, k) if ab == "A" else (n, r)
        if shape != want:
            raise LoRAError(f"{source}: tensor {key!r} ({kind} lora_{ab}) has shape {shape}, "
                            f"expected {want} for rank {r} on this base model")
    try:
        raw = dict(deserialize(source.read_bytes()))
    except (SafetensorError, OSError) as e:
        raise LoRAError(f"{source}: not a readable safetensors file ({e})") from e
    out = {}
    for key, (shape, dtype) in keys.items():
        module, ab, _ = _split_key(key)
        x = _to_float32(raw[key]["data"], dtype, shape)
        if not np.isfinite(x).all():
            raise LoRAError(f"{source}: tensor {key!r} holds non-finite values (NaN or inf)")
        out[module, ab] = x
    return out


def _stack(tensors, peft: PeftLoraConfig, config: ModelConfig, modules, max_rank: int,
           source) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Our module -> (A `[L, K, max_rank]`, B `[L, max_rank, N]`), B times its scaling."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for (name, ab), lora_a in tensors.items():
        if ab != "A":
            continue
        layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        with np.errstate(over="ignore"):  # an overflow is reported just below
            lora_b = tensors[name, "B"] * np.float32(peft.scaling(name))  # [N_fused, r]
        if not np.isfinite(lora_b).all():
            raise LoRAError(f"{source}: {name}.lora_B times its scaling "
                            f"{peft.scaling(name):g} overflows float32")
        r, row = lora_a.shape[0], 0
        for part in modules[kind]:
            k, n = module_shape(config, part)
            if part not in out:
                out[part] = (np.zeros((config.num_layers, k, max_rank), np.float32),
                             np.zeros((config.num_layers, max_rank, n), np.float32))
            a, b = out[part]
            a[layer, :, :r] = lora_a.T  # [K, r]
            b[layer, :r, :] = lora_b[row:row + n].T  # [r, N]
            row += n
    return out
