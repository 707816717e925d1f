#!/usr/bin/env bash
# Sets kvcopy up (scripts/setup.sh), checks the style and runs the whole test suite.
# Fails when nvcc is present but the CUDA kernels were not built.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# tests/remote/test_netns.py makes two network namespaces joined by a veth pair: it needs iproute2 (ip, tc).
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; } \
      || echo "iproute2 could not be installed (no package mirror?): tests/remote/test_netns.py will skip" >&2
  else
    echo "iproute2 (ip, tc) is missing and cannot be installed here: tests/remote/test_netns.py will skip" >&2
  fi
fi
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
