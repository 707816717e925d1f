#!/usr/bin/env bash
# Downloads the wheels device_check.sh may need on the lent GPU machine, which
# has python3.12 and torch but no network: the test, plot, build and progress
# dependencies kvcopy needs beyond torch, and transformers for the engine
# tests. Pass the folder to `run` with carry=["wheelhouse"]; device_check.sh
# unpacks only what that machine lacks.
#
#   bash benchmarks/fetch_wheelhouse.sh [DIR]     (default: wheelhouse/, gitignored; about 60 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-wheelhouse}
python=${PYTHON:-python3}
platform=(--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp)
"$python" -m pip download --quiet --dest "$dir" "${platform[@]}" \
  numpy pytest hypothesis tqdm matplotlib "setuptools>=77" wheel
# transformers without its command-line and download extras (hf_xet, pydantic, typer, rich: ~8 MB that
# the engine tests never import), so that everything fits run()'s 64 MiB carry.
"$python" -m pip download --quiet --dest "$dir" "${platform[@]}" --no-deps \
  "transformers>=5.23.0,<5.24" "huggingface_hub>=1.3,<3" tokenizers safetensors regex pyyaml filelock fsspec \
  httpx2 httpcore2 h11 anyio idna truststore packaging typing_extensions
du -sh "$dir"
