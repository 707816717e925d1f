#!/usr/bin/env bash
# One prepared check for a lent GPU machine (shared/DESIGN.md §5):
#   bash benchmarks/device_check.sh OUT_DIR              on a GPU: build for its arch, run the GPU tests,
#                                                        calibrate, plan, benchmark, and write it all to OUT_DIR
#   bash benchmarks/device_check.sh --dry-run [OUT_DIR]  walk every step the CPU can, at smoke-test sizes
#
# The GPU machine (python3.12, torch with CUDA, nvcc, no network) may lack
# pytest, numpy, matplotlib or setuptools: carry a wheelhouse made by
# benchmarks/fetch_wheelhouse.sh (run(..., carry=["wheelhouse"])) and the
# distributions missing there are unpacked into the stage. Everything runs
# from a staged copy of the sources, built in place there, so the checkout's
# own build (and a test suite that imported it) is never overwritten.
# Each step logs to OUT_DIR/NAME.log. A failed setup or build step stops the
# check at once with its last lines; a failed test, calibration or benchmark
# step is reported the same way but the later steps still run (a lent GPU is
# scarce), and the check exits 1 at the end. Each step has a time limit, so
# a hang cannot eat the device time. Budget: under 8 minutes on the GPU machine
# (an estimate: build ~1.5, tests ~2, calibrate ~1, bench ~2, the rest ~1.5);
# the bench writes each point to its CSV as it ends, so a cut-short run keeps them.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=1
  shift
fi
out=${1:-$(mktemp -d)}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # steps run in the stage
python=${PYTHON:-python3}
wheelhouse=${KVCOPY_WHEELHOUSE:-wheelhouse}
started=$SECONDS

fail() {
  echo "device_check: $*" >&2
  exit 1
}

failed=()
run_step() {  # run_step NAME LIMIT_S COMMAND...: run in the stage, log to OUT/NAME.log; status 1 on failure
  local name=$1 limit=$2
  shift 2
  echo "== $name ($((SECONDS - started)) s)"
  if ! (cd "$stage" && timeout "$limit" "$@") >"$out/$name.log" 2>&1; then
    echo "device_check: step '$name' failed (or ran past ${limit} s); last lines of $out/$name.log:" >&2
    tail -n 30 "$out/$name.log" >&2
    return 1
  fi
  tail -n 3 "$out/$name.log"
}
step() { run_step "$@" || exit 1; }                 # setup: nothing after it can run
soft_step() { run_step "$@" || failed+=("$1"); }    # a finding: record it, go on

# The sources, without this checkout's build outputs.
stage=$(mktemp -d "${TMPDIR:-/tmp}/kvcopy-device-check.XXXXXX")
trap 'rm -rf "$stage"' EXIT
tar --exclude='*.so' --exclude='__pycache__' --exclude='kvcopy/_build_config.py' -cf - \
  setup.py pyproject.toml README.md kvcopy csrc tests benchmarks | tar -xf - -C "$stage"
if [ -d "$wheelhouse" ]; then
  "$python" benchmarks/unpack_wheelhouse.py "$wheelhouse" "$stage/deps" >"$out/wheelhouse.log"
fi
export PYTHONPATH="$stage:$stage/deps${PYTHONPATH:+:$PYTHONPATH}"
export KVCOPY_PROFILE=none   # no profile from this machine's cache steers "auto"

