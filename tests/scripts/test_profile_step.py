"""scripts/profile_step.py on a tiny random model: its steps are the runner's own ragged steps,
and every row it reports runs."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "profile_step.py"


@pytest.fixture(scope="module")
def profile_step():
    spec = importlib.util.spec_from_file_location("profile_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("profile_step", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_its_step_is_the_runners_step(profile_step):
    """An idle step built by the script equals the runner's own idle step, field by field."""
    args = profile_step.parse_args(["--tiny", "--rows", "4", "--ctx", "20", "--prefill", "32"])
    steps = profile_step.Steps(args, -(-profile_step.MAX_MODEL_LEN // args.block_size))
    model, spec = profile_step.model_and_spec(args, steps.num_blocks)
    runner = profile_step.build_runner(model, spec)
    ours = profile_step.step_call(runner, [], steps.decode_table)
    theirs = runner.step_template(*ours.shape)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    decode = profile_step.step_call(runner, *steps.decode())
    assert decode.shape == (4,) and int(decode.inputs.meta(ragged=True).num_pairs) == 4 * 2


def test_every_row_runs(profile_step, capsys):
    rows = profile_step.main(["--tiny", "--rows", "4", "--ctx", "20", "--prefill", "32",
                              "--iters", "1", "--mixed"])
    names = [name for name, _ in rows]
    assert len(rows) == 9 and all(ms > 0 for _, ms in rows), rows
    assert any(n.startswith("mixed step, 3 decodes + 1 chunk") for n in names), names
    assert names[0] in capsys.readouterr().out
