"""The disk's own limit at one block size: a file written and read sequentially, one block a request and one
request at a time, in a directory on the disk under test.

The file is opened as kvcopy's store opens its data file (kvcopy.storage.files.open_data): with O_DIRECT where
the block is aligned (DIRECT_ALIGNMENT) and the filesystem takes it; otherwise through the page cache, its pages
dropped before each read. Each write pass ends with one sync. The file is written through once when it is made
(untimed), so the timed writes overwrite written blocks: the disk's speed, not the filesystem's allocation.

A pass is timed by ``fio`` where it is on PATH (``--ioengine=psync --iodepth=1``; fio's own bandwidth figure,
``bw_bytes``, at its 1 ms resolution), else by a plain writer and reader here (``os.pwrite`` / ``os.preadv`` of
one page-aligned buffer of random bytes, the pass and its sync timed by kvcopy.calibration.timing's one-call
timer). fio is never required.

A tier that merges adjacent chunks into one request, or keeps several requests in flight, can pass this limit:
it is the disk at the tier's block size, the way a plain program would read and write it.

For benchmarks/bench_vllm_tiers.py, which takes one write and one read pass in each of its rounds, beside the
tiers' own cascades and promotions, on the same directory.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
from collections.abc import Callable

from kvcopy.calibration.timing import seconds_to_completion
from kvcopy.storage.files import DATA, open_data

__all__ = ["TOOLS", "SequentialFile"]

TOOLS = ("auto", "fio", "python")  # "auto": fio where it is installed, else the plain writer and reader
# A pass that runs this long is a hung disk or fio, not a measurement.
FIO_TIMEOUT_S = 600.0


class SequentialFile:
    """A file of ``blocks`` blocks of ``block_bytes`` in ``folder`` (made), written through once, whose
    sequential write and read passes :meth:`write_gbps` and :meth:`read_gbps` time. ``tool``: one of TOOLS;
    with "auto", a fio that fails on the first (untimed) pass is left for the plain writer and reader, and
    ``note`` says why. ``tool`` says which times the passes; ``direct``, whether they bypass the page cache.

    TypeError for a count that is not an int, ValueError for one below 1 or an unknown ``tool``,
    FileNotFoundError for ``tool="fio"`` without fio on PATH; all before anything is written."""

    def __init__(self, folder: str, block_bytes: int, blocks: int, tool: str = "auto") -> None:
        for name, value in (("block_bytes", block_bytes), ("blocks", blocks)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: expected at least 1, got {value}")
        if tool not in TOOLS:
            raise ValueError(f"tool: expected one of {TOOLS}, got {tool!r}")
        fio = shutil.which("fio") if tool != "python" else None
        if tool == "fio" and fio is None:
            raise FileNotFoundError("tool: 'fio' asked for, and there is no fio on PATH")
        self.block_bytes, self.blocks = block_bytes, blocks
        self.nbytes = block_bytes * blocks
        self.note = ""
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, DATA)
        os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o644))
        self._fd, self.direct = open_data(folder, block_bytes)
        self._buffer = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT wants
        self._buffer.write(os.urandom(block_bytes))  # random: a disk that compresses or skips zeros sees data
        self._fio = fio
        try:
            try:
                self.write_gbps()  # written through once: the timed passes overwrite written blocks
            except RuntimeError as err:
                if tool == "fio":
                    raise
                self._fio, self.note = None, f"fio failed ({err}); timed here instead"
                self.write_gbps()
        except BaseException:
            self.close()
            raise

    @property
    def tool(self) -> str:
        """What times the passes: "fio" or "python"."""
        return "fio" if self._fio else "python"

    def write_gbps(self) -> float:
        """One sequential write pass over the whole file, synced at its end: GB/s."""
        if self._fio:
            return self._fio_pass("write")

        def write(view: memoryview) -> None:
            for offset in range(0, self.nbytes, self.block_bytes):
                if os.pwrite(self._fd, view, offset) != self.block_bytes:
                    raise OSError(f"{self.path}: a short write at byte {offset}")
            os.fdatasync(self._fd)

        return self._timed(write)

    def read_gbps(self) -> float:
        """One sequential read pass over the whole file, cold (O_DIRECT, or its pages dropped first): GB/s."""
        if self._fio:
            return self._fio_pass("read")
        if not self.direct:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def read(view: memoryview) -> None:
            for offset in range(0, self.nbytes, self.block_bytes):
                if os.preadv(self._fd, [view], offset) != self.block_bytes:
                    raise OSError(f"{self.path}: a short read at byte {offset}")

        return self._timed(read)

    def _timed(self, one_pass: Callable[[memoryview], None]) -> float:
        """GB/s of ``one_pass`` over the buffer, timed once (kvcopy.calibration.timing's one-call timer: a pass
        happens once a round, beside the work it is compared with; the rounds give the repeats)."""
        with memoryview(self._buffer) as view:
            seconds = seconds_to_completion(lambda: one_pass(view))
        return self.nbytes / seconds / 1e9

    def _fio_pass(self, op: str) -> float:
        """fio's bandwidth of one pass (``op``: "write" or "read"); RuntimeError saying why when fio fails or
        reports none (a pass under its 1 ms resolution)."""
        assert self._fio is not None
        command = [
            self._fio,
            "--name=limit",
            f"--filename={self.path.replace(':', chr(92) + ':')}",  # fio splits file names at ':'
            f"--rw={op}",
            f"--bs={self.block_bytes}",
            f"--size={self.nbytes}",
            f"--direct={int(self.direct)}",
            "--ioengine=psync",
            "--iodepth=1",
            "--invalidate=1",  # the file's pages dropped first (what a read through the page cache needs)
            "--output-format=json",
        ]
        if op == "write":
            command.append("--end_fsync=1")
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=FIO_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"fio {op}: no result in {FIO_TIMEOUT_S:.0f} s") from None
        said = (done.stderr.strip() or done.stdout.strip())[-300:]
        if done.returncode != 0:
            raise RuntimeError(f"fio {op} exited {done.returncode}: {said}")
        try:
            (job,) = json.loads(done.stdout[done.stdout.index("{") :])["jobs"]
            bandwidth, error = float(job[op]["bw_bytes"]), int(job.get("error", 0))
        except (ValueError, KeyError, TypeError) as err:
            raise RuntimeError(f"fio {op}: no bandwidth in its output ({err}): {said}") from None
        if error or bandwidth <= 0:
            raise RuntimeError(f"fio {op}: error {error}, {bandwidth:g} bytes/s (a pass under 1 ms?): {said}")
        return bandwidth / 1e9

    def close(self) -> None:
        """Closes the file (it stays; its folder is the caller's)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._buffer.close()
