"""Mistral, Gemma 2 and Gemma 3 text (sliding windows, soft-capping, Gemma's norms) against HF.

Tiny random models made by transformers (tests/windowed_models.py): windows of 12 positions,
shorter than the prompts, local and global layers both present, GQA. The dense forward's logits
must equal HF's within the float32 tolerance of tests/modeling/test_model_hf.py.
"""

import numpy as np
import pytest

from models import load_model
from windowed_models import NAMES, PROMPTS, WINDOW, windowed_reference

pytestmark = pytest.mark.hf_ref

ATOL = 2e-4  # as tests/modeling/test_model_hf.py: fp32 vs fp32, summation order only


@pytest.fixture(scope="module")
def reference():
    return windowed_reference()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf(reference, name):
    model = load_model(reference["workdir"] / name, dtype="float32")
    assert max(len(p) for p in PROMPTS) > 4 * WINDOW  # the window really cuts
    for i, ids in enumerate(PROMPTS):
        np.testing.assert_allclose(model.forward_logits(ids), reference[f"{name}/{i}"],
                                   atol=ATOL, rtol=0)


def test_configs_read_from_hf(reference):
    c = load_model(reference["workdir"] / "mistral").config
    assert (c.architecture, c.sliding_window, c.layer_types) == \
        ("mistral", WINDOW, ("sliding_attention",) * 3)
    g2 = load_model(reference["workdir"] / "gemma2").config
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.query_pre_attn_scalar,
            g2.hidden_act, g2.tie_word_embeddings) == (3.0, 5.0, 24.0, "gelu_pytorch_tanh", True)


def test_refusals_name_the_field(reference, tmp_path):
    import json
    import shutil

    from models.weights import CheckpointError
    for change, message in [({"use_bidirectional_attention": True}, "use_bidirectional"),
                            ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
                            ({"layer_types": ["sliding_attention"]}, "layer_types has 1"),
                            ({"sliding_window": 0}, "sliding_window must be a positive")]:
        d = tmp_path / message.split()[0]
        shutil.copytree(reference["workdir"] / "gemma2", d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(change)
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=message):
            load_model(d)