missing=$("$python" - <<'PY'
import importlib.util
need = ["torch", "numpy", "setuptools", "pytest", "hypothesis"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
[ -z "$missing" ] || fail "missing Python packages: $missing; run benchmarks/fetch_wheelhouse.sh here and carry wheelhouse/"

has_gpu=$("$python" -c 'import torch; print(int(torch.cuda.is_available()))')
if [ "$has_gpu" = 1 ]; then
  arch=$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
  "$python" -c 'import torch; print(torch.cuda.get_device_name())' >"$out/gpu_name.txt"
elif [ "$dry_run" = 0 ]; then
  fail "no CUDA device visible; use --dry-run to walk the steps without one"
else
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # one arch, as on the GPU: half the compile time
fi
date -u +%Y-%m-%dT%H:%M:%SZ >"$out/date.txt"
# Plots need matplotlib; without it (and no wheelhouse) the check runs without them.
calib_plot=() plan_plot=() bench_plot=()
if "$python" -c 'import matplotlib' 2>/dev/null; then
  calib_plot=(--plot "$out/calib.png") plan_plot=(--plot "$out/plan.png") bench_plot=(--plot "$out/bench.png")
fi

gpu_test_files=(tests/test_gpu.py tests/test_engine_gpu.py tests/test_bench_gpu.py)
step build 240 env MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$python" setup.py build_ext --inplace
step staged 60 "$python" - "$stage" "$has_gpu" <<'PY'
import sys, kvcopy
stage, has_gpu = sys.argv[1], sys.argv[2] == "1"
assert kvcopy.__file__.startswith(stage), f"kvcopy imported from {kvcopy.__file__}, not the stage {stage}"
info = kvcopy.build_info()
assert not has_gpu or info["cuda_kernels"], f"a GPU is here but the CUDA kernels were not built: {info}"
print(kvcopy.__file__, "cuda_kernels:", info["cuda_kernels"], "archs:", info["cuda_archs"])
PY
step info 60 "$python" -m kvcopy info --json
# The default GPU bench set, trimmed to fit the check's minutes: 4 sizes, 5 counts, 5 repeats.
gpu_bench=(--repeats 5 --counts 1,16,256,1024,2048 --block-tokens 1,4,16,64)
if [ "$dry_run" = 1 ]; then
  step gpu_tests_collect 120 "$python" -m pytest -q -p no:cacheprovider --collect-only -m gpu "${gpu_test_files[@]}"
  step gpu_bench_points 30 "$python" -m kvcopy bench "${gpu_bench[@]}" --list
  calibrate=(--quick) bench=(--quick) sequential=(--quick) overlap=(--blocks 16 --rounds 1)
else
  # torch.compile tests last: inductor compiles take most of their time.
  soft_step gpu_tests 150 "$python" -m pytest -q -p no:cacheprovider -m gpu -k "not torch_compile" \
    "${gpu_test_files[@]}"
  calibrate=() sequential=() bench=("${gpu_bench[@]}") overlap=()
fi
rm -f "$out/profile.json"  # a reused OUT_DIR: never benchmark against an older run's profile
soft_step calibrate 120 "$python" -m kvcopy calibrate ${calibrate[@]+"${calibrate[@]}"} --no-progress \
  --out "$out/profile.json" ${calib_plot[@]+"${calib_plot[@]}"}
soft_step plan 30 "$python" -m kvcopy plan --model llama-3.1-8b --profile "$out/profile.json" \
  ${plan_plot[@]+"${plan_plot[@]}"}
predictions=()  # the bench reports the calibration's prediction errors when there is one
[ -f "$out/profile.json" ] && predictions=(--profile "$out/profile.json")
soft_step bench 180 "$python" -m kvcopy bench "${bench[@]}" --no-progress ${predictions[@]+"${predictions[@]}"} \
  --csv "$out/bench.csv" ${bench_plot[@]+"${bench_plot[@]}"}
# Adjacent ids: what merging runs into ranges buys over the unmerged batch.
soft_step bench_sequential 60 "$python" -m kvcopy bench ${sequential[@]+"${sequential[@]}"} --ids sequential \
  --no-sweeps --workload llama8b-16 --workload llama70b-tp4-16 --no-progress --csv "$out/bench_sequential.csv"
soft_step bench_overlap 60 "$python" benchmarks/bench_overlap.py ${overlap[@]+"${overlap[@]}"} \
  --csv "$out/bench_overlap.csv"
# transformers' continuous batching through kvcopy (optional: needs transformers from the wheelhouse).
if "$python" -c 'import transformers' 2>/dev/null; then
  if [ "$dry_run" = 1 ]; then
    engine=(--requests 8 --min-prompt 32 --max-prompt 64 --new-tokens 16)
  else
    soft_step transformers_tests 150 "$python" -m pytest -q -p no:cacheprovider -m gpu tests/test_transformers_offload.py
    engine=(--dtype bfloat16 --hidden 1024 --layers 8)
  fi
  soft_step bench_engine 180 "$python" benchmarks/bench_engine.py "${engine[@]}" --csv "$out/bench_engine.csv"
else
  echo "device_check: transformers is not installed here: the engine tests and bench_engine are skipped" >&2
fi
if [ "$dry_run" = 0 ]; then
  soft_step gpu_compile_tests 120 "$python" -m pytest -q -p no:cacheprovider -m gpu -k torch_compile \
    "${gpu_test_files[@]}"
fi
[ ${#failed[@]} = 0 ] || fail "failed steps: ${failed[*]} (logs in $out)"
echo "device_check: done in $((SECONDS - started)) s; results in $out"
