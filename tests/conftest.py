import os
import pathlib
import sys

import pytest

# Tests run on the CPU path; the persistent cache makes a second run skip XLA compiles.
# On a GPU machine, JAX_PLATFORMS=cuda selects the `gpu` tier (compiled kernel tests).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The CUDA compiler plugin (for deviceless sm_90 compiles of the Pallas kernels) lives outside
# .venv (scripts/setup.sh --test puts it in .cuda-plugin/): inside .venv every jax start on a
# machine without CUDA would print a plugin error, so only the tests see it.
_PLUGIN = pathlib.Path(__file__).resolve().parent.parent / ".cuda-plugin"
if _PLUGIN.is_dir():
    sys.path.insert(0, str(_PLUGIN))

# Fixtures that hand a test the real SmolLM2: a test using one (directly or through another
# fixture) is in the `model` tier without saying so.
MODEL_FIXTURES = {"smollm2_path", "smollm2_fp32"}
HF_REFERENCE_TIMEOUT_S = 1900


def pytest_configure(config):
    from models.registry import cache_dir
    import jax
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    guard = ResourceGuard()
    config.pluginmanager.register(guard, "jaxserve-resource-guard")
    config.add_cleanup(guard.install())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        if item.get_closest_marker("hf_ref") and not item.get_closest_marker("timeout"):
            # A cache miss runs torch in a subprocess bounded at 1800 s (tests/hf_reference.py).
            item.add_marker(pytest.mark.timeout(HF_REFERENCE_TIMEOUT_S))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        import jax
        backend = jax.default_backend()
        if backend != "gpu":
            skip = pytest.mark.skip(reason=f"needs a GPU (jax backend is {backend!r}; "
                                           "on a GPU machine run with JAX_PLATFORMS=cuda)")
            for item in gpu_items:
                item.add_marker(skip)


class ResourceGuard:
    """Fails a test that loads the real model or runs the HF reference without its marker.

    The inner-loop command deselects by marker, so a missed marker would silently put a
    minutes-long test back into it; this makes the marker the only way in. The check runs
    from the test's setup to its teardown, so module-scoped fixtures count for the test that
    first needs them.
    """

    def __init__(self):
        self._item = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self._item = item

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item):
        self._item = None

    def install(self):
        """Wraps the two entry points to those resources; returns the undo callable."""
        import hf_reference
        from models import registry
        patch = pytest.MonkeyPatch()
        patch.setattr(registry, "model_path",
                      self._guarded(registry.model_path, "model", "loads the real model"))
        patch.setattr(hf_reference, "reference_python",
                      self._guarded(hf_reference.reference_python, "hf_ref",
                                    "runs the HF reference (tests/hf_reference.py)"))
        return patch.undo

    def _guarded(self, fn, marker: str, what: str):
        def guarded(*args, **kwargs):
            item = self._item
            if item is not None and item.get_closest_marker(marker) is None:
                # pytest.fail, not an Exception: code under test may catch those.
                pytest.fail(f"{item.nodeid} {what} but is not marked `{marker}`: add "
                            f"@pytest.mark.{marker} (the inner-loop tier deselects by "
                            "marker)", pytrace=False)
            return fn(*args, **kwargs)
        return guarded


@pytest.fixture(params=[pytest.param(True, id="interpret"),
                        pytest.param(False, id="compiled", marks=pytest.mark.gpu)])
def interpret(request):
    """A kernel test's `interpret=` switch: the same test runs through the Pallas interpreter
    (any backend) and compiled (a GPU), as JAX's own Pallas suites do with an INTERPRET
    subclass. `pytest -m gpu` on a GPU machine is the compiled kernel suite."""
    return request.param


@pytest.fixture(scope="session")
def smollm2_path():
    from models.registry import model_path
    return model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path):
    """The real default model as loaded from its GGUF file: float32 params plus the file's
    quantized blocks, which engines serve by default (quantization="auto" -> "gguf")."""
    from models import load_model
    return load_model(smollm2_path, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_gguf):
    """The real default model in float32 (the file's blocks dequantized), without the blocks,
    so every engine built on it serves float weights; shares smollm2_gguf's arrays."""
    import dataclasses
    return dataclasses.replace(smollm2_gguf, raw={})


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


@pytest.fixture(scope="module", autouse=True)
def release_module_memory(request):
    """After each test module: drop its compiled programs and garbage.

    A worker runs dozens of modules in one process; their jit caches (executables, and the
    constants some of them close over) and cyclic garbage (engines, models) otherwise pile up
    until the two workers together exceed the machine's 24 GiB and the kernel's OOM killer takes
    one ("node down: Not properly terminated"), which also wedges pytest-xdist's loadfile
    scheduler. With $JAXSERVE_TEST_RSS_LOG set, each module's peak and remaining RSS are
    appended to that file (Linux: the peak is reset through /proc/self/clear_refs)."""
    log = os.environ.get("JAXSERVE_TEST_RSS_LOG")
    if log and os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set
    yield
    import gc
    import jax
    jax.clear_caches()
    gc.collect()
    try:  # hand freed heap back to the system, so the other worker can use it
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    if log and os.path.exists("/proc/self/status"):
        with open(log, "a") as f:
            f.write(f"{request.module.__name__} peak_mib={_proc_status_kib('VmHWM') // 1024} "
                    f"after_mib={_proc_status_kib('VmRSS') // 1024} pid={os.getpid()}\n")
