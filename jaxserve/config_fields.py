"""What a config dataclass declares in its fields, read in one place.

- `Literal` annotations are the choices: `check_choices` validates them (the config's own error
  message) and the CLI offers them as `choices=`.
- `add_config_args` turns every field into a flag: `--max-num-seqs` for `max_num_seqs`, the type
  from the annotation, the default from the dataclass, the help from
  `field(metadata={"help": ...})`; booleans become `--flag/--no-flag`. `metadata={"cli": False}`
  keeps a field off the command line (a command decides it); `metadata={"aliases": (...)}` adds
  other spellings of the flag.

No jax here: the CLI builds its parser before jax starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

_BASE_TYPES = (bool, int, float, str)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FieldType:
    base: type                      # one of bool, int, float, str
    choices: tuple | None = None    # a Literal's values
    optional: bool = False          # None is allowed


def field_type(annotation) -> FieldType:
    """`int`, `str | None`, `Literal[...]`, `Literal[...] | None` -> FieldType."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"a config field holds one type (or None), got {annotation!r}")
        annotation, optional = rest[0], True
    parse = getattr(annotation, "parse", None)
    if dataclasses.is_dataclass(annotation) and callable(parse):
        # A nested frozen config (e.g. SpeculativeConfig): the flag takes its JSON text, which
        # the config's __post_init__ parses (so a bad value gets the config's own message).
        return FieldType(base=str, optional=optional)
    if typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
        bases = {type(c) for c in choices}
        if len(bases) != 1 or not bases <= set(_BASE_TYPES):
            raise TypeError(f"Literal choices must share one of {_BASE_TYPES}, got {choices!r}")
        return FieldType(base=bases.pop(), choices=choices, optional=optional)
    if annotation not in _BASE_TYPES:
        raise TypeError(f"config fields are {_BASE_TYPES}, a Literal or optional; got "
                        f"{annotation!r}")
    return FieldType(base=annotation, optional=optional)


def field_types(cls) -> dict[str, FieldType]:
    hints = typing.get_type_hints(cls)
    return {f.name: field_type(hints[f.name]) for f in dataclasses.fields(cls)}


def check_choices(config) -> None:
    """Raises ValueError, naming the choices, when a Literal field holds another value."""
    for name, kind in field_types(type(config)).items():
        value = getattr(config, name)
        if kind.choices is None or (value is None and kind.optional):
            continue
        # bool is an int: True must not pass for a choice of 1.
        if type(value) is not kind.base or value not in kind.choices:
            none = " or None" if kind.optional else ""
            raise ValueError(f"{name} must be one of {kind.choices}{none}, got {value!r}")


def cli_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def add_config_args(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per CLI field of the dataclass `cls`; each flag's dest is the field's name."""
    kinds = field_types(cls)
    for f in cli_fields(cls):
        kind = kinds[f.name]
        names = [f"--{f.name.replace('_', '-')}", *f.metadata.get("aliases", ())]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory())
        # argparse %-formats help strings.
        text = f.metadata.get("help", "").replace("%", "%%")
        if default is not None:
            text += " (default: %(default)s)"
        if kind.base is bool:  # BooleanOptionalAction adds --no-NAME for every --NAME
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, required=required, help=text)
        else:
            parser.add_argument(*names, dest=f.name, type=kind.base, choices=kind.choices,
                                default=default, required=required, help=text)


def config_kwargs(args: argparse.Namespace, cls) -> dict:
    """The CLI fields of `cls` as parsed: keyword arguments for `cls(...)`."""
    return {f.name: getattr(args, f.name) for f in cli_fields(cls)}
