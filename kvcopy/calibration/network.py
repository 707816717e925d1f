"""Calibrating the network link between two peers: alpha and beta of a NIXL read, like the local links.

Both ends register a calibration pool: page-first, one uint8 plane of CALIBRATION_UNIT_BYTES blocks, so a
run of k adjacent ids is one contiguous range of k units (kvcopy's range planner merges it into one NIXL
descriptor). A shape is (range bytes, ranges per read): each timed read fetches that many ranges of that
size from random, different places of the remote pool. The fits land in a Profile as direction "r2h"
(peer to host), method "nixl", keyed by range bytes where the local links key by plane-block bytes: a
page-first block of a model's pool is one such range. The contiguous peak is one read of the largest
shape's bytes as a single range. On one machine the peer is another process (the loopback path), and
the profile says so. Which transport UCX took is measured, not assumed: one read is watched on this network
namespace's interface counters, and ``hardware["remote_transport"]`` says whether its bytes crossed a network
(UCX picks shared memory or cross-memory attach whenever it thinks both ends are on one node, also for two
network namespaces of one machine, unless told ``UCX_TLS=tcp`` or ``UCX_NET_DEVICES``).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from kvcopy.calibration.local import fit_lines
from kvcopy.calibration.progress import progress_bar
from kvcopy.calibration.timing import measure
from kvcopy.host.pool import HostKVPool
from kvcopy.layout import PagedKV
from kvcopy.model.dtypes import torch_name
from kvcopy.profile import REMOTE_DIRECTION, Profile
from kvcopy.remote.descriptor import decode
from kvcopy.remote.peer import KVPeer, RemotePool

__all__ = [
    "CALIBRATION_UNIT_BYTES",
    "LOOPBACK",
    "REMOTE_DIRECTION",
    "REMOTE_METHOD",
    "RangeSweep",
    "add_remote_link",
    "calibration_pool",
    "check_calibration_descriptor",
    "interface_rx_bytes",
    "loopback_peer",
    "measure_link",
    "probe_transport",
    "run_ids",
    "serve_calibration_peer",
]

# The calibration pool's block: 4 KiB, the smallest range worth a network descriptor (a 16-token fp8
# head slice), so every measured range size is a whole number of blocks.
CALIBRATION_UNIT_BYTES = 4096
# Where the link's fits go in a Profile: direction "r2h" (a peer's pool to this host's), method "nixl".
REMOTE_METHOD = "nixl"
# What a profile says of a link measured between two processes of one machine.
LOOPBACK = "loopback: two processes on this machine (not a network)"
# Seconds one timed read may take before the calibration gives up on the peer (a 256 MiB read at 1 GB/s
# takes a quarter of that).
READ_TIMEOUT_S = 60.0
# Reads of the largest shape before any is timed: the first set up the connection and fault pages in.
_WARMUP_READS = 2
# The share of a read's bytes that must cross this namespace's interfaces (all but lo) for the link to be a
# network: TCP adds ~5% in headers, and stray packets on a shared interface add next to nothing.
NETWORK_SHARE = 0.5
# Seconds to wait for a loopback peer process to start (it imports torch and NIXL first).
PEER_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RangeSweep:
    """Range sizes x ranges per read (for the disk, kvcopy.calibration.disk: per put and get), capped in bytes per
    read; each side's pool holds twice the cap so that successive reads fetch different bytes."""

    range_nbytes: tuple[int, ...]
    ranges_per_read: tuple[int, ...]
    max_read_bytes: int
    repeats: int

    @property
    def pool_nbytes(self) -> int:
        return 2 * self.max_read_bytes


# 16 KiB to 2 MiB ranges (a small model's page-first block to a llama-8b one of 16 tokens), 1 to 32 per read:
# 32 of 2 MiB is one 64 MiB read, so the fit reaches the sizes a long prefix reads instead of extrapolating.
QUICK_SWEEP = RangeSweep((16384, 262144, 2 << 20), (1, 8, 32), 64 << 20, 5)
FULL_SWEEP = RangeSweep((4096, 32768, 262144, 2 << 20), (1, 4, 16, 64, 256), 128 << 20, 7)


