"""The names a request's `model` may select: the base model, and each LoRA adapter the engine
has registered (vLLM's OpenAIServingModels). Resolves a name to a LoRARequest, lists the
cards of GET /v1/models, and loads and unloads adapters for the two LoRA routes.

The adapter registry (ServedModel.lora, jaxserve/lora_adapters.py) is the one source of
truth: adapters loaded with `serve --lora-modules`, over HTTP or from Python all show here.
"""

from __future__ import annotations

import threading

from jaxserve.core.lora import LoRAError, LoRARequest, UnknownAdapter
from jaxserve.server.backend import ServedModel
from jaxserve.server.errors import ApiError, shown

OWNER = "jaxserve"


class ServedModels:
    def __init__(self, base_name: str, model: ServedModel):
        self.base_name, self._model = base_name, model
        self._lock = threading.Lock()  # one load at a time: ids are handed out in order
        self._last_id = max((a.lora_int_id for a in self._adapters()), default=0)

    @property
    def lora_enabled(self) -> bool:
        return self._model.lora is not None

    def _adapters(self) -> list[LoRARequest]:
        return self._model.lora.adapters() if self._model.lora is not None else []

    def resolve(self, name) -> LoRARequest | None:
        """The adapter `name` selects (None: the base model, also when no name was given).
        Raises a 404 model_not_found for any other name."""
        if not isinstance(name, str) or name == self.base_name:
            return None  # a missing or non-string model is the validator's 400
        adapter = self._model.adapter(name)
        if adapter is None:
            names = self.names()
            listed = ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
            raise ApiError(404, f"model {shown(name)} does not exist; this server serves "
                                f"{listed} (GET /v1/models)",
                           type="not_found_error", param="model", code="model_not_found")
        return adapter

    def names(self) -> list[str]:
        """What a request's `model` may say now: the base model, then each adapter."""
        return [self.base_name] + [a.lora_name for a in self._adapters()]

    def cards(self, max_model_len: int) -> list[dict]:
        """GET /v1/models' entries, vLLM's shape: the base model, then each adapter with its
        base model as `parent` and its directory as `root`."""
        base = {"id": self.base_name, "object": "model", "created": 0, "owned_by": OWNER,
                "root": self.base_name, "parent": None, "max_model_len": max_model_len}
        return [base] + [{"id": a.lora_name, "object": "model", "created": 0,
                          "owned_by": OWNER, "root": a.lora_path, "parent": self.base_name}
                         for a in self._adapters()]

    def load(self, name: str, path: str) -> LoRARequest:
        """Registers adapter `name` from directory `path`, reading its files in this thread
        (the engine thread keeps stepping). Raises LoRAError naming the problem; nothing is
        registered then."""
        registry = self._registry()
        if name == self.base_name:
            raise LoRAError(f"{name!r} is the base model's name; give the adapter another one")
        with self._lock:
            # Never an unloaded adapter's id: the prefix cache keys KV blocks by adapter id,
            # so a reused id could hand the new adapter the old one's cached blocks.
            last = max([self._last_id] + [a.lora_int_id for a in registry.adapters()])
            adapter = LoRARequest(name, last + 1, path)
            registry.add(adapter)  # an adapter of that name already: LoRAError, no change
            self._last_id = adapter.lora_int_id
        return adapter

    def unload(self, name: str | None, lora_int_id: int | None) -> LoRARequest:
        """Unregisters the adapter with that name and/or id. UnknownAdapter when there is
        none; AdapterInUse (nothing changes) while unfinished requests use it."""
        registry = self._registry()
        if name is None:
            found = [a for a in registry.adapters() if a.lora_int_id == lora_int_id]
            if not found:
                raise UnknownAdapter(f"no LoRA adapter with lora_int_id {lora_int_id} is "
                                     "loaded")
            name = found[0].lora_name
        elif lora_int_id is not None:
            adapter = registry.get(name)
            if adapter is not None and adapter.lora_int_id != lora_int_id:
                raise LoRAError(f"LoRA adapter {name!r} has lora_int_id "
                                f"{adapter.lora_int_id}, not {lora_int_id}")
        return registry.remove(name)

    def _registry(self):
        if self._model.lora is None:
            raise LoRAError("this server serves no LoRA adapters: start it with "
                            "--enable-lora (and --max-loras, --max-lora-rank)")
        return self._model.lora
