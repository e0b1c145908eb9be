"""A model's config without its weights: from a registry name, a .gguf file, an HF directory
or config.json, or an orbax checkpoint (jaxserve_config.json). For tools like `kv-size`."""

from __future__ import annotations

import json
import pathlib

from models import checkpoint, registry
from models.config import ModelConfig
from models.weights import CheckpointError


def load_config(name_or_path: str | pathlib.Path) -> ModelConfig:
    spec = str(name_or_path)
    if spec in registry.MODELS:
        path = registry.model_path(spec)
    else:
        path = pathlib.Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"{spec!r} is neither a known model name "
                                    f"({sorted(registry.MODELS)}) nor an existing path")
    if path.is_dir():
        if checkpoint.is_orbax_dir(path):
            path = path / checkpoint.CONFIG_FILE
        else:
            from models.hf_loader import read_hf_config
            return read_hf_config(path)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: invalid JSON ({e})") from e
        if isinstance(data, dict) and isinstance(data.get("config"), dict):  # jaxserve_config
            return ModelConfig.from_dict(data["config"])
        from models.hf_loader import config_from_hf_json
        return config_from_hf_json(path)
    from models.gguf_loader import read_gguf_config
    return read_gguf_config(path)
