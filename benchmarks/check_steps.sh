# Steps of benchmarks/device_check.sh under one deadline; sourced by it (and by the tests).
#
# Uses the caller's: out (results folder, with summary.txt), stage (where steps
# run), python, dry_run (0/1), started (bash $SECONDS at the start) and
# deadline (seconds for the whole check).
MIN_STEP_S=15                            # a step with less than this left is skipped, not started
DRY_RUN_SLOWDOWN=5                       # --dry-run caps are this many times the GPU run's
PYTEST_GRACE_S=20                        # after SIGINT, pytest gets this long to print its summary
IMPORT_CAP_S=60                          # importing transformers takes seconds; a cold disk, more

fail() {
  echo "device_check: $*" >&2
  echo "stopped: $*" >>"$out/summary.txt"
  exit 1
}

failed=()
skipped=()
limit=0
budget() {  # budget CAP_S: sets `limit` to the step's seconds (its cap, or what is left); status 1: skip it
  local cap=$1 left=$((deadline - (SECONDS - started)))
  [ "$dry_run" = 1 ] && cap=$((cap * DRY_RUN_SLOWDOWN))
  limit=$((cap < left ? cap : left))
  [ "$limit" -ge "$MIN_STEP_S" ]
}
shortened() {  # shortened CAP_S: true when the step cannot have its whole cap
  local cap=$1
  [ "$dry_run" = 1 ] && cap=$((cap * DRY_RUN_SLOWDOWN))
  [ $((deadline - (SECONDS - started))) -lt "$cap" ]
}
run_step() {  # run_step NAME CAP_S COMMAND...: run in the stage within its budget, log to OUT/NAME.log
  local name=$1 cap=$2 status=0
  shift 2
  if ! budget "$cap"; then
    echo "== $name skipped: $((deadline - (SECONDS - started))) s left of the ${deadline} s deadline" >&2
    echo "$name skipped (deadline)" >>"$out/summary.txt"
    skipped+=("$name")
    return 0
  fi
  echo "== $name ($((SECONDS - started)) s, limit ${limit} s)"
  local begun=$SECONDS
  # SIGINT first (pytest prints its summary on it), SIGKILL if it is still there after the grace period.
  (cd "$stage" && timeout --signal=INT --kill-after="$PYTEST_GRACE_S" "$limit" "$@") >"$out/$name.log" 2>&1 ||
    status=$?
  echo "$name $([ "$status" = 0 ] && echo ok || echo "failed (exit $status)") in $((SECONDS - begun)) s" \
    >>"$out/summary.txt"
  if [ "$status" != 0 ]; then
    echo "device_check: step '$name' failed (exit $status; 124 or 137: ran past ${limit} s); last lines of" \
      "$out/$name.log:" >&2
    tail -n 30 "$out/$name.log" >&2
    return 1
  fi
  tail -n 3 "$out/$name.log"
}
step() { run_step "$@" || exit 1; }                 # setup: nothing after it can run
soft_step() { run_step "$@" || failed+=("$1"); }    # a finding: record it, go on
pytest_step() {  # pytest_step NAME CAP_S PYTEST_ARGS...: a soft step with a JUnit report beside its log
  local name=$1 cap=$2
  shift 2
  soft_step "$name" "$cap" "$python" -m pytest -q -p no:cacheprovider --junitxml "$out/$name.xml" "$@"
}
not_checked() {  # not_checked WHAT WHY: say in summary.txt (and on stderr) that a path was not checked, and why
  echo "$1: not checked ($2)" >>"$out/summary.txt"
  echo "device_check: $1: not checked ($2)" >&2
}
import_step() {  # import_step NAME MODULE: true when MODULE imports, as step NAME (its log says from where)
  # False when MODULE is not here. A module that is here but does not import (a wheel for another Python, a
  # missing dependency) is a failed step, not an absent one: its tests would skip and hide it.
  local name=$1 module=$2
  "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)' "$module" \
    2>/dev/null || return 1
  if ! run_step "$name" "$IMPORT_CAP_S" "$python" -c \
    'import importlib, sys; m = importlib.import_module(sys.argv[1]); print(m.__name__, getattr(m, "__version__", "?"), "from", m.__file__)' \
    "$module"; then
    failed+=("$name")
    return 1
  fi
  case " ${skipped[*]} " in *" $name "*) return 1 ;; esac  # not run for the deadline: not known to import
}
