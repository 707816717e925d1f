#!/usr/bin/env bash
# One prepared check for a lent GPU machine (docs/measurements.md says what it checks):
#   bash benchmarks/device_check.sh OUT_DIR              on a GPU: build for its arch, run the GPU tests,
#                                                        calibrate, plan, benchmark, and write it all to OUT_DIR
#   bash benchmarks/device_check.sh --dry-run [OUT_DIR]  walk every step the CPU can, at smoke-test sizes
#
# The GPU machine (python3.12, torch with CUDA, nvcc, no network) may lack
# pytest, numpy, xxhash, transformers or setuptools: carry a wheelhouse made by
# benchmarks/fetch_wheelhouse.sh (run(..., carry=["wheelhouse"])) and the
# distributions missing there are unpacked into the stage, ninja's binary onto
# PATH (without it torch builds one file at a time); matplotlib is not carried:
# the plots are made where it is installed. Everything runs
# from a staged copy of the sources, built in place there, so the checkout's
# own build (and a test suite that imported it) is never overwritten.
# A preflight fails in seconds when the machine cannot do the check (nvcc's
# CUDA major version against torch's, Python.h, a visible GPU, free disk).
# Each step logs to OUT_DIR/NAME.log, and OUT_DIR/summary.txt gets a line as
# each step ends, so whatever ran survives a kill. A failed setup or build step
# stops the check at once with its last lines; a failed test, calibration or
# benchmark step is reported the same way but the later steps still run (a lent
# GPU is scarce), and the check exits 1 at the end. A path the check cannot
# reach on this machine gets a line "WHAT: not checked (WHY)" in summary.txt
# (NIXL, hence GDS and GPU memory between peers; vLLM; transformers), and an
# optional package that is here but does not import is a failed step, never a
# silent skip.
#
# Time: one deadline for the whole check (KVCOPY_CHECK_DEADLINE, default 400 s)
# from which every step's limit is taken: a step gets its own cap or what is
# left, whichever is less; a benchmark that cannot have its cap runs a shorter
# variant, and a step with under MIN_STEP_S left is skipped (and said so).
# Steps run in order of value: build, GPU correctness tests (test_copy_gpu.py
# and test_engine_gpu.py in separate processes, so a broken CUDA context in one
# cannot fail the other), calibrate, plan, bench, overlap, then what no GPU run
# has finished yet (torch.compile tests, the engine benchmark, transformers'
# GPU tests, those that never finished first), and last what passed on the
# first GPU run (2026-12-04: the bench's sequential ids and its tools' tests).
# Timed on an H200 (16 cores) that day: setup and build 60 s, GPU tests 38 s,
# engine tests 20 s, calibrate 32 s, plan 10 s, the quick bench 23 s (the full
# one about 110 s), overlap 12 s, transformers' GPU tests 9 of 12 in 61 s.
# pytest is stopped with SIGINT at its limit, so it still prints its summary
# (up to PYTEST_GRACE_S later), and writes OUT_DIR/NAME.xml (JUnit). The bench
# writes each point to its CSV as it ends. --dry-run multiplies every cap by
# DRY_RUN_SLOWDOWN: a 2-core machine that is also busy is several times slower.
# --dry-run without a GPU builds the CPU kernels only (KVCOPY_NO_CUDA=1,
# setup.py): no step after the build can run a CUDA kernel without a GPU, and
# scripts/setup.sh compiles them in CI already. On the shared 2-core VM (load
# average 4-5, 2026-12-04) the staged build took 121 s with them, 32 s without.
# KVCOPY_NO_CUDA=0 builds them in the dry run too.
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
# Seconds for the whole check: a session's lent GPU has 15 minutes of device time in all, the machine's start
# (minutes), the transfers and a last pytest step's grace after its limit included.
deadline=${KVCOPY_CHECK_DEADLINE:-400}
[ "$dry_run" = 1 ] && deadline=${KVCOPY_CHECK_DEADLINE:-1100}  # the CI machine may be slow and busy
: >"$out/summary.txt"
# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh

