#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (the serving peer of scripts/bench_serving_peers.py) from the
# sources that the llama-cpp-python sdist vendors, with native CPU flags, into
# .peers/llama-server. The sdist comes from PyPI, the one registry this machine reaches; the
# version is the one the Python-API peer benchmarks use, so both peers are the same llama.cpp.
# About 10 minutes on 2 cores. Run by `scripts/setup.sh --peers`.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
DEST=.peers/llama-server
if [ -x "$DEST/bin/llama-server" ] && [ "$(cat "$DEST/.version" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
.venv/bin/python -m pip download --quiet --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" -d "$WORK" 2>&1 | grep -v "is ignored" || true
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
# No web UI download, no HTTPS or curl (nothing to fetch at run time): the benchmark only
# speaks the OpenAI routes over plain HTTP.
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF >"$WORK/cmake.log" 2>&1 ||
  { tail -40 "$WORK/cmake.log" >&2; exit 1; }
# The compiler's warnings in ggml's intrinsics fill screens; a failure shows the log's tail.
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >"$WORK/build.log" 2>&1 ||
  { tail -40 "$WORK/build.log" >&2; exit 1; }
rm -rf "$DEST"
mkdir -p "$DEST/bin"
cp "$WORK/build/bin/llama-server" "$DEST/bin/"
echo "$VERSION" > "$DEST/.version"
"$DEST/bin/llama-server" --version 2>&1 | head -2
