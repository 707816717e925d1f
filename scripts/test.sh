#!/usr/bin/env bash
# Sets kvcopy up (scripts/setup.sh) and runs the whole test suite.
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
python -m pytest -q "$@"
