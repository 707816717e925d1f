#!/usr/bin/env bash
# Sets kvcopy up (scripts/setup.sh), checks the style and the types, and runs the whole test suite: what CI
# runs.
# Fails when nvcc is present but the CUDA kernels were not built.
#
# --quick (first argument) is the inner loop, on a machine already set up: the same style checks, then
# `python -m pytest -q -m "not slow"` (under 3 minutes on 2 idle cores; docs/testing.md says what it
# leaves out). Other arguments pass through to pytest: bash scripts/test.sh --quick tests/engine -x
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
if [ "${1:-}" = --quick ]; then
  quick=1
  shift
fi

# Style is checked, not remembered: ruff (lint + format) for Python, clang-format for C++ and CUDA; and mypy
# checks the package's types ([tool.mypy] in pyproject.toml says what and how).
check_style() {
  ruff check .
  ruff format --check .
  git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' | xargs clang-format --dry-run --Werror
  mypy
}

if [ "$quick" = 1 ]; then
  export PATH="$PWD/.venv/bin:$PATH"
  check_style
  exec python -m pytest -q -m "not slow" "$@"
fi

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
check_style
python -m pytest -q "$@"
