"""Cascades into a KVCopyDiskTier store that grows as it fills, against one made at its full size.

Since identities share ``bytes_to_use`` by use (kvcopy.integrations.vllm.tiers.stores), a tier's store starts
with no room and grows as cascades fill it: every extent (GROW_EXTENT_BYTES, at most 1/GROW_STEPS of its cap),
the tier's IO thread takes the path's lock, rewrites the store's header (two fsyncs) and fallocates the extent;
where the budget is held by another identity's store that no engine holds, it first makes that store give back
its least recently used chunks (their FREE records synced, their holes punched, its header rewritten). This
measures what that costs a cascade, on the disk under test, with the tier built as vLLM's SecondaryTierFactory
builds it and driven with the jobs vLLM's tiering manager makes (tests/helpers/disk_tier.py):

- ``full size``: the store backed to its whole cap before the first cascade (as stores were made before they
  grew: fallocate of the whole file when the tier opened), so no cascade grows it;
- ``growing``: a fresh path: the store grows from free room;
- ``growing, taking``: a path whose budget another identity's store fills (made first, untimed): every growth
  takes that store's least recently used chunks.

Each case cascades the whole budget (``--budget-mib``) in jobs of JOB_CHUNKS chunks of ``--chunk-kib`` bytes,
all submitted at once (a busy engine's backlog), into a fresh path; a row times from the first ``submit_store``
until ``drain_jobs`` returned (every job ended), and reports GB/s (chunks x bytes / seconds), the median (p20,
p80) over ``--rounds`` rounds, the cases in turn within each round (the order rotating, so a disk whose speed
drifts slows each alike), and the ratio of each median to ``full size``'s. ``decide ms`` is the time the IO
thread spent in the tier's room decisions (its lock, the other stores' headers, growing, taking), summed per
round (median), ``decisions`` and ``growths`` how many there were. The timer is perf_counter around events on
the tier's IO thread and around the whole backlog (not kvcopy.calibration.timing: each round is one fill of a
fresh store, not a repeatable call).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_disk_growth.py [--dir /path/on/the/disk] [--budget-mib 1024]
        [--chunk-kib 2048] [--rounds 5] [--csv out.csv] [--txt out.txt] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvcopy.calibration.machine import machine_identity
from kvcopy.storage.files import filesystem_of
from kvcopy.tools.bench.report import IDENTITY_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tier rig is a test helper (tests/helpers/disk_tier.py)

CASES = ("full size", "growing", "growing, taking")
JOB_CHUNKS = 8  # chunks per cascade job: a 128-token block's worth of a request at 16 tokens per chunk
PRIMARY_ROWS = 64  # rows of the primary tier the jobs read from, in turn (a put only reads them)
COLUMNS = ("case", "budget_bytes", "chunk_bytes", "chunks", "rounds", "gbps_median", "gbps_p20", "gbps_p80",
           "x_full_size", "decide_ms_median", "decisions", "growths")  # fmt: skip


def _rig() -> Any:
    for module, why in (("vllm", "vLLM (scripts/setup.sh installs it)"), ("nixl_cu13", "NIXL (kvcopy[nixl])")):
        try:
            __import__(module)
        except ImportError:
            raise SystemExit(f"bench_disk_growth: needs {why}") from None
    import helpers.disk_tier as rig

    return rig


rig = _rig()

from vllm.config import set_current_vllm_config  # noqa: E402  (after the check that vLLM is there)

from kvcopy.integrations.vllm.tiers import stores  # noqa: E402


def primary(chunk_bytes: int) -> SimpleNamespace:
    """PRIMARY_ROWS rows of random bytes, as vLLM's shared region gives a tier (an int8 view over an mmap)."""
    memory = mmap.mmap(-1, PRIMARY_ROWS * chunk_bytes)
    np.frombuffer(memory, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 256, len(memory), np.uint8)
    return SimpleNamespace(memory=memory, view=memoryview(memory).cast("b", (PRIMARY_ROWS, chunk_bytes)))


def make_tier(path: str, rows: SimpleNamespace, config: Any, budget: int, name: str) -> Any:
    with set_current_vllm_config(config):
        return rig.make_tier(rows, path=path, bytes_to_use=budget, cache_key_extra=name)


def cascade_all(tier: Any, chunks: int, salt: int) -> None:
    """Submits cascades of ``chunks`` new chunks in jobs of JOB_CHUNKS (rows read in turn), then waits for them."""
    for first in range(0, chunks, JOB_CHUNKS):
        count = min(JOB_CHUNKS, chunks - first)
        keys = [rig.key(salt * 1_000_000 + first + i) for i in range(count)]
        tier.submit_store(rig.job(keys, [(first + i) % PRIMARY_ROWS for i in range(count)], promotion=False))
    tier.drain_jobs()
    failed = [r.job_id for r in tier.get_finished_jobs() if not r.success]
    if failed:
        raise RuntimeError(f"bench_disk_growth: cascade jobs failed: {failed}")


class Decisions:
    """Counts and times the tier's room decisions (TierStore._decide) and the store's growths."""

    def __init__(self, tier: Any) -> None:
        self.seconds, self.count, self.growths = 0.0, 0, 0
        tier_store, store = tier._tier_store, tier.store
        decide, grow = tier_store._decide, store.grow

        def timed_decide(short: int) -> int:
            start = time.perf_counter()
            try:
                return decide(short)
            finally:
                self.seconds += time.perf_counter() - start
                self.count += 1

        def counted_grow(blocks: int) -> None:
            self.growths += 1
            grow(blocks)

        tier_store._decide = timed_decide
        store.grow = counted_grow


