#!/usr/bin/env bash
# Runs the README's test command (scripts/test.sh) beside a CPU and memory-bandwidth hog, to show that no test
# needs an idle machine: a test's timeouts catch hangs, never a slow machine (tests/helpers/__init__.py,
# HANG_TIMEOUT_S).
#
#   bash scripts/stress_test.sh [pytest arguments]
#   KVCOPY_STRESS_BUSY=N        busy-looping processes (default: one per core)
#   KVCOPY_STRESS_COPY_MIB=M    the memory hog copies a buffer of M MiB over another, forever (default 256:
#                               far above any last-level cache, so every copy goes to DRAM)
set -uo pipefail
cd "$(dirname "$0")/.."

busy=${KVCOPY_STRESS_BUSY:-$(nproc)}
copy_mib=${KVCOPY_STRESS_COPY_MIB:-256}
hogs=()
stop_hogs() {
  [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2>/dev/null
  wait "${hogs[@]}" 2>/dev/null
}
trap stop_hogs EXIT
for _ in $(seq "$busy"); do
  python3 -c 'while True: pass' &
  hogs+=($!)
done
python3 -c "
a, b = bytearray($copy_mib << 20), bytearray($copy_mib << 20)
while True:
    b[:] = a  # one memcpy of the whole buffer
" &
hogs+=($!)

echo "stress_test: $busy busy processes and a ${copy_mib} MiB memcpy loop beside scripts/test.sh on $(nproc) cores"
started=$SECONDS
bash scripts/test.sh "$@"
status=$?
echo "stress_test: exit $status after $(( SECONDS - started )) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
exit $status
