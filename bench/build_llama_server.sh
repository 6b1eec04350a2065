#!/usr/bin/env bash
# Build llama.cpp's llama-server for `kvmesh bench engine --llama-server PATH` (docs/benchmarks.md).
#
#   bench/build_llama_server.sh [DIR]      # default DIR: .llama-server; prints the binary's path last
#
# The source is the llama.cpp that llama-cpp-python's sdist vendors (from the package index, as pip would take it),
# so the C++ server and the Python one are the same llama.cpp. Needs cmake and a C++ compiler; about 3 minutes
# on 2 cores. Native CPU flags (GGML_NATIVE): the binary is for this machine.
set -euo pipefail
VERSION=0.3.16
DIR=$(realpath -m "${1:-.llama-server}")
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR"
if [ ! -d "$DIR/src/llama_cpp_python-$VERSION" ]; then
  "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/src" >&2
  tar -xzf "$DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src"
fi
SOURCE="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SOURCE" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$DIR/build" --target llama-server -j "$(nproc)" >&2
echo "$DIR/build/bin/llama-server"
