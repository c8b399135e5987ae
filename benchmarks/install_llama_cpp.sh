#!/usr/bin/env bash
# Make a separate venv with llama.cpp's Python binding (llama-cpp-python), the baseline of
# `--llama-cpp-python` in benchmarks/quantized_decode.py: the peer a CPU user picks for a GGUF.
#
#     bash benchmarks/install_llama_cpp.sh [VENV_DIR]      # default: .venv-llama-cpp in the repo root
#
# Environment: LLAMA_CPP_VERSION (default 0.3.36). PyPI carries llama-cpp-python as source
# only: pip builds llama.cpp with CMake (fetched by pip) and the system C++ compiler, for this
# CPU (GGML_NATIVE, as cpu_kernels.cc is built with -march=native), about 5-10 minutes on two
# cores. Re-running on a complete venv only checks it. Nothing of it enters jaxserve's venv.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-llama-cpp}"
LLAMA_CPP_VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
say() { echo "install_llama_cpp: $*"; }

check() {
  "$VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
}

if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.llama-cpp-complete" ] && summary="$(check 2>/dev/null)"; then
  say "$VENV already has $summary"
  exit 0
fi

PY=""
for candidate in python3.12 "$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12" python3; do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] >= (3, 9)' >/dev/null 2>&1; then
    PY="$candidate"
    break
  fi
done
[ -n "$PY" ] || { say "no Python 3 found" >&2; exit 1; }
command -v "${CXX:-c++}" >/dev/null || { say "no C++ compiler (${CXX:-c++}); llama.cpp is built from source" >&2; exit 1; }

start=$SECONDS
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
say "building llama-cpp-python $LLAMA_CPP_VERSION from source into $VENV (5-10 minutes on two cores)"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  --no-cache-dir "llama-cpp-python==$LLAMA_CPP_VERSION" numpy
summary="$(check)"
touch "$VENV/.llama-cpp-complete"
say "done in $((SECONDS - start)) s: $VENV has $summary"
