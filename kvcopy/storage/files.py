"""The files of a disk store and the NIXL agent that moves its bytes.

A store is a directory: ``header.json`` (format, block layout, CacheKey
context, block count), ``blocks.data`` (``num_blocks`` page-first blocks,
reserved up front with fallocate) and ``index.log`` (kvcopy.storage.commit_log).
The data file is opened with O_DIRECT where the block size allows, so that what
is measured is the disk and not the page cache; NIXL moves the bytes: its POSIX
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
from typing import Any

from kvcopy.layout import PLANE_BLOCK_BYTES, PagedKV
from kvcopy.model.dtypes import torch_name

__all__ = [
    "BACKENDS",
    "DIRECT_ALIGNMENT",
    "FORMAT",
    "POSIX_QUEUES",
    "create_files",
    "file_agent",
    "filesystem_of",
    "fill_with_zeros",
    "layout_of",
    "read_header",
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
# fill_with_zeros writes the data file in chunks of this size, from one page-aligned buffer (as O_DIRECT wants)
ZEROS_CHUNK_BYTES = 16 << 20


def layout_of(like: PagedKV) -> dict[str, Any]:
    """The block layout a store keeps: each plane's block bytes and dtype, page-first."""
    table = like.plane_table.tolist()
    planes = [[row[PLANE_BLOCK_BYTES], torch_name(dtype)] for row, dtype in zip(table, like.dtypes, strict=True)]
    return {"layout": "page_first", "planes": planes, "nbytes_per_block": like.nbytes_per_block}


def create_files(path: str, layout: dict[str, Any], num_blocks: int, context_hash: str) -> None:
    """The store's directory with its header and its data file reserved; nothing left behind on an error."""
    os.makedirs(path)  # FileExistsError for an existing path: a store is never created over another
    try:
        size = num_blocks * layout["nbytes_per_block"]
        fd = os.open(os.path.join(path, DATA), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                raise OSError(
                    err.errno, f"path: {size} bytes for {num_blocks} blocks do not fit on {path}'s filesystem"
                ) from err
            os.fsync(fd)
        finally:
            os.close(fd)
        header = {"format": FORMAT, "num_blocks": num_blocks, "context_hash": context_hash, **layout}
        with open(os.path.join(path, HEADER), "w") as f:
            json.dump(header, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def read_header(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, HEADER)) as f:
            header = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"path: no disk store at {path} (no {HEADER})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"path: {path}/{HEADER} is not valid JSON ({err})") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"path: {path} is a disk store of format {header.get('format')}, this kvcopy reads {FORMAT}")
    return header


def filesystem_of(path: str) -> str:
    """The filesystem type and device under ``path`` (from ``df``), as results name it; "unknown" without."""
    out = subprocess.run(["df", "--output=fstype,source", path], capture_output=True, text=True).stdout.split()
    return " ".join(out[2:4]) if len(out) >= 4 else "unknown"


def open_data(path: str, nbytes_per_block: int) -> tuple[int, bool]:
    """The data file's descriptor, with O_DIRECT when the block size is aligned and the filesystem takes it."""
    name = os.path.join(path, DATA)
    if nbytes_per_block % DIRECT_ALIGNMENT == 0 and hasattr(os, "O_DIRECT"):
        with contextlib.suppress(OSError):  # tmpfs and some others refuse O_DIRECT
            return os.open(name, os.O_RDWR | os.O_DIRECT), True
    return os.open(name, os.O_RDWR), False


def fill_with_zeros(path: str) -> None:
    """Writes every byte of the data file of the store at ``path``, which holds no block yet, once (zeros,
    synced), as a store in service has: a fresh file's first write of a slot also converts fallocate's
    unwritten extent (a journaled metadata change), which no later write of that slot pays. For measuring a
    store (kvcopy.calibration.disk, benchmarks/bench_disk.py): it never touches the index."""
    header = read_header(path)
    nbytes = header["num_blocks"] * header["nbytes_per_block"]
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

    nixl_agent, nixl_agent_config = nixl_module()
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    if backend == "gds" or (backend == "auto" and gpu):
        try:
            agent.create_backend("GDS", {})
            return agent, "gds", "cuFile"
        except Exception as err:  # NIXL's errors are its own classes
            if backend == "gds":
                raise RuntimeError(
                    f"backend: NIXL's GDS backend (GPUDirect Storage) would not start here ({type(err).__name__}: "
                    f"{err}); it needs a CUDA GPU, its driver and cuFile. backend='posix' reads and writes host pools"
                ) from None
    errors = []
    for queue in (*POSIX_QUEUES, None):
        params = {} if queue is None else {queue: "true"}
        try:
            agent.create_backend("POSIX", params)
            return agent, "posix", queue or "posix"
        except Exception as err:  # NIXL's errors are its own classes
            errors.append(f"{queue}: {err}")
    raise RuntimeError(f"backend: NIXL's POSIX backend would not start here ({'; '.join(errors)})")
