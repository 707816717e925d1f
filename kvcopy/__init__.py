"""kvcopy: move paged KV-cache blocks between GPU pages and host memory.

The one primitive is :func:`copy_blocks`: for every i and plane p,
``dst.planes[p][dst_ids[i]] = src.planes[p][src_ids[i]]``, bitwise, all planes
and blocks in one submission. :func:`gather` (pages -> host) and
:func:`scatter` (host -> pages) are that primitive with a :class:`HostKVPool`
on one side.
"""

from __future__ import annotations

from kvcopy._checks import FileFormatError
from kvcopy._ext import build_info  # importing _ext loads the compiled ops and their fakes
from kvcopy._version import __version__, deprecated_module
from kvcopy.agents import GapForecast, GapForecaster, PauseHint, PausePlan, plan_pause
from kvcopy.cachekey import BlockIndex, CacheKey
from kvcopy.calibration import calibrate
from kvcopy.engine import Transfer, TransferConflictError, TransferEngine
from kvcopy.host import BlockAllocator, HostKVPool
from kvcopy.layout import PagedKV
from kvcopy.methods import CAPTURABLE_METHODS, METHODS
from kvcopy.model import ModelSpec
from kvcopy.online import OnlineProfile
from kvcopy.ops import available_methods, copy_blocks, gather, scatter
from kvcopy.planner import Decision, Planner
from kvcopy.profile import CostLine, Profile, set_default_profile
from kvcopy.ranges import ByteRange, copy_ranges

__all__ = [
    "CAPTURABLE_METHODS",
    "METHODS",
    "BlockAllocator",
    "BlockIndex",
    "ByteRange",
    "CacheKey",
    "CostLine",
    "Decision",
    "FileFormatError",
    "GapForecast",
    "GapForecaster",
    "HostKVPool",
    "ModelSpec",
    "OnlineProfile",
    "PagedKV",
    "PauseHint",
    "PausePlan",
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
    "plan_pause",
    "scatter",
    "set_default_profile",
]

# kvcopy.policy was split into kvcopy.model, .cachekey, .calibration, .online and .planner (0.2.0).
policy = deprecated_module("kvcopy.policy", {"OnlineProfile": "kvcopy.online"})
