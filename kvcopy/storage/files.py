"""The files of a disk store and the NIXL agent that moves its bytes.

A store is a directory: ``header.json`` (format, block layout, CacheKey
context, block count, room), ``blocks.data`` (``num_blocks`` page-first blocks,
of which ``room`` are backed on the disk with fallocate and the rest are holes:
kvcopy.storage.room) and ``index.log`` (kvcopy.storage.commit_log).
The data file is opened with O_DIRECT where every request a store posts is aligned
(:func:`direct_io_fits`), so that what is measured is the disk and not the page cache; NIXL moves the bytes: its POSIX
backend (io_uring, else Linux AIO, else POSIX AIO: the first this kernel
accepts) or its GDS backend (GPUDirect Storage, GPU memory to and from the file).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvcopy._checks import Described, FileFormatError, file_field, nearest_existing
from kvcopy.layout import PLANE_BLOCK_BYTES, PagedKV
from kvcopy.model.dtypes import torch_name
from kvcopy.storage.commit_log import CommitLog

__all__ = [
    "BACKENDS",
    "DIRECT_ALIGNMENT",
    "FORMAT",
    "POSIX_QUEUES",
    "create_files",
    "direct_io_fits",
    "file_agent",
    "file_table",
    "filesystem_of",
    "fill_with_zeros",
    "layout_difference",
    "layout_of",
    "max_blocks",
    "native_output_captured",
    "read_header",
    "write_header",
]

FORMAT = 1  # header.json's "format": bumped when the files change meaning
# O_DIRECT needs offsets, lengths and addresses aligned to the device's logical block: 4096 covers the disks
# seen (512 or 4096 bytes); smaller or odd blocks go through the page cache.
DIRECT_ALIGNMENT = 4096
# The backends a store opens with: "auto" picks (kvcopy.storage.files.file_agent says how).
BACKENDS = ("auto", "posix", "gds")
# NIXL POSIX backend parameters, in the order tried: io_uring, Linux AIO (libaio), POSIX AIO.
POSIX_QUEUES = ("use_uring", "use_aio", "use_posix_aio")
HEADER, DATA, INDEX = "header.json", "blocks.data", "index.log"
# A header is a few hundred bytes; a longer file is not one (and is not read whole).
MAX_HEADER_BYTES = 1 << 20
# The log numbers a slot in 32 bits (kvcopy.storage.commit_log); a file offset is a signed 64-bit number.
MAX_SLOTS, MAX_FILE_BYTES = 1 << 32, (1 << 63) - 1
# fill_with_zeros writes the data file in chunks of this size, from one page-aligned buffer (as O_DIRECT wants)
ZEROS_CHUNK_BYTES = 16 << 20


def layout_of(like: PagedKV) -> dict[str, Any]:
    """The block layout a store keeps: each plane's block bytes and dtype, page-first."""
    table = like.plane_table.tolist()
    planes = [[row[PLANE_BLOCK_BYTES], torch_name(dtype)] for row, dtype in zip(table, like.dtypes, strict=True)]
    return {"layout": "page_first", "planes": planes, "nbytes_per_block": like.nbytes_per_block}


