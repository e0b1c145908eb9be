"""The tier markers hold: a test that reaches the real model or the HF reference without its
marker fails (tests/conftest.py ResourceGuard), so the inner-loop selection can be trusted."""

import pytest


def test_loading_the_real_model_needs_the_model_marker():
    from models import registry
    with pytest.raises(pytest.fail.Exception, match="is not marked `model`"):
        registry.model_path("smollm2-135m")


def test_running_the_hf_reference_needs_the_hf_ref_marker():
    import hf_reference
    with pytest.raises(pytest.fail.Exception, match="is not marked `hf_ref`"):
        hf_reference.run_reference("ref_tokenizer", {})

