"""How a disk store's put or get becomes NIXL requests: in rounds of bounded size, a GPU cache's blocks through
a page-first staging buffer on its device.

NIXL's GDS backend runs each transfer as cuFile batches from a fixed pool (its defaults: 16 batches of 128
requests); a transfer past the pool's free batches fails ("GDS batch pool exhausted"). A GPU cache's planes
are tensors of their own, and the file is page-first, so planned directly a put of N blocks of a P-plane
cache is N x P requests of one plane-block each (2,560 for 40 blocks of a 64-plane cache), each a 4-32 KiB IO:
cuFile's slowest case, and past the pool from 33 blocks on. So a GPU cache's blocks move through a
page-first staging buffer on the GPU (:class:`Staging`): a put gathers up to :func:`staging_blocks` of them
into it with one kvcopy copy, then writes its rows, runs of adjacent slots merged (one request per run,
at most one per block); a get reads into it, then scatters with one kvcopy copy. Every transfer, a host
pool's too, is cut into rounds of at most ROUND_REQUESTS requests, one NIXL transfer each, posted one after
another; a store keeps its requests in flight within GDS_REQUESTS (:mod:`kvcopy.storage.store`). Only the
staging buffer is registered with NIXL, never the cache: a bounded registration, within cuFile's pin limit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvcopy.layout import PagedKV, page_first_planes
from kvcopy.nixl.registration import registration_of
from kvcopy.ranges import plan_table_ranges
from kvcopy.storage.files import DIRECT_ALIGNMENT

__all__ = [
    "GDS_BATCH_POOL",
    "GDS_BATCH_REQUESTS",
    "GDS_REQUESTS",
    "ROUND_REQUESTS",
    "STAGING_BYTES",
    "Round",
    "Staging",
    "plan_rounds",
    "staging_blocks",
]

# NIXL's GDS backend's defaults (its plugin, 1.5.1; kvcopy creates the backend with them): a pool of 16
# cuFile batches of at most 128 requests. A store keeps at most this many requests in flight.
GDS_BATCH_POOL, GDS_BATCH_REQUESTS = 16, 128
GDS_REQUESTS = GDS_BATCH_POOL * GDS_BATCH_REQUESTS
# The requests of one round (one NIXL transfer): four batches, so four rounds of a store's puts and gets
# are in flight at once within the pool.
ROUND_REQUESTS = 4 * GDS_BATCH_REQUESTS
# A GPU staging buffer's bytes (at least one block): 64 MiB is 32 blocks of a 64-plane Llama-8B cache at
# 16 tokens (2 MiB each), one IO each of that size or a run's; small beside a serving GPU's memory, and
# far under cuFile's pin limit.
STAGING_BYTES = 64 << 20


class Round(NamedTuple):
    """One NIXL transfer of a put or get. ``ids``, ``slots``: the pool blocks and store slots it moves (a
    staged round's are gathered into, or scattered from, staging rows ``0..len(ids)``; an unstaged round's
    are the whole transfer's, its ``ranges`` a part of them); ``ranges``: its requests, (memory address, file
    offset, bytes) each."""

    ids: torch.Tensor
    slots: torch.Tensor
    ranges: list[tuple[int, int, int]]


def staging_blocks(nbytes_per_block: int) -> int:
    """The blocks a staging buffer holds: STAGING_BYTES of them, at least one, at most ROUND_REQUESTS (a
    staged round is at most one request per block)."""
    return max(1, min(ROUND_REQUESTS, STAGING_BYTES // nbytes_per_block))


def plan_rounds(
    memory_table: torch.Tensor,
    ids: torch.Tensor,
    file_table: torch.Tensor,
    slots: torch.Tensor,
    *,
    staging_table: torch.Tensor | None = None,
    per_round: int = 0,
) -> list[Round]:
    """The rounds that move blocks ``ids`` of the memory ``memory_table`` describes (a plane table) and store
    ``slots`` of the file ``file_table`` describes (:func:`kvcopy.storage.files.file_table`), each of at most
    ROUND_REQUESTS requests: kvcopy's range planner's runs, cut. With ``staging_table`` (a page-first staging
    buffer's plane table), through it instead, ``per_round`` blocks a round (at most ROUND_REQUESTS): one
    request per run of adjacent slots. Rounds of nothing are left out."""
    if staging_table is None:
        ranges = plan_table_ranges(memory_table, ids, file_table, slots)
        return [Round(ids, slots, ranges[i : i + ROUND_REQUESTS]) for i in range(0, len(ranges), ROUND_REQUESTS)]
    if not 1 <= per_round <= ROUND_REQUESTS:
        raise ValueError(f"per_round: expected an int in [1, {ROUND_REQUESTS}], got {per_round}")
    rounds = []
    for start in range(0, ids.numel(), per_round):
        round_ids, round_slots = ids[start : start + per_round], slots[start : start + per_round]
        rows = torch.arange(round_ids.numel(), dtype=torch.int64)
        ranges = plan_table_ranges(staging_table, rows, file_table, round_slots.contiguous())
        if ranges:
            rounds.append(Round(round_ids, round_slots, ranges))
    return rounds


class Staging:
    """A page-first buffer of ``blocks`` blocks laid out like ``like``, on its device, registered with ``agent``
    (NIXL): ``paged`` (its planes, for kvcopy's copies and the range planner), ``memory`` and ``device_id``
    (NIXL's), ``registered`` (to deregister). ``user``: the transfer whose round holds it (None: free)."""

    def __init__(self, like: PagedKV, blocks: int, agent: Any) -> None:
        nbytes = blocks * like.nbytes_per_block
        allocation = torch.empty(nbytes + DIRECT_ALIGNMENT, dtype=torch.uint8, device=like.device)
        skip = -allocation.data_ptr() % DIRECT_ALIGNMENT  # O_DIRECT (and cuFile's direct path) want it aligned
        planes = page_first_planes(allocation, like, blocks, start=skip)
        self.paged = PagedKV.from_planes(planes, planes_per_layer=like.planes_per_layer)
        self.blocks = blocks
        self._allocation = allocation  # kept alive while registered
        registration = registration_of(self.paged)
        self.memory, self.device_id = registration.memory, registration.device_id
        self.registered = agent.register_memory(list(registration.regions), registration.memory)
        self.user: object | None = None
