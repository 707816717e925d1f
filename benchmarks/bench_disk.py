"""KV blocks to and from a local disk: kvcopy's DiskKVStore against what a caller would otherwise write.

A page-first HostKVPool of PLANES planes and a DiskKVStore laid out like it, in a directory on the disk under
test, its data file written through once before anything is timed (a store in service, whose slots have all
been used: a fresh store's first writes also convert fallocate's unwritten extents, which every later write of
that slot does not pay). For each plane-block size, one call puts (writes) or gets (reads) BLOCKS blocks at
random pool ids:
- ``kvcopy``: DiskKVStore.put / get: one NIXL POSIX transfer whose descriptors kvcopy's range planner merged
  (adjacent slots and pool ids), with what makes it safe: the XXH3 checksum of every block, the data's fsync
  and the index commit for a put, the checksum check for a get;
- ``kvcopy, verify=False``: the same get without its checksum check, so the check's cost shows;
- ``per-block pwrite/pread``: os.pwrite / os.pread of each block at its slot, on the data file opened as the
  store opens it (O_DIRECT where it can), then one fsync for writes;
- ``per-block, 8 threads``: the same calls from THREADS threads, so the disk sees several requests at once;
- ``contiguous (limit)``: one os.pwrite / os.pread of the same bytes as a single range (fsync for writes);
- ``contiguous, 4 KiB pages``: the same, into or from a buffer of 4 KiB pages (an anonymous mapping, as a
  caller's own buffer would be, under the common THP mode "madvise"; "always" gives it huge pages too), where
  the pool's memory asks for transparent huge pages.
Op ``read`` reads a put's blocks back in the order it wrote them (a prefix resumed: the store gave it adjacent
slots); ``read-random`` reads the same blocks in a random order (each still into its own pool block), which on
a disk is a random read per block. Reads are cold: through O_DIRECT when the block size allows (the store
says whether it could), else after dropping the file's pages. ``--queues`` also runs kvcopy's put and get
under each NIXL POSIX queue (io_uring, Linux AIO, POSIX AIO) the machine accepts, a store of its own each.
Every method is timed in the same rounds, in turn (a cloud disk's speed drifts from minute to minute: timed
one after the other, the later methods looked up to 1.6x slower). Each row: the median of REPEATS calls,
GB/s and the ratio to the limit, with the machine's identity and the filesystem.

    .venv/bin/python benchmarks/bench_disk.py --dir /path/on/the/disk [--sizes 2,8,32,128] [--blocks 64]
                                              [--repeats 5] [--queues] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import mmap
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import kvcopy
from kvcopy.calibration.machine import machine_identity
from kvcopy.calibration.timing import interleaved
from kvcopy.storage import DiskKVStore
from kvcopy.storage import files as _disk_file
from kvcopy.storage.files import filesystem_of
from kvcopy.tools.bench import IDENTITY_COLUMNS

PLANES = 8  # planes per block: a page-first block is one region of PLANES plane-blocks
READS = ("read", "read-random")  # a put's blocks read back in its order, and in a random one
THREADS = 8  # the threaded per-block loop: as many requests in flight as a small io_uring queue would keep
THREADED = f"per-block, {THREADS} threads"
# the limit's read or write, into or from memory of 4 KiB pages: a pool's memory asks for huge pages, which a DMA
# meets as 2 MiB physically contiguous runs (kvcopy.host.memory._ask_for_huge_pages)
SMALL_PAGES = "contiguous, 4 KiB pages"
UNVERIFIED = "kvcopy, verify=False"  # a get without its checksum check (DiskKVStore.get's verify)
COLUMNS = (
    "op",
    "method",
    "queue",
    "plane_block_bytes",
    "num_blocks",
    "bytes",
    "descriptors",
    "median_s",
    "gbps",
    "x_limit",
)


def _hashes(n: int, salt: int) -> list[str]:
    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def _by_round(body: Callable[[int], object]) -> Callable[[], object]:
    """``body`` called with its round's index: timing.interleaved calls each body once a round, so its k-th call
    is round k."""
    rounds = itertools.count()
    return lambda: body(next(rounds))


def _store(directory: str, pool: kvcopy.HostKVPool, num_blocks: int, queue: str | None) -> DiskKVStore:
    """A store under NIXL POSIX's ``queue`` (None: the one "auto" picks), its data file written through once."""
    key = kvcopy.CacheKey(kvcopy.ModelSpec.preset("llama-3.1-8b"), weights_id="bench", block_tokens=16)
    path = os.path.join(directory, f"store-{pool.nbytes_per_block}-{queue or 'auto'}")
    shutil.rmtree(path, ignore_errors=True)
    saved = _disk_file.POSIX_QUEUES
    if queue is not None:
        _disk_file.POSIX_QUEUES = (queue,)  # this store's queue only
    try:
        store = DiskKVStore.create(path, pool, num_blocks, cache_key=key)
    finally:
        _disk_file.POSIX_QUEUES = saved
    _disk_file.fill_with_zeros(path)
    return store


