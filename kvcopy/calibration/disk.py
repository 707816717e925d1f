"""Calibrating the disk: alpha and beta of a DiskKVStore's writes and reads, per range size, cold.

Like the network link (kvcopy/calibration/network.py), with its RangeSweep. A shape is (range bytes, ranges per
call); a range is one store block: each range size gets a store whose blocks are that size (page-first,
one uint8 plane), as a model whose page-first block is that size would have, since a store's costs beside
the transfer (a checksum, an index entry, a commit record) come per block. Its data file is written
through once before anything is timed, as a store in service has been. Each timed put writes that many
blocks from random, different pool ids (the store's own slot choice, its checksums, syncs and index commit
included), and each timed get reads them back (O_DIRECT, or after dropping the file's pages: cold). The
fits land in a Profile as directions DISK_WRITE ("h2f") and DISK_READ ("f2h"), method DISK_METHOD, keyed
by range bytes; ``hardware["disk"]`` says where and how (filesystem, O_DIRECT, NIXL queue).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile

import torch

from kvcopy._checks import path_argument
from kvcopy.calibration.local import fit_lines
from kvcopy.calibration.network import RangeSweep, calibration_pool, run_ids
from kvcopy.calibration.progress import progress_bar
from kvcopy.calibration.timing import measure
from kvcopy.host.pool import HostKVPool
from kvcopy.profile import DISK_METHOD, DISK_READ_DIRECTION, DISK_WRITE_DIRECTION, Profile
from kvcopy.storage.files import filesystem_of, fill_with_zeros
from kvcopy.storage.store import DiskKVStore

__all__ = [
    "DISK_METHOD",
    "DISK_READ",
    "DISK_WRITE",
    "FULL_SWEEP",
    "QUICK_SWEEP",
    "add_disk_fits",
    "check_disk_directory",
    "measure_disk",
]

# Where the disk's fits go in a Profile: host to file (a put), file to host (a get), through NIXL's POSIX backend.
DISK_WRITE, DISK_READ = DISK_WRITE_DIRECTION, DISK_READ_DIRECTION


# 16 KiB to 2 MiB ranges (a small model's page-first block to a llama-8b one of 16 tokens), 1 to 64 per call.
QUICK_SWEEP = RangeSweep((16384, 262144, 2 << 20), (1, 8, 64), 32 << 20, 3)
FULL_SWEEP = RangeSweep((4096, 32768, 262144, 2 << 20), (1, 4, 16, 64, 256), 128 << 20, 5)


class _Key:
    """A CacheKey stand-in: the calibration store holds no model's blocks."""

    context_hash = hashlib.sha256(b"kvcopy disk calibration").hexdigest()


def _shapes(sweep: RangeSweep) -> list[tuple[int, int]]:
    return [(s, c) for s in sweep.range_nbytes for c in sweep.ranges_per_read if s * c <= sweep.max_read_bytes]


def _store_blocks(sweep: RangeSweep, size: int) -> int:
    """Blocks of the calibration store for range size ``size``: room for every put of that size, so that no put
    evicts (an eviction adds a sync, which would bend the line)."""
    calls = 2 + sweep.repeats  # measure's warm-up and timed calls
    return calls * sum(c for s, c in _shapes(sweep) if s == size)


def check_disk_directory(directory: str | os.PathLike[str], sweep: RangeSweep = QUICK_SWEEP) -> None:
    """Before any measuring: ``directory`` is (or is made) a folder this process can make a store in, with room
    for the largest calibration store of ``sweep`` (they are made one at a time). OSError saying which not:
    a path under a file, no permission, a read-only or full filesystem."""
    directory = os.fspath(path_argument("directory", directory))
    try:
        os.makedirs(directory, exist_ok=True)
        probe = tempfile.mkdtemp(prefix="kvcopy-calibrate-disk-check-", dir=directory)
    except OSError as err:
        raise type(err)(err.errno, f"directory: cannot make a store under {directory}: {err.strerror}") from None
    shutil.rmtree(probe, ignore_errors=True)
    needed = max((_store_blocks(sweep, size) * size for size in sweep.range_nbytes), default=0)
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"directory: the calibration stores need {needed} bytes free under {directory}, and {free} are",
        )


