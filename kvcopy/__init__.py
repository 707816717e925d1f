"""kvcopy: move paged KV-cache blocks between GPU pages and host memory.

The one primitive is :func:`copy_blocks`: for every i and plane p,
``dst.planes[p][dst_ids[i]] = src.planes[p][src_ids[i]]``, bitwise, all planes
and blocks in one submission. :func:`gather` (pages -> host) and
:func:`scatter` (host -> pages) are that primitive with a :class:`HostKVPool`
on one side.
"""

from __future__ import annotations

from ._ext import build_info  # importing _ext loads the compiled ops and their fakes
from ._version import __version__
from .block_allocator import BlockAllocator
from .engine import TransferConflictError, TransferEngine
from .host import HostKVPool
from .layout import PagedKV
from .methods import CAPTURABLE_METHODS, METHODS
from .ops import available_methods, copy_blocks, gather, scatter
from .policy.cachekey import BlockIndex, CacheKey
from .policy.calibrator import calibrate
from .policy.model import ModelSpec
from .policy.online import OnlineProfile
from .policy.planner import Decision, Planner
from .profile import Profile, set_default_profile
from .ranges import ByteRange, copy_ranges
from .transfer import Transfer

__all__ = [
    "CAPTURABLE_METHODS",
    "METHODS",
    "BlockAllocator",
    "BlockIndex",
    "ByteRange",
    "CacheKey",
    "Decision",
    "HostKVPool",
    "ModelSpec",
    "OnlineProfile",
    "PagedKV",
    "Planner",
    "Profile",
    "Transfer",
    "TransferConflictError",
    "TransferEngine",
    "__version__",
    "available_methods",
    "build_info",
    "calibrate",
    "copy_blocks",
    "copy_ranges",
    "gather",
    "scatter",
    "set_default_profile",
]
