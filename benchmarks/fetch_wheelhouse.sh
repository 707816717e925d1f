#!/usr/bin/env bash
# Downloads the wheels device_check.sh may need on the lent GPU machine, which
# has python3.12 and torch but no network: the test, plot, build and progress
# dependencies kvcopy needs beyond torch, and transformers for the engine
# tests. Pass the folder to `run` with carry=["wheelhouse"]; device_check.sh
# unpacks only what that machine lacks.
#
#   bash benchmarks/fetch_wheelhouse.sh [DIR]     (default: wheelhouse/, gitignored; about 45 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-wheelhouse}
python=${PYTHON:-python3}
"$python" -m pip download --quiet --dest "$dir" --only-binary=:all: \
  --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --implementation cp \
  numpy pytest hypothesis tqdm matplotlib "setuptools>=77" wheel "transformers>=5.23.0,<5.24"
du -sh "$dir"