def measure_disk(directory: str, sweep: RangeSweep = QUICK_SWEEP, *, progress: bool = True) -> dict:
    """Times puts and gets of a calibration store made in a temporary folder inside ``directory`` (removed
    after): ``{"points": {direction: rows}, "direct": bool, "queue": str, "filesystem": str}``, each row (total
    bytes, NIXL descriptors per call on average, range bytes, median s, p20 s, p80 s). ``directory`` is checked
    first (:func:`check_disk_directory`)."""
    check_disk_directory(directory, sweep)
    folder = tempfile.mkdtemp(prefix="kvcopy-calibrate-disk-", dir=directory)
    shapes = _shapes(sweep)
    calls = 2 + sweep.repeats  # measure's warm-up and timed calls
    points: dict[str, list[list[float]]] = {DISK_WRITE: [], DISK_READ: []}
    generator = torch.Generator().manual_seed(0)
    found = {"direct": True, "queue": ""}
    bar = progress_bar(len(shapes), progress, "calibrating the disk", "shape")
    try:
        for size in sweep.range_nbytes:
            counts = [c for s, c in shapes if s == size]
            if not counts:
                continue
            pool = calibration_pool(sweep.pool_nbytes, block_nbytes=size)
            path = os.path.join(folder, f"store-{size}")
            store = DiskKVStore.create(path, pool, _store_blocks(sweep, size), cache_key=_Key())
            with store:
                fill_with_zeros(path)
                found = {"direct": store.direct, "queue": store.queue}
                for count in counts:
                    points_of = _time_shape(store, pool, size, count, calls, sweep.repeats, generator)
                    for direction, row in points_of.items():
                        points[direction].append(row)
                    bar.update()
            shutil.rmtree(path, ignore_errors=True)  # this size's disk space back before the next
        bar.close()
        return {"points": points, **found, "filesystem": filesystem_of(folder)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _time_shape(
    store: DiskKVStore, pool: HostKVPool, size: int, count: int, calls: int, repeats: int, generator: torch.Generator
) -> dict[str, list[float]]:
    """One point per direction for puts and gets of ``count`` blocks of ``size`` bytes at random pool ids:
    (total bytes, NIXL descriptors per call on average, range bytes, median s, p20 s, p80 s)."""
    ids = [run_ids(pool.num_blocks, 1, count, generator) for _ in range(calls)]
    hashes = [
        [hashlib.sha256(f"{size}:{count}:{i}:{j}".encode()).hexdigest() for j in range(count)] for i in range(calls)
    ]
    written, read = iter(range(calls)), iter(range(calls))
    descriptors: dict[str, list[int]] = {DISK_WRITE: [], DISK_READ: []}

    def put() -> None:
        i = next(written)
        transfer = store.put(hashes[i], pool, ids[i])
        descriptors[DISK_WRITE].append(transfer.num_descriptors)
        transfer.wait()

    def get() -> None:
        i = next(read)
        store.drop_page_cache()
        transfer = store.get(store.match(hashes[i]), pool, ids[i])
        descriptors[DISK_READ].append(transfer.num_descriptors)
        transfer.wait()

    out = {}
    for direction, call in ((DISK_WRITE, put), (DISK_READ, get)):
        timing = measure(call, warmup=2, repeats=repeats)
        mean = sum(descriptors[direction]) / len(descriptors[direction])
        out[direction] = [size * count, mean, size, timing.median, timing.p20, timing.p80]
    return out


def add_disk_fits(profile: Profile, directory: str, *, quick: bool = True, progress: bool = True) -> Profile:
    """Measures the disk under ``directory`` and adds it to ``profile``: ``directions["h2f"]`` and ``directions["f2h"]``
    (method "nixl_posix", fits per range size) and ``hardware["disk"]``."""
    sweep = QUICK_SWEEP if quick else FULL_SWEEP
    measured = measure_disk(directory, sweep, progress=progress)
    try:
        fits = fit_lines({d: {DISK_METHOD: rows} for d, rows in measured["points"].items()})
    except ValueError:  # times that do not grow with the bytes moved: a busy machine; once more
        measured = measure_disk(directory, sweep, progress=progress)
        try:
            fits = fit_lines({d: {DISK_METHOD: rows} for d, rows in measured["points"].items()})
        except ValueError as err:
            raise ValueError(
                f"directory: the disk under {directory} was measured twice, and both times its times did not grow "
                f"with the bytes moved ({err}): the machine is too busy to calibrate it now"
            ) from None
    profile.directions.update(fits)
    profile.hardware["disk"] = (
        f"{os.path.abspath(directory)} ({measured['filesystem']}; "
        f"{'O_DIRECT' if measured['direct'] else 'page cache dropped before reads'}; NIXL POSIX {measured['queue']})"
    )
    return profile
