#!/usr/bin/env bash
# Sets up jaxserve on a fresh machine: .venv (Python >= 3.12, the package and its deps) and the
# default model in the cache. With --test also .venv-ref: HF transformers on CPU torch, the
# independent reference the tests compare against (torch's CPU wheel here is for Python 3.11).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_TEST=0
WITH_PEERS=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    # llama.cpp as a benchmark peer (scripts/bench_throughput.py --llama-cpp-python
    # .venv-ref/bin/python): a native build of llama-cpp-python, ~10 min on 2 cores, so not in CI.
    --peers) WITH_TEST=1; WITH_PEERS=1 ;;
    *) echo "setup: unknown option $arg (use --test and/or --peers)" >&2; exit 2 ;;
  esac
done

pyenv_root() { command -v pyenv >/dev/null 2>&1 && pyenv root || echo "$HOME/.pyenv"; }

# Prints the first interpreter whose version satisfies "$1" (a Python expression on sys.version_info).
find_python() {
  local cond=$1; shift
  local c
  for c in "$@" $(ls -d "$(pyenv_root)"/versions/3.*/bin/python3 2>/dev/null | sort -rV); do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import sys; sys.exit(0 if $cond else 1)" 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

stamp() { cat pyproject.toml constraints.txt "$@" 2>/dev/null | sha256sum | cut -c1-16; }

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python "(3, 12) <= sys.version_info[:2] < (3, 14)" python3.13 python3.12 python3) || {
    echo "setup: no Python >= 3.12 found (jax >= 0.11 needs it). Install one (e.g. pyenv install 3.12) and rerun." >&2
    exit 1; }
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
if [ "$(cat .venv/.jaxserve-stamp 2>/dev/null)" != "$(stamp)" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]' 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import jax, flax, models, jaxserve" || { echo "setup: install failed" >&2; exit 1; }
  stamp > .venv/.jaxserve-stamp
fi
.venv/bin/jaxserve download smollm2-135m
# The native CPU attention kernel, compiled here for this machine (a first use would build it
# too; without a C++ compiler the engine falls back to XLA attention).
# This CPU's instruction-set level; with --test every x86-64 level, which the kernel tests run
# (the lower ones this CPU has) or compile (jaxserve/native/isa.py).
NATIVE_ALL=$([ "$WITH_TEST" = 1 ] && echo --all || true)
.venv/bin/python -m jaxserve.native $NATIVE_ALL >/dev/null || echo "setup: native CPU kernels not built (see above); XLA attention will serve" >&2

if [ "$WITH_TEST" = 1 ]; then
  if [ ! -x .venv-ref/bin/python ]; then
    REFPY=$(find_python "sys.version_info[:2] == (3, 11)" python3.11 python3) || {
      echo "setup: no Python 3.11 for the CPU torch wheel; using .venv's Python (pip will fetch a large torch build)" >&2
      REFPY=.venv/bin/python; }
    echo "setup: creating .venv-ref (HF reference) with $REFPY"
    "$REFPY" -m venv .venv-ref
  fi
  if [ "$(cat .venv-ref/.jaxserve-stamp 2>/dev/null)" != "$(stamp tests/requirements-ref.txt)" ]; then
    .venv-ref/bin/python -m pip install --quiet -r tests/requirements-ref.txt 2>&1 | grep -v "is ignored" || true
    .venv-ref/bin/python -c "import torch, transformers, gguf, peft" || { echo "setup: reference install failed" >&2; exit 1; }
    stamp tests/requirements-ref.txt > .venv-ref/.jaxserve-stamp
  fi
  # GuideLLM, the third-party load client (tests/server/test_guidellm.py and
  # scripts/bench_serving_peers.py), in a venv of its own: its pins (httpx, click, protobuf)
  # would move the reference environment's.
  if [ ! -x .venv-bench/bin/python ]; then
    BENCHPY=$(find_python "(3, 10) <= sys.version_info[:2] < (3, 14)" python3.12 python3) || {
      echo "setup: no Python >= 3.10 for GuideLLM" >&2; exit 1; }
    "$BENCHPY" -m venv .venv-bench
  fi
  if [ "$(cat .venv-bench/.jaxserve-stamp 2>/dev/null)" != "$(stamp tests/requirements-bench.txt)" ]; then
    .venv-bench/bin/python -m pip install --quiet -r tests/requirements-bench.txt 2>&1 | grep -v "is ignored" || true
    .venv-bench/bin/guidellm --version >/dev/null || { echo "setup: GuideLLM install failed" >&2; exit 1; }
    stamp tests/requirements-bench.txt > .venv-bench/.jaxserve-stamp
  fi
  # Ray Serve for the replica and multi-host-launch tests (the [ray] extra; the main job
  # does not need it).
  if [ "$(cat .venv/.jaxserve-ray-stamp 2>/dev/null)" != "$(stamp)" ]; then
    .venv/bin/python -m pip install --quiet -c constraints.txt -e '.[dev,ray]' 2>&1 | grep -v "is ignored" || true
    .venv/bin/python -c "import ray.serve" || { echo "setup: ray[serve] install failed" >&2; exit 1; }
    stamp > .venv/.jaxserve-ray-stamp
  fi
  # The CUDA compiler plugin at jax's version, for deviceless sm_90 compiles of the Pallas
  # kernels. Kept out of .venv (tests/conftest.py adds it to sys.path): installed there, every
  # jax start on a machine without CUDA would print a plugin error.
  JAXVER=$(.venv/bin/python -c "import jax; print(jax.__version__)")
  if [ "$(cat .cuda-plugin/.version 2>/dev/null)" != "$JAXVER" ]; then
    rm -rf .cuda-plugin
    if .venv/bin/python -m pip install --quiet --target .cuda-plugin --no-deps \
        "jax-cuda13-plugin==$JAXVER" "jax-cuda13-pjrt==$JAXVER" 2>&1 | grep -v "is ignored"; then :; fi
    if [ -d .cuda-plugin/jax_plugins ]; then echo "$JAXVER" > .cuda-plugin/.version
    else echo "setup: CUDA compiler plugin unavailable; the deviceless compile tests will skip" >&2; fi
  fi
  # Headless Chromium for the web page's browser tests (tests/server/test_webui.py), driven by
  # Playwright (installed with .[dev]): Debian's package, as Playwright's own browser download
  # is not reachable from every machine.
  if [ ! -x /usr/bin/chromium ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      echo "setup: installing chromium (apt) for the browser tests"
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
        echo "setup: chromium install failed; the browser tests will skip" >&2
    else
      echo "setup: no /usr/bin/chromium (as root: apt-get install chromium); the browser tests will skip" >&2
    fi
  fi
fi
if [ "$WITH_PEERS" = 1 ] && ! .venv-ref/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "setup: building llama-cpp-python natively in .venv-ref (about 10 minutes)"
  CMAKE_ARGS="-DGGML_NATIVE=ON" .venv-ref/bin/python -m pip install --quiet --no-cache-dir \
    "llama-cpp-python==0.3.36" 2>&1 | grep -v "is ignored" || true
  .venv-ref/bin/python -c "import llama_cpp" || { echo "setup: llama-cpp-python build failed" >&2; exit 1; }
fi
if [ "$WITH_PEERS" = 1 ]; then
  # llama.cpp's own server, the peer of scripts/bench_serving_peers.py (about 10 minutes).
  bash scripts/build_llama_server.sh || { echo "setup: llama-server build failed" >&2; exit 1; }
fi
echo "setup: ready"