def _stores(directory: str, pool: kvcopy.HostKVPool, num_blocks: int, queues: bool) -> dict[str, DiskKVStore]:
    """By queue label: the "auto" store, and with ``queues`` one per NIXL POSIX queue this machine accepts."""
    stores = {"auto": _store(directory, pool, num_blocks, None)}
    for queue in _disk_file.POSIX_QUEUES if queues else ():
        try:
            stores[queue] = _store(directory, pool, num_blocks, queue)
        except RuntimeError as err:  # this kernel or NIXL build refuses the queue
            print(f"queue {queue}: not available here ({err})")
    return stores


def _measure(directory: str, plane_bytes: int, blocks: int, repeats: int, queues: bool) -> list[dict]:
    like = kvcopy.PagedKV.from_planes([torch.empty(1, plane_bytes, dtype=torch.uint8) for _ in range(PLANES)])
    pool = kvcopy.HostKVPool(like, 2 * blocks, pin_memory=False)
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), dtype=torch.uint8))
    stores = _stores(directory, pool, blocks * (repeats + 1), queues)
    auto = stores["auto"]
    fd, direct = _disk_file.open_data(auto.path, pool.nbytes_per_block)  # opened as the store opens it
    gen = torch.Generator().manual_seed(plane_bytes)
    block = pool.nbytes_per_block
    nbytes = blocks * block
    view = pool.buffer.numpy()
    ids = [torch.randperm(2 * blocks, generator=gen)[:blocks] for _ in range(repeats)]
    shuffles = [torch.randperm(blocks, generator=gen).tolist() for _ in range(repeats)]
    hashes = [_hashes(blocks, salt=i) for i in range(repeats)]  # put i's blocks
    slots: dict[str, list[list[int]]] = {label: [] for label in stores}  # per store and put, the slots it filled
    descriptors: dict = {}

    def order(label: str, op: str, i: int) -> tuple[list[int], list[int]]:
        """(store slots, pool ids) of get ``i``: in the order put ``i`` wrote them, or shuffled alike."""
        mine, pool_ids = slots[label][i], ids[i].tolist()
        if op in ("write", "read"):
            return mine, pool_ids
        return [mine[j] for j in shuffles[i]], [pool_ids[j] for j in shuffles[i]]

    def kvcopy_call(label: str, op: str, verify: bool = True):
        store = stores[label]

        def body(i: int) -> None:
            if op == "write":
                transfer = store.put(hashes[i], pool, ids[i])
                transfer.wait()
            else:
                store.drop_page_cache()
                store_slots, pool_ids = order(label, op, i)
                transfer = store.get(store_slots, pool, pool_ids, verify=verify)  # each into its own pool block
                transfer.wait()
            descriptors[(op, label)] = transfer.num_descriptors

        return body

    def record_slots(label: str):
        """Untimed, after put ``i``: the slots it filled, for the gets and the loops that follow."""
        return lambda i: slots[label].append(stores[label].match(hashes[i]))

    def per_block(op: str, threads: ThreadPoolExecutor | None = None):
        def one(slot: int, pool_id: int) -> None:
            chunk = view[pool_id * block : (pool_id + 1) * block]
            if op == "write":
                os.pwrite(fd, chunk, slot * block)  # the bytes the store's put wrote there: it stays valid
            else:
                os.preadv(fd, [chunk], slot * block)

        def body(i: int) -> None:
            if op != "write" and not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            pairs = order("auto", op, i)
            if threads is None:
                for slot, pool_id in zip(*pairs, strict=True):
                    one(slot, pool_id)
            else:  # os.pread/pwrite release the GIL: the disk sees THREADS requests at once
                list(threads.map(one, *pairs))
            if op == "write":
                os.fsync(fd)

        return body

    spare = repeats * nbytes  # the store's last `blocks` slots, which no put fills (puts take free slots in order)

    def contiguous(op: str, memory: memoryview | np.ndarray = view):
        def body(i: int) -> None:
            if op == "write":
                os.pwrite(fd, memory[:nbytes], spare)
                os.fsync(fd)
                return
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.preadv(fd, [memory[:nbytes]], spare)

        return body

    small_pages = mmap.mmap(-1, nbytes)  # 4 KiB pages, the memory a caller's own buffer has (freed with it)
    small_pages.write(view[:nbytes].tobytes())

    expected = pool.buffer.clone()
    measured: dict = {}
    with ThreadPoolExecutor(THREADS) as threads:
        for op in ("write", *READS):  # the writes first: the reads read what they wrote
            bodies = {("kvcopy", label): kvcopy_call(label, op) for label in stores}
            if op != "write":  # the same get without its checksum check: what the check costs
                bodies[(UNVERIFIED, "auto")] = kvcopy_call("auto", op, verify=False)
            bodies[("per-block pwrite/pread", "")] = per_block(op)
            bodies[(THREADED, "")] = per_block(op, threads)
            bodies[("contiguous (limit)", "")] = contiguous(op)
            bodies[(SMALL_PAGES, "")] = contiguous(op, memoryview(small_pages))
            after = {("kvcopy", label): record_slots(label) for label in stores} if op == "write" else None
            # Every method in the same rounds, in turn: a disk whose speed drifts (a cloud disk's burst credits)
            # slows every method alike.
            samples = interleaved(
                {key: _by_round(body) for key, body in bodies.items()},
                repeats,
                after={key: _by_round(work) for key, work in after.items()} if after else None,
            )
            measured.update({(op, *key): statistics.median(seconds) for key, seconds in samples.items()})
            descriptors[(op, "")] = blocks
    for label in stores:
        for op in READS:
            for i in range(repeats):  # untimed: what each get brings back is what its put wrote, bitwise
                for pool_id in ids[i].tolist():
                    pool.block_bytes(pool_id).zero_()
                kvcopy_call(label, op)(i)
                if not torch.equal(pool.buffer, expected):
                    raise SystemExit(f"bench_disk: a get of {plane_bytes}-byte plane-blocks read back other bytes")
    os.close(fd)
    rows = []
    for (op, method, label), seconds in measured.items():
        rows.append(
            {
                "op": op,
                "method": method,
                "queue": (
                    "" if not method.startswith("kvcopy") else f"auto: {auto.queue}" if label == "auto" else label
                ),
                "plane_block_bytes": plane_bytes,
                "num_blocks": blocks,
                "bytes": nbytes,
                "descriptors": 1 if method.startswith("contiguous") else descriptors[(op, label)],
                "median_s": seconds,
                "gbps": nbytes / seconds / 1e9,
                "direct": auto.direct,
            }
        )
    for store in stores.values():
        store.close()
        shutil.rmtree(store.path, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk under test (default: a temporary one)")
    parser.add_argument("--sizes", default="2,8,32,128", help="KiB per plane-block, comma-separated")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per call")
    parser.add_argument("--repeats", type=int, default=5, help="calls per row (the median is reported)")
    parser.add_argument("--queues", action="store_true", help="also compare NIXL POSIX's queues")
    parser.add_argument("--csv", help="also write the rows here")
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="kvcopy-bench-disk-", dir=os.getcwd())
    os.makedirs(directory, exist_ok=True)
    identity = machine_identity(torch.device("cpu"))
    filesystem = filesystem_of(directory)
    rows = []
    try:
        for kib in (int(s) for s in args.sizes.split(",")):
            rows += _measure(directory, kib * 1024, args.blocks, args.repeats, args.queues)
    finally:  # also when a run fails or is interrupted: a temporary store is not left in the checkout
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    limits = {(r["op"], r["plane_block_bytes"]): r["median_s"] for r in rows if r["method"] == "contiguous (limit)"}
    for r in rows:
        limit = limits.get((r["op"], r["plane_block_bytes"]))
        r["x_limit"] = limit / r["median_s"] if limit else float("nan")
    direct = all(r["direct"] for r in rows)
    print(
        f"kvcopy disk bench on {identity.get('host_cpu', identity.get('device_name'))}, {identity.get('date')}: "
        f"{args.blocks} random page-first blocks of {PLANES} planes per call, on {filesystem}, "
        f"{'O_DIRECT (cold)' if direct else 'page cache dropped before reads'}, median of {args.repeats}"
    )
    header = f"{'op':<11} {'KiB/plane-block':>15} {'method':<24} {'queue':<16} {'descr.':>6} {'ms':>9} {'GB/s':>7}"
    print(f"{header} {'x limit':>8}")
    for r in sorted(rows, key=lambda r: (r["op"], r["plane_block_bytes"], r["method"], r["queue"])):
        print(
            f"{r['op']:<11} {r['plane_block_bytes'] // 1024:>15} {r['method']:<24} {r['queue']:<16} "
            f"{r['descriptors']:>6} {r['median_s'] * 1e3:>9.2f} {r['gbps']:>7.2f} {r['x_limit']:>8.2f}"
        )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*IDENTITY_COLUMNS, "filesystem", *COLUMNS, "direct"])
            writer.writeheader()
            for r in rows:
                writer.writerow({**{k: identity.get(k, "") for k in IDENTITY_COLUMNS}, "filesystem": filesystem, **r})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
