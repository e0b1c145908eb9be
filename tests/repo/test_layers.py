"""The layering rules of the tree (docs/architecture.md), checked rather than stated.

- every jaxserve.core module imports in a process where importing jax raises;
- `import jaxserve` and `from jaxserve import SamplingParams` do not start jax (lazy exports);
- models/ imports neither jaxserve nor pallas_kernels; pallas_kernels/ does not import
  jaxserve or models (read from the source, so a lazy or local import is caught too).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE_MODULES = sorted(f"jaxserve.core.{p.stem}" for p in (ROOT / "jaxserve" / "core").glob("*.py")
                      if p.stem != "__init__")

# A meta-path finder that refuses jax (and flax, which imports it) before anything else loads.
_BLOCK_JAX = textwrap.dedent("""
    import sys
    class _NoJax:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("jax", "jaxlib", "flax"):
                raise ImportError(f"jax is blocked in this process: something imported {name}")
            return None
    sys.meta_path.insert(0, _NoJax())
""")


def _run_without_jax(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK_JAX + textwrap.dedent(body)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_core_has_modules():
    # The glob above must see the package (an empty list would make the next test vacuous).
    assert {"jaxserve.core.scheduler", "jaxserve.core.block_manager",
            "jaxserve.core.request_state", "jaxserve.core.beam_search"} <= set(CORE_MODULES)


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_without_jax(module):
    r = _run_without_jax(f"import {module}\nassert 'jax' not in sys.modules\n")
    assert r.returncode == 0, r.stderr[-2000:]


def test_public_names_are_lazy():
    r = _run_without_jax("""
        import jaxserve
        from jaxserve import LoRARequest, SamplingParams, RequestOutput
        assert SamplingParams(temperature=0).temperature == 0
        assert 'jax' not in sys.modules
        assert sorted(jaxserve.__all__) == ['CompletionOutput', 'EmbeddingOutput',
                                            'EmbeddingRequestOutput', 'EngineConfig', 'LLM',
                                            'LLMEngine', 'LoRARequest', 'PoolingParams',
                                            'RequestOutput', 'RequestOutputKind',
                                            'SamplingParams']
    """)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_guard_sees_a_jax_import():
    # The blocker must really block: a module that imports jax fails under it.
    r = _run_without_jax("import jaxserve.runtime.buckets, jaxserve.runtime.kv_cache\n")
    assert r.returncode != 0 and "jax is blocked" in r.stderr


def _imported_roots(path: pathlib.Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package,forbidden", [("models", {"jaxserve", "pallas_kernels"}),
                                               ("pallas_kernels", {"jaxserve", "models"})])
def test_package_does_not_import_upward(package, forbidden):
    files = sorted((ROOT / package).glob("*.py"))
    assert files
    bad = {f.name: sorted(_imported_roots(f) & forbidden) for f in files}
    assert not {k: v for k, v in bad.items() if v}
