#!/usr/bin/env bash
# Set up a real llama-cpp-python server for the opt-in outage test: a
# virtualenv of its own (.llama-venv; llama-cpp-python is an sdist, so the
# first run builds llama.cpp, a few minutes on 2 cores) with its server and
# the gguf package. Then:
#   SOLIDLOOP_TEST_LLAMA_PYTHON=.llama-venv/bin/python \
#     .venv/bin/pytest tests/acceptance/test_provider_outage_llama_cpp.py
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .llama-venv
CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  .llama-venv/bin/pip install --quiet 'llama-cpp-python[server]' gguf numpy
echo "llama_server: ready; SOLIDLOOP_TEST_LLAMA_PYTHON=$PWD/.llama-venv/bin/python"
