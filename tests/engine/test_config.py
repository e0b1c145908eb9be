"""One source for configuration: choices declared once, the CLI's engine flags generated from
EngineConfig's fields, SchedulerConfig derived from EngineConfig (no model needed)."""

import dataclasses
import re
import subprocess
import sys
import typing

import pytest

from jaxserve.cli import _engine_kwargs, build_parser, main
from jaxserve.config import (QUANTIZATION_ALIASES, QUANTIZATION_MODES, QUANTIZATION_PATHS,
                             QUANTIZATIONS, EngineConfig)
from jaxserve.config_fields import check_choices, cli_fields, field_type, field_types
from models.config import DTYPES

COMMANDS = {"generate": ["generate", "hi"], "serve": ["serve"], "bench": ["bench"]}
# Declared in the fields' metadata: the commands decide these themselves.
EXCLUDED = {"warmup"}


def _other_value(name, kind, default) -> list[str]:
    """Flag arguments that set the field to something other than its default."""
    flag = "--" + name.replace("_", "-")
    if kind.base is bool:
        return ["--no-" + flag[2:] if default else flag]
    if kind.choices:
        return [flag, next(c for c in kind.choices if c != default)]
    return [flag, {int: "32", float: "0.5", str: "elsewhere"}[kind.base]]


def test_exclusions_are_declared_in_the_fields():
    assert {f.name for f in dataclasses.fields(EngineConfig)} - \
        {f.name for f in cli_fields(EngineConfig)} == EXCLUDED


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_engine_field_is_a_flag_with_the_dataclass_default(command):
    argv = COMMANDS[command]
    args = build_parser().parse_args(argv)
    kwargs = _engine_kwargs(args)
    fields = cli_fields(EngineConfig)
    assert set(kwargs) == {f.name for f in fields}
    assert kwargs == {f.name: f.default for f in fields}
    assert EngineConfig(**kwargs) == EngineConfig()
    kinds = field_types(EngineConfig)
    for f in fields:
        value = _other_value(f.name, kinds[f.name], f.default)
        got = _engine_kwargs(build_parser().parse_args(argv + value))[f.name]
        assert got == (not f.default) if kinds[f.name].base is bool else str(got) == value[1]


def test_boolean_flags_take_both_spellings():
    parse = lambda *a: _engine_kwargs(build_parser().parse_args(["serve", *a]))
    assert parse("--no-enable-chunked-prefill")["enable_chunked_prefill"] is False
    assert parse("--no-prefix-caching")["enable_prefix_caching"] is False
    assert parse("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert parse("--prefix-caching")["enable_prefix_caching"] is True


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--block-size", "3"], "block_size must be a power of 2"),
    (["serve", "--max-num-seqs", "8", "--max-num-batched-tokens", "4"],
     r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"),
    (["bench", "--gpu-memory-utilization", "1.5"], r"gpu_memory_utilization must be in \(0, 1\]"),
    (["generate", "hi", "--max-model-len", "1"], "max_model_len must be an integer >= 2"),
])
def test_bad_engine_value_exits_2_with_the_config_message(argv, message, capsys):
    assert main(argv) == 2  # returned, not raised: no traceback
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err)


def test_literal_fields_offer_their_choices_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "hi", "--attention-backend", "cudnn"])
    assert e.value.code == 2
    assert "invalid choice: 'cudnn'" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--attention-backend", "pallas-interpret",
                                      "--linear-backend", "xla", "--quantization", "int4"])
    config = EngineConfig(**_engine_kwargs(args))
    assert (config.attention_backend, config.linear_backend, config.quantization) == \
        ("pallas-interpret", "xla", "int4")


def test_choices_are_declared_once():
    from jaxserve.quantization import paths
    assert paths.PATHS is QUANTIZATION_PATHS and paths.ALIASES is QUANTIZATION_ALIASES
    assert paths.MODES is QUANTIZATION_MODES
    assert set(QUANTIZATIONS) == (set(QUANTIZATION_MODES) | set(QUANTIZATION_PATHS)
                                  | set(QUANTIZATION_ALIASES))
    assert set(QUANTIZATION_ALIASES.values()) <= set(QUANTIZATION_PATHS)
    assert field_types(EngineConfig)["dtype"].choices == DTYPES
    with pytest.raises(TypeError):
        QUANTIZATION_ALIASES["int3"] = "w4a16"  # read-only: no global mutable state


def test_scheduler_config_is_derived_from_the_engine_config():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
                          enable_chunked_prefill=False, enable_prefix_caching=False)
    sched = config.scheduler_config(num_blocks=9, max_model_len=64)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.block_size,
            sched.enable_chunked_prefill, sched.enable_prefix_caching) == (4, 64, 8, False, False)
    assert (sched.num_blocks, sched.max_model_len) == (9, 64)
    with pytest.raises(ValueError, match="num_blocks >= 9"):
        config.scheduler_config(num_blocks=8, max_model_len=64)


def test_field_types_read_the_annotations():
    assert field_type(int | None).optional and field_type(int | None).base is int
    lit = field_type(typing.Literal[1, 2] | None)
    assert (lit.base, lit.choices, lit.optional) == (int, (1, 2), True)
    with pytest.raises(TypeError, match="one type"):
        field_type(int | str)
    with pytest.raises(TypeError, match="config fields are"):
        field_type(list[int])

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Small:
        n: typing.Literal[1, 2] = 1
    with pytest.raises(ValueError, match=r"n must be one of \(1, 2\), got True"):
        check_choices(Small(n=True))  # bool is an int, but not a choice of ints


def test_cli_parser_builds_without_jax():
    code = ("import sys, jaxserve.cli; jaxserve.cli.build_parser().parse_args(['serve']); "
            "assert 'jax' not in sys.modules, 'the CLI imported jax before parsing'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