def max_blocks(nbytes_per_block: int) -> int:
    """The most blocks of ``nbytes_per_block`` bytes one store holds: its log numbers slots in 32 bits, and its
    data file's size must be a file offset."""
    return min(MAX_SLOTS, MAX_FILE_BYTES // nbytes_per_block)


def layout_difference(stored: dict[str, Any], given: dict[str, Any]) -> str | None:
    """What differs between two layouts (:func:`layout_of`), said plainly; None when they are alike."""
    if stored["layout"] != given["layout"]:
        return f"blocks laid out {stored['layout']}, not {given['layout']}"
    mine, theirs = stored["planes"], given["planes"]
    if len(mine) != len(theirs):
        return f"{len(mine)} planes per block, not {len(theirs)}"
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if list(a) != list(b):
            return f"plane {i} of {a[0]} bytes of {a[1]} per block, not {b[0]} bytes of {b[1]}"
    if stored["nbytes_per_block"] != given["nbytes_per_block"]:
        return f"{stored['nbytes_per_block']} bytes per block, not {given['nbytes_per_block']}"
    return None


def create_files(path: str, layout: dict[str, Any], num_blocks: int, context_hash: str, room: int) -> None:
    """The store's directory with its data file (``num_blocks`` blocks long, the first ``room`` of them reserved,
    the rest holes), its empty index and its header (written last: a store without one was never made); nothing
    left behind on an error."""
    os.makedirs(path)  # FileExistsError for an existing path: a store is never created over another
    try:
        size = num_blocks * layout["nbytes_per_block"]
        fd = os.open(os.path.join(path, DATA), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                os.ftruncate(fd, size)  # holes: no disk taken
                if room:
                    os.posix_fallocate(fd, 0, room * layout["nbytes_per_block"])
            except OSError as err:
                raise OSError(
                    err.errno,
                    f"path: {room * layout['nbytes_per_block']} bytes for {room} blocks (of a file of {size} bytes) "
                    f"do not fit on {path}'s filesystem",
                ) from err
            os.fsync(fd)
        finally:
            os.close(fd)
        CommitLog(os.path.join(path, INDEX), num_blocks).close()  # empty, synced
        header = {"format": FORMAT, "num_blocks": num_blocks, "room": room, "context_hash": context_hash, **layout}
        write_header(path, header)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def write_header(path: str, header: dict[str, Any], *, sync_directory: bool = True) -> None:
    """Writes the store's header.json whole or not at all: a new file, synced, renamed over the old one (a crash
    leaves the old header or the new one, never a torn one), the directory synced unless ``sync_directory`` is
    False: then the rename is durable with the filesystem's next commit (a store's room: a header that a power
    loss turns back to its previous room is repaired when the store opens, kvcopy.storage.room)."""
    name = os.path.join(path, HEADER)
    temporary = name + ".new"
    with open(temporary, "w") as f:
        json.dump(header, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, name)
    if not sync_directory:
        return
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename (and, for a new store, the other files' names) durable
    finally:
        os.close(directory)


def read_header(path: str) -> dict[str, Any]:
    """The store's header.json, every field checked (FileFormatError naming the file and the field), and its
    data file's size checked against it (the header's blocks are what the store writes into it). A header
    without ``room`` (a store made before stores grew) has every block backed: ``room`` is set to
    ``num_blocks``."""
    name = os.path.join(path, HEADER)
    try:
        with open(name, "rb") as f:
            raw = f.read(MAX_HEADER_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"path: no disk store at {path} (no {HEADER})") from None
    except NotADirectoryError:  # a file where the store's directory, or a folder above it, should be
        blocker = nearest_existing(Path(path))
        if blocker == Path(path):
            raise NotADirectoryError(
                f"path: {path} is a file, not a disk store (a store is a directory that DiskKVStore.create makes)"
            ) from None
        raise NotADirectoryError(
            f"path: no disk store at {path}: it lies under {blocker}, which is a file, not a directory"
        ) from None
    if len(raw) > MAX_HEADER_BYTES:
        raise FileFormatError(
            name, "(the file)", f"a header of at most {MAX_HEADER_BYTES} bytes", Described("a longer file")
        )
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, a number of too many digits, too deep
        raise FileFormatError(
            name, "(the file)", "a JSON object", Described(f"no JSON ({type(err).__name__}: {err})")
        ) from None
    fields = {"file": name}
    file_field(header, "format", int, f"the format this kvcopy reads ({FORMAT})", **fields)
    if header["format"] != FORMAT:
        raise FileFormatError(name, "format", f"the format this kvcopy reads ({FORMAT})", header["format"])
    num_blocks = file_field(header, "num_blocks", int, "a positive int", **fields)
    file_field(header, "context_hash", str, "a CacheKey context hash (a str)", **fields)
    if file_field(header, "layout", str, "'page_first'", **fields) != "page_first":
        raise FileFormatError(name, "layout", "'page_first'", header["layout"])
    planes = file_field(header, "planes", list, "a list of [block bytes, dtype] pairs", **fields)
    for i, plane in enumerate(planes):
        if not (
            isinstance(plane, list)
            and len(plane) == 2
            and isinstance(plane[0], int)
            and not isinstance(plane[0], bool)
            and plane[0] > 0
            and isinstance(plane[1], str)
        ):
            raise FileFormatError(name, f"planes[{i}]", "[block bytes (a positive int), dtype (a str)]", plane)
    nbytes = file_field(header, "nbytes_per_block", int, "a positive int", **fields)
    if not planes or nbytes != sum(n for n, _ in planes):
        total = sum(n for n, _ in planes)
        raise FileFormatError(name, "nbytes_per_block", f"the planes' bytes per block ({total})", nbytes)
    if not 1 <= num_blocks <= max_blocks(nbytes):
        raise FileFormatError(name, "num_blocks", f"an int in [1, {max_blocks(nbytes)}]", num_blocks)
    header.setdefault("room", num_blocks)
    room = file_field(header, "room", int, f"the blocks backed on disk, an int in [0, {num_blocks}]", **fields)
    if not 0 <= room <= num_blocks:
        raise FileFormatError(name, "room", f"the blocks backed on disk, an int in [0, {num_blocks}]", room)
    data = os.path.join(path, DATA)
    try:
        size = os.stat(data).st_size
    except FileNotFoundError:
        raise FileFormatError(
            data, "(the file)", f"the store's data file ({HEADER})", "nothing: it is missing"
        ) from None
    if size < num_blocks * nbytes:  # (longer: a raise of num_blocks a crash cut short; its tail is never read)
        raise FileFormatError(
            data,
            "size",
            f"{num_blocks * nbytes} bytes: {HEADER}'s num_blocks {num_blocks} x nbytes_per_block {nbytes}",
            f"{size} bytes (the header and the data file disagree)",
        )
    return header


def filesystem_of(path: str) -> str:
    """The filesystem type and device under ``path`` (from ``df``), as results name it; "unknown" without."""
    out = subprocess.run(["df", "--output=fstype,source", path], capture_output=True, text=True).stdout.split()
    return " ".join(out[2:4]) if len(out) >= 4 else "unknown"


def file_table(plane_bytes: Sequence[int]) -> torch.Tensor:
    """The data file as a plane table (kvcopy.layout's columns, addresses as file offsets): one page-first plane
    per pool plane, at its offset inside a block, for kvcopy's range planner."""
    nbytes_per_block = sum(plane_bytes)
    offsets = [sum(plane_bytes[:i]) for i in range(len(plane_bytes))]
    rows = [[offset, nbytes_per_block, n] for offset, n in zip(offsets, plane_bytes, strict=True)]
    return torch.tensor(rows, dtype=torch.int64)


def direct_io_fits(nbytes_per_block: int, plane_bytes: Sequence[int] | None = None) -> bool:
    """Whether every request a store posts has a file offset and a size aligned to DIRECT_ALIGNMENT, as O_DIRECT
    needs: two unaligned writes that share a disk block (in one NIXL batch) can each rewrite it whole and lose
    the other's bytes, and the kernel refuses some. A host pool's requests are runs of whole blocks: the block
    size decides. A GPU cache's (GDS) are one per plane-block, each plane a tensor of its own (runs of several
    when planes are adjacent in memory): with ``plane_bytes`` (its planes' block bytes, in block order), every
    plane's offset inside a block and its size must be aligned too. fp8 data with small scale planes, or MLA's
    18,432-byte plane-blocks at 16 tokens, make blocks that are aligned of planes that are not."""
    if nbytes_per_block % DIRECT_ALIGNMENT:
        return False
    offset = 0
    for nbytes in plane_bytes or ():
        if offset % DIRECT_ALIGNMENT or nbytes % DIRECT_ALIGNMENT:
            return False
        offset += nbytes
    return True


def open_data(path: str, nbytes_per_block: int, plane_bytes: Sequence[int] | None = None) -> tuple[int, bool]:
    """The data file's descriptor, with O_DIRECT when every request is aligned (:func:`direct_io_fits`; give
    ``plane_bytes`` where requests may be per plane: a store that moves a GPU cache through GDS) and the
    filesystem takes it."""
    name = os.path.join(path, DATA)
    if direct_io_fits(nbytes_per_block, plane_bytes) and hasattr(os, "O_DIRECT"):
        with contextlib.suppress(OSError):  # tmpfs and some others refuse O_DIRECT
            return os.open(name, os.O_RDWR | os.O_DIRECT), True
    return os.open(name, os.O_RDWR), False


def fill_with_zeros(path: str) -> None:
    """Writes every byte of the room of the store at ``path``, which holds no block yet (its first ``room``
    blocks, the ones it backs), once (zeros, synced), as a store in service has: a fresh file's first write of
    a slot also converts fallocate's unwritten extent (a journaled metadata change), which no later write of
    that slot pays. For measuring a store (kvcopy.calibration.disk, benchmarks/bench_disk.py): it never
    touches the index."""
    header = read_header(path)
    nbytes = header["room"] * header["nbytes_per_block"]
    if not nbytes:
        return
    fd, _ = open_data(path, header["nbytes_per_block"])
    try:
        with mmap.mmap(-1, min(ZEROS_CHUNK_BYTES, nbytes)) as zeros:
            chunk = memoryview(zeros)
            for offset in range(0, nbytes, len(chunk)):
                os.pwrite(fd, chunk[: min(len(chunk), nbytes - offset)], offset)
            chunk.release()
        os.fdatasync(fd)
    finally:
        os.close(fd)


def file_agent(name: str, backend: str, *, gpu: bool = False) -> tuple[Any, str, str]:
    """A NIXL agent with a file backend; (agent, backend, queue). ``"gds"``: NIXL's GDS backend (GPUDirect
    Storage through cuFile: GPU memory to and from the file, host memory too), RuntimeError saying why where
    it will not start. ``"posix"``: NIXL's POSIX backend, with the first queue this machine accepts. ``"auto"``:
    GDS for a store laid out like a GPU cache (``gpu``) where it starts, else POSIX."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    from kvcopy.nixl.agent import nixl_module

    if backend == "gds" and not torch.cuda.is_available():  # said here: NIXL and cuFile would print their own
        raise RuntimeError(
            "backend: NIXL's GDS backend (GPUDirect Storage) would not start here: it needs a CUDA GPU, its driver "
            "and cuFile, and torch sees no CUDA GPU. backend='posix' reads and writes host pools"
        )
    nixl_agent, nixl_agent_config = nixl_module()
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    if backend == "gds" or (backend == "auto" and gpu):
        try:
            with native_output_captured() as printed:  # cuFile's and NIXL's C++ lines: in the error, if any
                agent.create_backend("GDS", {})
        except Exception as err:  # NIXL's errors are its own classes
            if backend == "gds":
                said = "; ".join(line.strip() for line in printed if line.strip())
                raise RuntimeError(
                    f"backend: NIXL's GDS backend (GPUDirect Storage) would not start here ({type(err).__name__}: "
                    f"{err}{'; ' + said if said else ''}); it needs a CUDA GPU, its driver and cuFile. "
                    "backend='posix' reads and writes host pools"
                ) from None
        else:
            _print_again(printed)  # it started: whatever it said is not ours to hide
            return agent, "gds", "cuFile"
    errors = []
    for queue in (*POSIX_QUEUES, None):
        params = {} if queue is None else {queue: "true"}
        try:
            agent.create_backend("POSIX", params)
            return agent, "posix", queue or "posix"
        except Exception as err:  # NIXL's errors are its own classes
            errors.append(f"{queue}: {err}")
    raise RuntimeError(f"backend: NIXL's POSIX backend would not start here ({'; '.join(errors)})")


@contextlib.contextmanager
def native_output_captured() -> Iterator[list[str]]:
    """Captures what compiled code writes to this process's stdout and stderr (file descriptors 1 and 2) while
    the block runs, as the lines of the list it yields (filled when it ends): cuFile and NIXL's C++ logger
    print there directly, past Python's streams. Process-wide while it lasts: keep the block short."""
    lines: list[str] = []
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                yield lines
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                sink.seek(0)
                lines.extend(sink.read().decode(errors="replace").splitlines())
    finally:
        for fd in saved:
            os.close(fd)


def _print_again(lines: list[str]) -> None:
    if lines:
        os.write(2, ("\n".join(lines) + "\n").encode())
