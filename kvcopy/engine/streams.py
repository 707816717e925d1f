"""The TransferEngine's CUDA resources: dedicated least-priority copy streams and reused events."""

from __future__ import annotations

import torch

from kvcopy import _ext

__all__ = ["COPY_STREAM_PRIORITY", "EventPool", "destroy_streams", "new_copy_stream"]

# torch stream priorities: lower numbers run first, 0 is the least (and the
# default stream's). Copy streams take the least, so decode on a stream of
# higher priority wins the SMs; only used when kvcopy's own streams cannot be made.
COPY_STREAM_PRIORITY = 0


def destroy_streams(handles: list[int]) -> None:
    for handle in handles:  # each made by the extension's create_copy_stream
        _ext.loaded_extension().destroy_stream(handle)
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
    using. Destroy it with destroy_streams once its work is done."""
    module = _ext.extension()
    if module is None or not hasattr(module, "create_copy_stream"):
        return torch.cuda.Stream(device, priority=COPY_STREAM_PRIORITY)  # no CUDA kernels built
    with torch.cuda.device(device):
        handle = module.create_copy_stream(device.index)
    return torch.cuda.ExternalStream(handle, device=device)
