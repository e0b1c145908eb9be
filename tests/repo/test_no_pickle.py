"""No pickle anywhere in the code that loads or serves models (issue 18, security).

A pickle is code: a model file or request that reaches `pickle.load` (or `np.load(...,
allow_pickle=True)`, `torch.load`) can run anything. The scan reads the source of every
module of the packages (jaxserve/, models/, pallas_kernels/) with `ast`, so a new loader
cannot bring one in unnoticed.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("jaxserve", "models", "pallas_kernels")
# Modules whose loading runs pickles (or arbitrary code from data).
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "joblib",
                  "marshal"}


def pickle_uses(source: str, name: str = "<source>") -> list[str]:
    """Every import of a banned module, `allow_pickle=True`, and `torch.load` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found += [f"{name}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in BANNED_MODULES:
                found.append(f"{name}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant)
                                                     and kw.value.value is False):
                    found.append(f"{name}:{node.lineno} allow_pickle={ast.unparse(kw.value)}")
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "load"
                    and isinstance(func.value, ast.Name) and func.value.id == "torch"):
                found.append(f"{name}:{node.lineno} torch.load")
    return found


def package_sources() -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_the_packages_use_no_pickle():
    files = package_sources()
    assert len(files) > 50  # the scan really reads the packages
    found = [use for path in files
             for use in pickle_uses(path.read_text(), str(path.relative_to(REPO)))]
    assert found == []


def test_the_scan_finds_each_kind_of_pickle_use():
    planted = ("import pickle\nfrom dill import loads\nimport numpy as np\n"
               "np.load('x.npy', allow_pickle=True)\nimport torch\ntorch.load('m.pt')\n"
               "np.load('y.npy', allow_pickle=False)\n")
    found = pickle_uses(planted, "planted.py")
    assert found == ["planted.py:1 import pickle", "planted.py:2 from dill import ...",
                     "planted.py:4 allow_pickle=True", "planted.py:6 torch.load"]
