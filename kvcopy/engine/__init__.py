"""Asynchronous offload and reload: the :class:`TransferEngine` (copy streams on a GPU, worker threads on a
CPU), the :class:`Transfer` handle each call returns, and the per-block ordering that keeps transfers from
corrupting each other. Built on the copy core and the host pool."""

from __future__ import annotations

from kvcopy.conflicts import TransferConflictError
from kvcopy.engine.engine import COPY_STREAM_PRIORITY, TransferEngine
from kvcopy.engine.transfer import Transfer

__all__ = ["COPY_STREAM_PRIORITY", "Transfer", "TransferConflictError", "TransferEngine"]
