#!/usr/bin/env bash
# Sets kvcopy up (scripts/setup.sh), checks the style and runs the whole test suite.
# Fails when nvcc is present but the CUDA kernels were not built.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
if command -v nvcc >/dev/null && [ "${KVCOPY_NO_EXT:-0}" != 1 ]; then
  python - <<'PY'
import sys, torch, kvcopy
if torch.version.cuda and not kvcopy.build_info()["cuda_kernels"]:
    sys.exit("nvcc is present and torch is a CUDA build, but kvcopy's CUDA kernels were not built")
PY
fi
# Style is checked, not remembered: ruff (lint + format) for Python, clang-format for C++ and CUDA.
ruff check .
ruff format --check .
git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' | xargs clang-format --dry-run --Werror
python -m pytest -q "$@"