def one_case(case: str, directory: str, rows: SimpleNamespace, config: Any, budget: int, chunks: int) -> dict:
    path = tempfile.mkdtemp(prefix="growth-", dir=directory)
    try:
        if case == "growing, taking":  # another identity's store fills the budget, then closes
            other = make_tier(path, rows, config, budget, "other")
            try:
                cascade_all(other, chunks, salt=9)
            finally:
                other.shutdown()
        tier = make_tier(path, rows, config, budget, "measured")
        try:
            if case == "full size":
                tier.store.grow(tier._tier_store.cap - tier.store.room)  # as a store was made before it grew
            spied = Decisions(tier)
            start = time.perf_counter()
            cascade_all(tier, chunks, salt=1)
            seconds = time.perf_counter() - start
            assert tier.store.room == tier._tier_store.cap, (case, tier.store.room)
        finally:
            tier.shutdown()
        return {"seconds": seconds, "decide_s": spied.seconds, "decisions": spied.count, "growths": spied.growths}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk under test (default: a temporary one)")
    parser.add_argument("--budget-mib", type=int, default=1024, help="bytes_to_use, MiB: what each case cascades")
    parser.add_argument("--chunk-kib", type=int, default=2048, help="a chunk's bytes, KiB (2 MiB: Llama-3.1-8B bf16)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (each case once per round)")
    parser.add_argument("--csv", help="also write the rows here")
    parser.add_argument("--txt", help="also write the table here")
    parser.add_argument("--quick", action="store_true", help="32 MiB, one round: the structure, in seconds")
    args = parser.parse_args()
    if args.quick:
        args.budget_mib, args.rounds = 32, 1
    budget, chunk_bytes = args.budget_mib << 20, args.chunk_kib << 10
    chunks = budget // chunk_bytes
    directory = args.dir or tempfile.mkdtemp(prefix="kvcopy-bench-growth-", dir=os.getcwd())
    os.makedirs(directory, exist_ok=True)
    identity = machine_identity(torch.device("cpu"))
    filesystem = filesystem_of(directory)
    model = tempfile.mkdtemp(prefix="model-", dir=directory)
    config = rig.engine_config(rig.write_model_dir(model, 2))
    rows = primary(chunk_bytes)
    samples: dict[str, list[dict]] = {case: [] for case in CASES}
    try:
        for r in range(args.rounds):
            order = CASES[r % len(CASES) :] + CASES[: r % len(CASES)]
            for case in order:
                samples[case].append(one_case(case, directory, rows, config, budget, chunks))
    finally:  # also when a run fails or is interrupted: nothing is left in the checkout
        rows.view.release()
        rows.memory.close()
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            shutil.rmtree(model, ignore_errors=True)
    table = []
    for case in CASES:
        gbps = [chunks * chunk_bytes / s["seconds"] / 1e9 for s in samples[case]]
        quantiles = statistics.quantiles(gbps, n=5, method="inclusive") if len(gbps) > 1 else gbps * 4
        table.append(
            {
                "case": case,
                "budget_bytes": budget,
                "chunk_bytes": chunk_bytes,
                "chunks": chunks,
                "rounds": args.rounds,
                "gbps_median": statistics.median(gbps),
                "gbps_p20": quantiles[0],
                "gbps_p80": quantiles[3],
                "decide_ms_median": statistics.median(s["decide_s"] for s in samples[case]) * 1e3,
                "decisions": statistics.median(s["decisions"] for s in samples[case]),
                "growths": statistics.median(s["growths"] for s in samples[case]),
            }
        )
    for row in table:
        row["x_full_size"] = row["gbps_median"] / table[0]["gbps_median"]
    extent = max(1, min(stores.GROW_EXTENT_BYTES // chunk_bytes, chunks // stores.GROW_STEPS))
    lines = [
        f"KVCopyDiskTier cascades into a store that grows against one made at full size, on "
        f"{identity.get('host_cpu', identity.get('device_name'))}, {filesystem}, {identity.get('date')}",
        f"budget {args.budget_mib} MiB cascaded in jobs of {JOB_CHUNKS} chunks of {args.chunk_kib} KiB, all queued "
        f"at once, into a fresh path; the store grows by {extent} chunks ({extent * chunk_bytes >> 20} MiB) at a "
        f"time; median (p20-p80) of {args.rounds} rounds, the cases in turn",
        "",
        f"{'case':<18} {'GB/s':>7} {'p20':>7} {'p80':>7} {'x full size':>12} {'decide ms':>10} {'decisions':>10} "
        f"{'growths':>8}",
    ]
    for row in table:
        lines.append(
            f"{row['case']:<18} {row['gbps_median']:>7.3f} {row['gbps_p20']:>7.3f} {row['gbps_p80']:>7.3f} "
            f"{row['x_full_size']:>12.3f} {row['decide_ms_median']:>10.1f} {row['decisions']:>10.0f} "
            f"{row['growths']:>8.0f}"
        )
    print("\n".join(lines))
    if args.txt:
        Path(args.txt).write_text("\n".join(lines) + "\n")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*IDENTITY_COLUMNS, "filesystem", *COLUMNS])
            writer.writeheader()
            for row in table:
                writer.writerow({**{k: identity.get(k, "") for k in IDENTITY_COLUMNS}, "filesystem": filesystem, **row})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