# The sources, without this checkout's build outputs (the extension and setup.py's record of what it
# built: a stale record would claim CUDA kernels that the staged build did not make), with LICENSE, which
# pyproject.toml's license-files names (setuptools warns without it, and will refuse).
stage=$(mktemp -d "${TMPDIR:-/tmp}/kvcopy-device-check.XXXXXX")
trap 'rm -rf "$stage"' EXIT
tar --exclude='*.so' --exclude='__pycache__' --exclude='kvcopy/_build_config.json' -cf - \
  setup.py pyproject.toml README.md LICENSE kvcopy csrc tests benchmarks | tar -xf - -C "$stage"
if [ -d "$wheelhouse" ]; then
  "$python" benchmarks/unpack_wheelhouse.py "$wheelhouse" "$stage/deps" >"$out/wheelhouse.log" 2>&1 ||
    fail "unpacking $wheelhouse failed; see $out/wheelhouse.log"
fi
export PYTHONPATH="$stage:$stage/deps${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$stage/deps/bin:$PATH"  # the wheelhouse's ninja, where this machine has none
if ninja=$(command -v ninja); then
  echo "device_check: ninja: $ninja"
else
  echo "device_check: no ninja on PATH: the build compiles one file at a time and may run past its cap" >&2
fi
export KVCOPY_PROFILE=none   # no profile from this machine's cache steers "auto"

missing=$("$python" - <<'PY'
import importlib.util
need = ["torch", "numpy", "setuptools", "pytest", "hypothesis", "xxhash"]  # xxhash: kvcopy.storage
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
) || fail "could not run $python to look for the packages the check needs"
[ -z "$missing" ] || fail "missing Python packages: $missing; run benchmarks/fetch_wheelhouse.sh here and carry wheelhouse/"

# Preflight: what would make the build or the GPU steps fail minutes in, found in seconds.
preflight=$("$python" - "$dry_run" "$stage" <<'PY'
import importlib.util, os, re, shutil, subprocess, sys, sysconfig
dry_run, stage = sys.argv[1] == "1", sys.argv[2]
problems = []
if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
    problems.append(f"no Python.h under {sysconfig.get_paths()['include']} (install the Python headers)")
free = shutil.disk_usage(stage).free
if free < 2 << 30:
    problems.append(f"only {free / 2**30:.1f} GiB free where the check builds ({stage}); it needs 2")
import torch
nvcc = shutil.which("nvcc")
if torch.version.cuda and nvcc:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+)\.", out)
    if found and found.group(1) != torch.version.cuda.split(".")[0]:
        problems.append(f"nvcc is CUDA {found.group(1)}, torch was built with CUDA {torch.version.cuda}: "
                        "the extension would not load")
if not dry_run and not torch.cuda.is_available():
    problems.append("no CUDA device visible (use --dry-run to walk the steps without one)")
print("; ".join(problems))
PY
) || fail "preflight: the check itself failed (is torch importable by $python?)"
[ -z "$preflight" ] || fail "preflight: $preflight"
echo "preflight ok" >>"$out/summary.txt"

has_gpu=$("$python" -c 'import torch; print(int(torch.cuda.is_available()))') || fail "torch.cuda.is_available() failed"
if [ "$has_gpu" = 1 ]; then
  arch=$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())') ||
    fail "could not read the GPU's compute capability"
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

no_cuda=0
[ "$dry_run" = 1 ] && [ "$has_gpu" = 0 ] && no_cuda=${KVCOPY_NO_CUDA:-1}
step build 240 env MAX_JOBS="${MAX_JOBS:-$(nproc)}" KVCOPY_NO_CUDA="$no_cuda" "$python" setup.py build_ext --inplace
step staged 60 "$python" - "$stage" "$has_gpu" <<'PY'
import sys, kvcopy
stage, has_gpu = sys.argv[1], sys.argv[2] == "1"
assert kvcopy.__file__.startswith(stage), f"kvcopy imported from {kvcopy.__file__}, not the stage {stage}"
info = kvcopy.build_info()
assert not has_gpu or info["cuda_kernels"], f"a GPU is here but the CUDA kernels were not built: {info}"
print(kvcopy.__file__, "cuda_kernels:", info["cuda_kernels"], "archs:", info["cuda_archs"])
PY
step info 60 "$python" -m kvcopy info --json
# Present means imports: a transformers that is found but does not import is a failed step (its tests would
# skip the whole file and bench_engine would fail), not a quiet skip.
has_transformers=0
if import_step transformers_import transformers; then
  has_transformers=1
