#!/usr/bin/env bash
# Downloads the wheels device_check.sh may need on the lent GPU machine, which
# has python3.12 and torch but no network: the test, build and progress
# dependencies kvcopy needs beyond torch (xxhash: kvcopy.storage's checksums;
# ninja: torch builds the extension's files in parallel with it), and
# transformers for the engine tests. Not matplotlib (25 MiB with its
# dependencies, over the carry beside the rest): the plots are optional, the
# check runs without them, and the GPU machine's image has it. Pass the folder to `run` with
# carry=["wheelhouse"]; device_check.sh unpacks only what that machine lacks.
#
#   bash benchmarks/fetch_wheelhouse.sh [DIR]     (default: wheelhouse/, gitignored; about 40 MiB)
#
# KVCOPY_WHEEL_PYTHON (default 3.12, the GPU machine's) picks the Python the
# wheels are for: a dry run on another machine needs wheels for its own Python.
# It prints the wheelhouse's size, and fails when the wheelhouse and the
# checkout's tracked files together pass CARRY_LIMIT_MIB, what a run may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-wheelhouse}
python=${PYTHON:-python3}
CARRY_LIMIT_MIB=64
platform=(--only-binary=:all: --python-version "${KVCOPY_WHEEL_PYTHON:-3.12}" --platform manylinux2014_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp)
"$python" -m pip download --quiet --dest "$dir" "${platform[@]}" \
  numpy pytest hypothesis tqdm "setuptools>=77" wheel "xxhash>=3.0" ninja
# transformers without its command-line and download extras (hf_xet, pydantic, typer, rich: ~8 MB that
# the engine tests never import), so that everything fits run()'s 64 MiB carry.
"$python" -m pip download --quiet --dest "$dir" "${platform[@]}" --no-deps \
  "transformers>=5.23.0,<5.24" "huggingface_hub>=1.3,<3" tokenizers safetensors regex pyyaml filelock fsspec \
  httpx2 httpcore2 h11 anyio idna truststore packaging typing_extensions
wheels_kib=$(du -sk "$dir" | cut -f1)
tree_kib=$(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -n 1 | cut -f1)
total_mib=$(((wheels_kib + tree_kib + 1023) / 1024))
echo "wheelhouse $dir: $(((wheels_kib + 1023) / 1024)) MiB; with the tracked files ${total_mib} MiB" \
  "of the ${CARRY_LIMIT_MIB} MiB a run may carry"
if [ "$total_mib" -gt "$CARRY_LIMIT_MIB" ]; then
  echo "fetch_wheelhouse: over the ${CARRY_LIMIT_MIB} MiB carry: drop a wheel the GPU machine has" >&2
  exit 1
fi
