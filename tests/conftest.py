import os
import pathlib
import sys

import pytest

# Tests run on the CPU path; the persistent cache makes a second run skip XLA compiles.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The CUDA compiler plugin (for deviceless sm_90 compiles of the Pallas kernels) lives outside
# .venv (scripts/setup.sh --test puts it in .cuda-plugin/): inside .venv every jax start on a
# machine without CUDA would print a plugin error, so only the tests see it.
_PLUGIN = pathlib.Path(__file__).resolve().parent.parent / ".cuda-plugin"
if _PLUGIN.is_dir():
    sys.path.insert(0, str(_PLUGIN))


def pytest_configure(config):
    from models.registry import cache_dir
    import jax
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.fixture(scope="session")
def smollm2_path():
    from models.registry import model_path
    return model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path):
    """The real default model in float32, loaded once for every module that needs it."""
    from models import load_model
    return load_model(smollm2_path, dtype="float32")
