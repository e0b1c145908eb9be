"""The CUDA compiler plugin for deviceless compiles, where scripts/setup.sh --test puts it.

setup installs jax-cuda13-plugin into the checkout's `.cuda-plugin/`, outside `.venv`: inside
it, every jax start on a machine without CUDA would print a plugin error. A tool that compiles
for an H200 (scripts/gpu_step_report.py) calls `use_setup_plugin()` before anything imports jax,
which looks for its plugins once, on import. Imports no jax itself.
"""

from __future__ import annotations

import pathlib
import sys

# The checkout's root: this file is jaxserve/tools/cuda_plugin.py.
PLUGIN_DIR = pathlib.Path(__file__).resolve().parents[2] / ".cuda-plugin"


def use_setup_plugin(plugin_dir: pathlib.Path = PLUGIN_DIR) -> bool:
    """Puts `plugin_dir` first on the import path when it exists; True when it did. Without
    it, jaxserve.tools.deviceless.unavailable_reason() says how to install the plugin."""
    if not plugin_dir.is_dir():
        return False
    if str(plugin_dir) not in sys.path:
        sys.path.insert(0, str(plugin_dir))
    return True
