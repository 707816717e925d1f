"""The TransferEngine's CUDA resources: its copy streams and reused events.

Which stream a copy runs on, and at what priority (torch's convention: lower numbers run first; 0 is the
default stream's, and on CUDA also the least a device has):

- stores (offload) and prefetch loads (reload): one dedicated non-blocking stream each, at the device's least
  priority (``cudaDeviceGetStreamPriorityRange``). That is below the default only where the device has a
  priority below it; on CUDA (least 0) they tie with torch's default stream, so a forward on it does not take
  precedence over them, while one on a higher-priority stream does.
- expedited loads (a step waits for them): a stream of the device's greatest priority, so that they overtake
  both the prefetch loads queued before them and the forward.

kvcopy's dedicated streams are never destroyed: a closed engine's streams wait, idle, for the next engine on
the device. A tensor the caching allocator saw used on a stream (``record_stream``: the ids a copy reads) may be
freed long after its engine closed, and the allocator then records an event on that stream: it must still
exist.
"""

from __future__ import annotations

import threading

import torch

from kvcopy import _ext

__all__ = [
    "COPY_STREAM_PRIORITY",
    "EventPool",
    "greatest_priority",
    "new_copy_stream",
    "new_expedited_stream",
    "release_streams",
]

# torch stream priorities: lower numbers run first, 0 is the least (and the
# default stream's). Copy streams take the least, so decode on a stream of
# higher priority wins the SMs; only used when kvcopy's own streams cannot be made.
COPY_STREAM_PRIORITY = 0

# Closed engines' dedicated streams, by device index: handed to the next engine instead of being destroyed.
_idle_streams: dict[int, list[int]] = {}
_idle_lock = threading.Lock()


def greatest_priority() -> int:
    """The highest priority torch can give a stream on this machine (the lowest number)."""
    return int(torch.cuda.Stream.priority_range()[1])  # type: ignore[call-arg]  # a staticmethod at run time


def release_streams(device_index: int, handles: list[int]) -> None:
    """Streams of device ``device_index`` made by new_copy_stream, whose engine is done with them (their queued
    work may still run): kept, idle, for the next engine on that device."""
    with _idle_lock:
        _idle_streams.setdefault(device_index, []).extend(handles)
    handles.clear()


class EventPool:
    """Reused CUDA events: a transfer's events return here when its handle is garbage."""

    def __init__(self, *, enable_timing: bool) -> None:
        self._enable_timing = enable_timing
        self._free: list[torch.cuda.Event] = []

    def get(self) -> torch.cuda.Event:
        try:
            return self._free.pop()  # atomic under the GIL: safe from several submitting threads
        except IndexError:
            return torch.cuda.Event(enable_timing=self._enable_timing)

    def put(self, events: list[torch.cuda.Event]) -> None:
        self._free.extend(events)


def new_copy_stream(device: torch.device) -> torch.cuda.Stream:
    """A dedicated stream of ``device``'s least priority (decode on any higher-priority stream wins the SMs),
    non-blocking. torch.cuda.Stream() would hand out one of torch's shared pool streams, which other code may be
    using. Hand it back with release_streams once the engine is done with it."""
    module = _ext.extension()
    if module is None or not hasattr(module, "create_copy_stream"):
        return torch.cuda.Stream(device, priority=COPY_STREAM_PRIORITY)  # no CUDA kernels built
    with _idle_lock:
        idle = _idle_streams.get(device.index, [])
        handle = idle.pop() if idle else None
    if handle is None:
        with torch.cuda.device(device):
            handle = module.create_copy_stream(device.index)
    return torch.cuda.ExternalStream(handle, device=device)


def new_expedited_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of ``device`` at the greatest priority torch gives, for loads a step waits for: one of torch's
    pool streams of that priority (never destroyed; code that shares it only queues beside these loads, the
    engine's events order everything)."""
    return torch.cuda.Stream(device, priority=greatest_priority())
