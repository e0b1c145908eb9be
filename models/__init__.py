"""Flax Llama-family models and their loaders (GGUF, HF safetensors, orbax)."""

from models.config import ModelConfig
from models.model import Model, load_model

__all__ = ["Model", "ModelConfig", "load_model"]
