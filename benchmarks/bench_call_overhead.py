"""The fixed cost of one kvcopy call, side by side with the copy a user would write instead.

A 1-block, 1-plane gather of 32 KiB (CPU tensors, int64 id tensors) against one torch ``copy_`` of the
same 32 KiB, on hot memory (the same block every call), so what differs is the call itself: validation,
method choice and dispatch. Timed for ``method="cpu"`` and for ``method="auto"`` with a profile (as every
user has after ``kvcopy calibrate``), in interleaved rounds whose best is kept (a busy machine slows some
rounds, not the code). Prints microseconds per call and the ratio to the bare ``copy_``; the target is
at most 2x for both. ``kvcopy bench``'s fixed_cost suite measures the same on cold memory.

    .venv/bin/python benchmarks/bench_call_overhead.py [--rounds 7] [--calls 3000] [--profile results/profile_cpu.json]
        [--out results/call_overhead_cpu.txt]
"""

from __future__ import annotations

import argparse

import torch

import kvcopy
from kvcopy.calibration.machine import machine_identity
from kvcopy.calibration.timing import interleaved

PLANE_BLOCK_BYTES = 32 * 1024
CACHE_BLOCKS = 8
TARGET_RATIO = 2.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument(
        "--profile",
        default="results/profile_cpu.json",
        help="the calibrated profile 'auto' consults (default: the CPU VM's, results/)",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    kv = kvcopy.PagedKV([torch.randint(0, 255, (CACHE_BLOCKS, PLANE_BLOCK_BYTES), dtype=torch.uint8)])
    host = kvcopy.HostKVPool(kv, CACHE_BLOCKS, pin_memory=False)
    block_ids, host_ids = torch.tensor([3]), torch.tensor([5])
    src_row, dst_row = kv.planes[0][3], host.paged.planes[0][5]
    kvcopy.set_default_profile(kvcopy.Profile.load(args.profile))
    calls = {
        "torch copy_ (bare)": lambda: dst_row.copy_(src_row),
        'kvcopy.gather method="cpu"': lambda: kvcopy.gather(kv, block_ids, host, host_ids, method="cpu"),
        'kvcopy.gather method="auto" + profile': lambda: kvcopy.gather(kv, block_ids, host, host_ids),
    }
    # Each round: per call, a tenth of --calls untimed, then --calls timed; the best round is kept.
    samples = interleaved(calls, args.rounds, warmup=args.calls // 10, inner=args.calls)
    best = {name: min(seconds) * 1e6 for name, seconds in samples.items()}
    torch.testing.assert_close(host.paged.planes[0][5], kv.planes[0][3], rtol=0, atol=0)
    identity = machine_identity(torch.device("cpu"))
    bare = best["torch copy_ (bare)"]
    lines = [
        f"kvcopy call overhead on {identity.get('device_name')} ({identity.get('host_cores')} cores, 1 torch thread), "
        f"{identity.get('date')}",
        f"1 block x 1 plane of {PLANE_BLOCK_BYTES // 1024} KiB, int64 id tensors, hot memory; best of {args.rounds} "
        f"rounds of {args.calls} calls; target: at most {TARGET_RATIO:g}x the bare copy_",
    ]
    for name, us in best.items():
        lines.append(f"  {name:<40} {us:6.2f} us   {us / bare:4.1f}x")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
