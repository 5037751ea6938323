#!/usr/bin/env bash
# Build llama.cpp's llama-batched-bench from the llama-cpp-python sdist's vendored source (the llama.cpp baseline of
# compare.py / llamacpp.py). Benchmark setup only: never run by the tests. Cached under benchmarks/build/ (git-ignored);
# a second run reuses the binary. Builds at nice 19 (the machine is shared). Usage:
#   bash benchmarks/setup_llamacpp.sh            # prints the binary's path
#   LLAMA_NO_AMX=1 bash benchmarks/setup_llamacpp.sh   # -march=native without AMX: on a VM whose CPU reports AMX
#     (Xeon, family 6 model 167), the native build's AMX matmul segfaults at the first batch (ggml_backend_amx_mul_mat,
#     5 Dec 2026), so llama.cpp is built with AVX-512 there. Remove benchmarks/build/ to rebuild the other way.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="$HERE/build/llama-cpp-python-$VERSION"
BIN="$BUILD/bin/llama-batched-bench"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$BUILD"
if [ ! -d "$BUILD/src" ]; then
  nice -n 19 python -m pip download "llama-cpp-python==$VERSION" --no-binary llama-cpp-python --no-deps \
    -d "$BUILD/sdist" >&2
  mkdir -p "$BUILD/src"
  tar -xzf "$BUILD"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$BUILD/src" --strip-components=1
fi
SRC="$BUILD/src/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "setup_llamacpp.sh: no vendored llama.cpp in $BUILD/src/vendor" >&2; exit 2; }
EXTRA=()
if [ "${LLAMA_NO_AMX:-0}" = 1 ]; then
  EXTRA=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
nice -n 19 cmake -S "$SRC" -B "$BUILD/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF "${EXTRA[@]}" >&2
nice -n 19 cmake --build "$BUILD/cmake" --target llama-batched-bench -j 2 >&2
mkdir -p "$BUILD/bin"
cp "$BUILD/cmake/bin/llama-batched-bench" "$BIN"
echo "$BIN"
