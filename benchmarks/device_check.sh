#!/usr/bin/env bash
# One prepared check for a lent GPU machine (see shared/DESIGN.md §5):
#   bash benchmarks/device_check.sh OUT_DIR     build for this GPU's arch, run the GPU tests, the copy
#                                               and overlap benchmarks, a calibration and a plan into OUT_DIR
#   bash benchmarks/device_check.sh --dry-run [OUT_DIR]   walk every step that needs no GPU
#
# The GPU machine has no network: it uses the python3 and torch already there,
# builds the extension in place (setup.py build_ext --inplace) and runs from the
# checkout. Each step fails fast with a message naming it; logs go to OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=1
  shift
fi
out=${1:-$(mktemp -d)}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME COMMAND...: run, log to OUT/NAME.log, stop with a clear message on failure
  local name=$1
  shift
  echo "== $name"
  if ! "$@" >"$out/$name.log" 2>&1; then
    echo "device_check: step '$name' failed; last lines of $out/$name.log:" >&2
    tail -n 30 "$out/$name.log" >&2
    exit 1
  fi
  tail -n 3 "$out/$name.log"
}

has_gpu=$("$python" -c 'import torch; print(int(torch.cuda.is_available()))')
if [ "$has_gpu" = 1 ]; then
  arch=$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
  "$python" -c 'import torch; print(torch.cuda.get_device_name())' >"$out/gpu_name.txt"
elif [ "$dry_run" = 0 ]; then
  echo "device_check: no CUDA device visible; use --dry-run to walk the steps without one" >&2
  exit 1
fi
date -u +%Y-%m-%dT%H:%M:%SZ >"$out/date.txt"
# Plots need matplotlib, which the GPU machine may lack (it has no network to install it).
calib_plot=() plan_plot=()
if "$python" -c 'import matplotlib' 2>/dev/null; then
  calib_plot=(--plot "$out/calib.png") plan_plot=(--plot "$out/plan.png")
fi

step build env MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$python" setup.py build_ext --inplace
step info "$python" -m kvcopy info --json
if [ "$dry_run" = 1 ]; then
  step gpu_tests_collect "$python" -m pytest -q --collect-only -m gpu tests/test_gpu.py tests/test_engine_gpu.py
  step bench_copy "$python" benchmarks/bench_copy.py --blocks 16 --repeats 2 --csv "$out/bench_copy.csv"
  step bench_overlap "$python" benchmarks/bench_overlap.py --blocks 16 --rounds 1 --csv "$out/bench_overlap.csv"
  step calibrate "$python" -m kvcopy calibrate --quick --no-progress --out "$out/profile.json" "${calib_plot[@]}"
else
  step gpu_tests "$python" -m pytest -q -m gpu tests/test_gpu.py tests/test_engine_gpu.py
  step bench_copy "$python" benchmarks/bench_copy.py --csv "$out/bench_copy.csv"
  step bench_overlap "$python" benchmarks/bench_overlap.py --csv "$out/bench_overlap.csv"
  step calibrate "$python" -m kvcopy calibrate --no-progress --out "$out/profile.json" "${calib_plot[@]}"
  step plan "$python" -m kvcopy plan --model llama-3.1-8b --profile "$out/profile.json" "${plan_plot[@]}"
fi
echo "device_check: done; results in $out"