elif [[ " ${failed[*]} " != *" transformers_import "* ]]; then
  not_checked "transformers engine paths (transformers_gpu_tests, bench_engine)" "no transformers on this machine"
fi
# The default GPU bench set, trimmed to fit the check's minutes: 4 sizes, 5 counts, 5 repeats.
gpu_bench=(--repeats 5 --counts 1,16,256,1024,2048 --block-tokens 1,4,16,64)
if [ "$dry_run" = 1 ]; then
  step gpu_tests_collect 60 "$python" -m pytest -q -p no:cacheprovider --collect-only -m gpu \
    tests/core/test_copy_gpu.py tests/engine/test_engine_gpu.py tests/tools/test_bench_gpu.py tests/integrations/test_transformers_offload.py
  step gpu_bench_points 20 "$python" -m kvcopy bench "${gpu_bench[@]}" --list
  calibrate=(--quick) bench=(--quick) overlap=(--blocks 16 --rounds 1)
  engine=(--requests 8 --min-prompt 32 --max-prompt 64 --new-tokens 16 --hidden 128 --layers 2)
else
  # Correctness first, each file in its own process; torch.compile tests after the benchmarks (inductor
  # compiles are slow).
  # -rs: why each skipped test skipped (the first run's log counted 10 in gpu_tests, without saying why).
  pytest_step gpu_tests 120 -rs -m gpu -k "not torch_compile" tests/core/test_copy_gpu.py
  pytest_step engine_gpu_tests 90 -rs -m gpu -k "not torch_compile" tests/engine/test_engine_gpu.py \
    tests/integrations/test_vllm_gpu.py
  calibrate=() bench=("${gpu_bench[@]}") overlap=()
  engine=(--dtype bfloat16 --hidden 1024 --layers 8)
fi
rm -f "$out/profile.json"  # a reused OUT_DIR: never benchmark against an older run's profile
shortened 90 && calibrate=(--quick)
soft_step calibrate 90 "$python" -m kvcopy calibrate ${calibrate[@]+"${calibrate[@]}"} --no-progress \
  --out "$out/profile.json" ${calib_plot[@]+"${calib_plot[@]}"}
soft_step plan 20 "$python" -m kvcopy plan --model llama-3.1-8b --profile "$out/profile.json" \
  ${plan_plot[@]+"${plan_plot[@]}"}
predictions=()  # the bench reports the calibration's prediction errors when there is one
[ -f "$out/profile.json" ] && predictions=(--profile "$out/profile.json")
# The full bench (about 110 s on the H200) only when it leaves the steps after it their time: within the
# default deadline the quick one runs (the full one's tables are in results/gpu_h200_2026-12-04/bench_run1.log).
AFTER_BENCH_S=240  # the torch.compile tests, the engine benchmark and transformers' tests, at least
shortened $((150 + AFTER_BENCH_S)) && bench=(--quick)
soft_step bench 150 "$python" -m kvcopy bench "${bench[@]}" --no-progress ${predictions[@]+"${predictions[@]}"} \
  --csv "$out/bench.csv" ${bench_plot[@]+"${bench_plot[@]}"}
shortened 45 && overlap=(--blocks 32 --rounds 1)
soft_step bench_overlap 45 "$python" benchmarks/bench_overlap.py ${overlap[@]+"${overlap[@]}"} \
  --csv "$out/bench_overlap.csv"
