"""`serve --lora-modules`: vLLM's two spellings of an adapter to serve from the start, the
checks against the other flags, and loading them into the engine before the server opens.

No jax here: the CLI builds its parser before jax starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxserve.core.lora import LoRAError, LoRARequest

JSON_KEYS = ("name", "path", "base_model_name")
HELP = ("LoRA adapters to serve from the start (needs --enable-lora), each NAME=PATH or "
        "vLLM's JSON '{\"name\": NAME, \"path\": PATH, \"base_model_name\": MODEL}'; PATH is a "
        "PEFT adapter directory. A request selects one with \"model\": NAME. Give the MODEL "
        "argument before this flag: it takes every word after it")


@dataclasses.dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None  # the JSON form's; must be the served model's name


def parse_lora_module(text: str) -> LoRAModule:
    """One --lora-modules value (argparse's `type`): NAME=PATH or a JSON object."""
    text = text.strip()
    if text.startswith("{"):
        return _from_json(text)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {text!r}")
    return LoRAModule(name.strip(), path.strip())


def _from_json(text: str) -> LoRAModule:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON in {text!r}: {e}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    unknown = sorted(set(data) - set(JSON_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key(s) {unknown} in {text!r}; the keys are "
                                         f"{list(JSON_KEYS)}")
    name, path, base = (data.get(k) for k in JSON_KEYS)
    for key, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise argparse.ArgumentTypeError(f"{key!r} must be a non-empty string in {text!r}")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"'base_model_name' must be a string in {text!r}")
    return LoRAModule(name.strip(), path.strip(), base)


def add_lora_modules_arg(parser) -> None:
    parser.add_argument("--lora-modules", nargs="+", action="extend", type=parse_lora_module,
                        default=None, metavar="NAME=PATH", help=HELP)


def check_lora_flags(modules: list[LoRAModule], *, enable_lora: bool, served_name: str,
                     data_parallel_size: int | None, executor_backend: str) -> None:
    """Raises ValueError, saying what to change, for flags that cannot go together."""
    if enable_lora and data_parallel_size is not None:
        raise ValueError("--enable-lora with --data-parallel-size is not supported yet: the "
                         "Ray replicas load no adapters; serve one engine (drop "
                         "--data-parallel-size)")
    if not modules:
        return
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (an engine started without it "
                         "has no adapter slots)")
    if executor_backend == "ray":
        raise ValueError("--lora-modules with --distributed-executor-backend ray is not "
                         "supported: LoRA adapters are served on one host")
    seen = set()
    for m in modules:
        if m.name in seen:
            raise ValueError(f"--lora-modules names adapter {m.name!r} twice")
        seen.add(m.name)
        if m.name == served_name:
            raise ValueError(f"--lora-modules: adapter name {m.name!r} is the served model's "
                             "name; requests could not select the base model")
        if m.base_model_name is not None and m.base_model_name != served_name:
            raise ValueError(f"--lora-modules {m.name!r}: base_model_name "
                             f"{m.base_model_name!r} is not the served model ({served_name!r})")


def load_lora_modules(registry, modules: list[LoRAModule]) -> list[LoRARequest]:
    """Registers `modules` in the engine's adapter registry (jaxserve/lora_adapters.py) with
    ids 1, 2, ... in order, reading their files now. Raises LoRAError naming the adapter and
    the problem."""
    loaded = []
    for lora_id, m in enumerate(modules, start=1):
        adapter = LoRARequest(m.name, lora_id, m.path)
        try:
            registry.add(adapter)
        except LoRAError as e:
            raise LoRAError(f"--lora-modules {m.name}={m.path}: {e}") from None
        loaded.append(adapter)
    return loaded
