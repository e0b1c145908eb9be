"""LoRA adapters as requests name them: `LoRARequest` (vLLM's name and argument order) and the
errors an adapter can raise. Plain Python: no jax.

A request carries at most one adapter; `lora_int_id` is the adapter's identity everywhere in
the engine (the scheduler counts distinct ids against `max_loras`, the prefix cache keys blocks
by it, KV events report it), `lora_name` is what the server's `model` field selects.
"""

from __future__ import annotations

import dataclasses

# Defined beside the adapter loader (models/ cannot import jaxserve), re-exported here.
from models.lora_names import LORA_TARGETS, LoRAError

__all__ = ["LORA_TARGETS", "AdapterInUse", "LoRAError", "LoRARequest", "UnknownAdapter"]


class UnknownAdapter(LoRAError):
    status = 404


class AdapterInUse(LoRAError):
    status = 409


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """One adapter: `lora_name` (unique, what clients select), `lora_int_id` (unique positive
    integer), `lora_path` (a directory in PEFT's format: adapter_config.json +
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise LoRAError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise LoRAError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise LoRAError(f"lora_path must be a string (a PEFT adapter directory), got "
                            f"{type(self.lora_path).__name__}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