# Never finished on a GPU before: inductor compiles are slow, so its own cap.
[ "$dry_run" = 0 ] && pytest_step gpu_compile_tests 100 -m gpu -k torch_compile tests/core/test_copy_gpu.py \
  tests/engine/test_engine_gpu.py
# transformers' GPU tests took about 6 s each on the H200 (9 of 12 in 61 s, then the cap): 120 s holds all 12.
TRANSFORMERS_TESTS_S=120
if [ "$has_transformers" = 1 ]; then
  # The smaller engine benchmark unless the transformers tests after it keep their time (not in a dry run,
  # whose own sizes are smaller still).
  [ "$dry_run" = 0 ] && shortened $((120 + TRANSFORMERS_TESTS_S)) && engine+=(--requests 16 --max-prompt 512)
  soft_step bench_engine 120 "$python" benchmarks/bench_engine.py "${engine[@]}" --csv "$out/bench_engine.csv"
  # In this order: those that never finished on a GPU first (on 2026-12-04 the cap came during the bf16 one),
  # the fp32 ones that passed there last. -v and the durations say which test a cap cut, and how long each
  # took; a test past 40 s has every thread's stack dumped, so a hang shows where it waits.
  transformers_tests=tests/integrations/test_transformers_offload.py
  [ "$dry_run" = 0 ] && pytest_step transformers_gpu_tests "$TRANSFORMERS_TESTS_S" -v --durations=0 \
    -o faulthandler_timeout=40 -m gpu "$transformers_tests::test_slow_offload_copies_keep_tokens_identical" \
    "$transformers_tests::test_bf16_offload_matches_transformers_own_offload_and_reloads_bitwise" \
    "$transformers_tests::test_fp32_tokens_identical_to_never_preempted"
fi
# GPU memory over NIXL between two agents and two processes, and the disk store through GPUDirect Storage,
# where NIXL is installed (kvcopy[nixl]). Its wheel does not fit in what a run to a lent GPU may carry.
if ! "$python" -c 'import nixl_cu13' 2>/dev/null; then
  not_checked "GDS and remote GPU paths" "no NIXL on this machine"
elif [ "$dry_run" = 1 ]; then
  not_checked "GDS and remote GPU paths" "dry run"
else
  pytest_step remote_gpu_tests 60 -m gpu tests/remote/test_remote.py
  # GDS tests skip, saying why, where cuFile will not start: see storage_gds_tests.log.
  pytest_step storage_gds_tests 45 -m gpu tests/storage/test_storage_gds.py
  soft_step bench_remote_gpu 60 "$python" benchmarks/bench_remote.py --memory gpu --csv "$out/bench_remote_gpu.csv"
fi
# vLLM's wheel cannot travel to a lent GPU either: tests/integrations/test_vllm_gpu.py skips without it.
"$python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)' 2>/dev/null ||
  not_checked "vLLM on a GPU (test_vllm_gpu.py: kvcopy's spec, and KVCopyDiskTier under vLLM's tiering)" \
    "no vLLM on this machine"
# Last: what passed on the H200 on 2026-12-04. Adjacent ids: what merging runs into ranges buys over the
# unmerged batch (on the H200, nothing: in a page-first pool a block's planes are adjacent, a plane's blocks not).
[ "$dry_run" = 0 ] && pytest_step bench_gpu_tests 45 -m gpu tests/tools/test_bench_gpu.py
soft_step bench_sequential 40 "$python" -m kvcopy bench --quick --ids sequential --no-sweeps --workload llama8b-16 \
  --workload llama70b-tp4-16 --no-progress --csv "$out/bench_sequential.csv"
[ ${#skipped[@]} = 0 ] || echo "device_check: skipped for the deadline: ${skipped[*]}" >&2
[ ${#failed[@]} = 0 ] || fail "failed steps: ${failed[*]} (logs in $out)"
echo "done in $((SECONDS - started)) s" >>"$out/summary.txt"
echo "device_check: done in $((SECONDS - started)) s; results in $out"
