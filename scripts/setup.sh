#!/usr/bin/env bash
# Sets kvcopy up from a fresh machine: a virtual environment in .venv, torch,
# and the package installed in place with its extension compiled (CPU kernels,
# plus CUDA kernels where nvcc and a CUDA build of torch are present).
#
#   PYTHON=python3.11          interpreter for the venv (default: python3)
#   KVCOPY_TORCH='torch==2.14.1'  the torch to install (2.14.1 is a CUDA 13.0 build;
#                              'torch==2.13.0' is CPU-only on the dev machines)
#   KVCOPY_NO_EXT=1            install without compiling anything
#   KVCOPY_NO_VLLM=1           leave vLLM out (its tests then skip, saying so)
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
torch_spec=${KVCOPY_TORCH:-torch==2.14.1}

[ -x .venv/bin/python ] || "$python" -m venv .venv
export PATH="$PWD/.venv/bin:$PATH"   # so the build finds the venv's ninja
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "$torch_spec" numpy ninja "setuptools>=77" wheel
extras="test,plot"
if [ "${KVCOPY_NO_VLLM:-0}" != 1 ]; then
  # vLLM pins torch==2.14.0: installed without its dependencies, it runs on kvcopy's torch; the "vllm" extra
  # brings the pure-Python packages it needs (pyproject.toml).
  python -m pip install --quiet --no-deps "vllm==0.33.0"
  extras="$extras,vllm"
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} python -m pip install --quiet --no-build-isolation -e ".[$extras]"
python -m kvcopy info