def calibration_pool(nbytes: int, *, block_nbytes: int = CALIBRATION_UNIT_BYTES) -> HostKVPool:
    """The pool both ends of a link calibration register: ``nbytes`` of ``block_nbytes`` blocks (at least
    two), page-first, one uint8 plane, filled with random bytes."""
    num_blocks = max(2, nbytes // block_nbytes)
    like = PagedKV.from_planes([torch.empty(1, block_nbytes, dtype=torch.uint8)])
    pool = HostKVPool(like, num_blocks, layout="page_first")
    pool.buffer.random_()
    return pool


def run_ids(pool_blocks: int, units: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Ids of ``count`` runs of ``units`` adjacent blocks each, at random distinct places of a pool of
    ``pool_blocks`` (the disk calibration, kvcopy.calibration.disk, draws its puts the same way)."""
    starts = torch.randperm(pool_blocks // units, generator=generator)[:count] * units
    return (starts[:, None] + torch.arange(units)).reshape(-1)


def _range_ids(
    pool_blocks: int, units: int, count: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids of ``count`` ranges of ``units`` adjacent blocks each, at random distinct slots of each pool."""
    return run_ids(pool_blocks, units, count, generator), run_ids(pool_blocks, units, count, generator)


def measure_link(
    peer: KVPeer, remote: RemotePool, sweep: RangeSweep = QUICK_SWEEP, *, progress: bool = True
) -> tuple[list[list[float]], float]:
    """Times reads of ``remote``'s blocks into ``peer``'s pool over ``sweep``: the points (total bytes, NIXL
    descriptors per read on average, range bytes, median s, p20 s, p80 s) per shape, and the contiguous peak in
    bytes/s (one read of the largest shape's bytes as a single range)."""
    pool_blocks = min(peer.pool.num_blocks, remote.num_blocks)
    shapes = [
        (size, count)
        for size in sweep.range_nbytes
        for count in sweep.ranges_per_read
        if size * count <= sweep.max_read_bytes and 2 * size * count <= pool_blocks * CALIBRATION_UNIT_BYTES
    ]
    whole = torch.arange(min(sweep.max_read_bytes // CALIBRATION_UNIT_BYTES, pool_blocks))

    def read_whole() -> None:
        peer.read(remote, whole, whole).wait(READ_TIMEOUT_S)

    for _ in range(_WARMUP_READS):  # the first reads set up the connection and fault the pools' pages in
        read_whole()
    generator = torch.Generator().manual_seed(0)
    bar = progress_bar(len(shapes) + 1, progress, "calibrating the remote link", "shape")
    points = []
    for size, count in shapes:
        units = size // CALIBRATION_UNIT_BYTES
        id_sets = [_range_ids(pool_blocks, units, count, generator) for _ in range(8)]
        descriptors: list[int] = []
        timing = measure(_read_next(peer, remote, id_sets, descriptors), warmup=2, repeats=sweep.repeats)
        mean_descriptors = sum(descriptors) / len(descriptors)  # random slots may touch and merge, rarely
        points.append([size * count, mean_descriptors, size, timing.median, timing.p20, timing.p80])
        bar.update()
    peak = measure(read_whole, warmup=1, repeats=sweep.repeats).median
    bar.update()
    bar.close()
    return points, whole.numel() * CALIBRATION_UNIT_BYTES / peak


def _read_next(
    peer: KVPeer, remote: RemotePool, id_sets: list[tuple[torch.Tensor, torch.Tensor]], descriptors: list[int]
) -> Callable[[], None]:
    """A call that reads the blocks of the next of ``id_sets`` each time, round robin, and appends to
    ``descriptors`` how many NIXL descriptors that read took."""
    sets = itertools.cycle(id_sets)

    def read_next() -> None:
        remote_ids, local_ids = next(sets)
        transfer = peer.read(remote, remote_ids, local_ids)
        descriptors.append(transfer.num_descriptors)
        transfer.wait(READ_TIMEOUT_S)

    return read_next


def check_calibration_descriptor(data: bytes) -> None:
    """ValueError unless ``data`` is the descriptor of a calibration peer (``kvcopy peer``,
    :func:`serve_calibration_peer`): checked before anything is measured."""
    layout, _ = decode(data)
    expected = ("page_first", ((CALIBRATION_UNIT_BYTES, torch_name(torch.uint8)),))
    if layout.shape() != expected:
        raise ValueError(
            f"remote_descriptor: pool {layout.agent!r} is laid out {layout.shape()}, not as a calibration peer's "
            f"{expected}; start the other side with `kvcopy peer`"
        )


def add_remote_link(
    profile: Profile,
    remote_descriptor: bytes | None = None,
    *,
    quick: bool = True,
    progress: bool = True,
    sweep: RangeSweep | None = None,
) -> Profile:
    """Measures the link to the peer whose calibration descriptor is ``remote_descriptor`` (from
    :func:`serve_calibration_peer` on the other node), or to a loopback peer in another process of this
    machine when None, and adds it to ``profile``: ``directions["r2h"]["nixl"]``, ``peaks["r2h"]`` and
    ``hardware["remote_link"]`` (which peer; LOOPBACK on one machine) and ``hardware["remote_transport"]``
    (what carried the bytes: :func:`probe_transport`). ``sweep``: the reads timed (default QUICK_SWEEP, or
    FULL_SWEEP when not ``quick``); a smaller cap suits a slow link (its 64 MiB reads take seconds each)."""
    if sweep is None:
        sweep = QUICK_SWEEP if quick else FULL_SWEEP
    elif not isinstance(sweep, RangeSweep):
        raise TypeError(f"sweep: expected a RangeSweep or None, got {type(sweep).__name__}")
    if remote_descriptor is not None:
        check_calibration_descriptor(remote_descriptor)
    with (
        _remote_descriptor(remote_descriptor, sweep) as (descriptor, label),
        KVPeer(calibration_pool(sweep.pool_nbytes), f"kvcopy-calibrate-{os.getpid()}") as peer,
    ):
        remote = peer.connect(descriptor)
        points, peak = measure_link(peer, remote, sweep, progress=progress)
        units = min(sweep.max_read_bytes // CALIBRATION_UNIT_BYTES, peer.pool.num_blocks, remote.num_blocks)
        whole = torch.arange(units)
        transport = probe_transport(
            lambda: peer.read(remote, whole, whole).wait(READ_TIMEOUT_S), len(whole) * CALIBRATION_UNIT_BYTES
        )
        label = label or f"peer {remote.agent!r} (NIXL, {', '.join(peer.backends)})"
    profile.directions[REMOTE_DIRECTION] = fit_lines({REMOTE_DIRECTION: {REMOTE_METHOD: points}})[REMOTE_DIRECTION]
    profile.peaks[REMOTE_DIRECTION] = peak
    profile.hardware["remote_link"] = label
    profile.hardware["remote_transport"] = transport
    return profile


def probe_transport(read: Callable[[], None], nbytes: int) -> str:
    """What carried ``read()`` (``nbytes`` read from a peer), from this network namespace's interface counters:
    a network, with the share of the bytes that crossed it, or shared memory / cross-memory attach; with the
    UCX settings that chose it."""
    before = interface_rx_bytes()
    read()
    after = interface_rx_bytes()
    ucx = ", ".join(f"{k}={os.environ[k]}" for k in ("UCX_TLS", "UCX_NET_DEVICES") if k in os.environ)
    ucx = ucx or "UCX's defaults"
    if before is None or after is None:
        return f"unknown: no /proc/net/dev to watch ({ucx})"
    share = (after - before) / nbytes
    if share >= NETWORK_SHARE:
        return f"network: {share:.2f}x the bytes read crossed this host's interfaces ({ucx})"
    return (
        f"shared memory or cross-memory attach, not a network: {share:.3f}x the bytes read crossed this host's "
        f"interfaces ({ucx}; RDMA, which bypasses the kernel's counters, would read the same)"
    )


def interface_rx_bytes() -> int | None:
    """Bytes received so far on this network namespace's interfaces other than lo (None without /proc)."""
    try:
        with open("/proc/net/dev") as counters:
            lines = counters.readlines()[2:]  # two header lines, then "  name: rx_bytes rx_packets ..."
    except OSError:
        return None
    named = (line.split(":", 1) for line in lines)
    return sum(int(fields.split()[0]) for name, fields in named if name.strip() != "lo")


@contextmanager
def _remote_descriptor(remote_descriptor: bytes | None, sweep: RangeSweep) -> Iterator[tuple[bytes, str | None]]:
    if remote_descriptor is not None:
        yield remote_descriptor, None
        return
    with loopback_peer(sweep.pool_nbytes) as descriptor:
        yield descriptor, LOOPBACK


@contextmanager
def loopback_peer(pool_nbytes: int) -> Iterator[bytes]:
    """A calibration peer in another process of this machine (spawned); yields its descriptor."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve_loopback, args=(child, pool_nbytes), daemon=True)
    process.start()
    try:
        deadline = time.monotonic() + PEER_START_TIMEOUT_S
        while not parent.poll(0.2):
            if not process.is_alive():
                raise RuntimeError(f"the loopback peer process exited (status {process.exitcode}) before it started")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the loopback peer did not start within {PEER_START_TIMEOUT_S:.0f} s")
        yield parent.recv()
    finally:
        with contextlib.suppress(BrokenPipeError, OSError):
            parent.send("exit")
        process.join(PEER_START_TIMEOUT_S)
        if process.is_alive():
            process.kill()


def _serve_loopback(conn: Connection, pool_nbytes: int) -> None:
    with KVPeer(calibration_pool(pool_nbytes), f"kvcopy-loopback-{os.getpid()}") as peer:
        conn.send(peer.descriptor())
        with contextlib.suppress(EOFError):
            conn.recv()  # "exit", or EOF when the parent is gone


def serve_calibration_peer(name: str) -> KVPeer:
    """A peer whose pool another node's ``kvcopy calibrate --remote DESCRIPTOR`` reads from (sized for the
    full sweep): send it ``peer.descriptor()``, keep the peer open while it measures, then close it."""
    return KVPeer(calibration_pool(FULL_SWEEP.pool_nbytes), name)
