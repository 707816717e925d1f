"""TransferEngine: asynchronous offload and reload with ordering that cannot corrupt.

On CUDA the engine owns two low-priority copy streams on the cache's device,
one per direction. Each transfer records an event on the caller's current
stream and makes its copy stream wait on it, so the copy reads (offload) or
writes (reload) device blocks only after all work the caller had already
queued: the producer of an offloaded block has finished, and the readers of a
reloaded block's old contents are done. Completion comes back as events in a
:class:`~kvcopy.transfer.Transfer`; nothing here synchronises the host.

On CPU the same API runs on one worker thread per direction (FIFO, like a
stream). Work the caller did before the call has finished by then, so the
ordering guarantees hold as they are.

What stays the caller's job (debug mode catches the transfer-vs-transfer
cases): not writing a block being offloaded, nor reading or writing a block
being reloaded, until the transfer's ``wait``/``wait_stream``/``wait_layer``
says so; not freeing or reusing a host or device block before its transfer is
done; keeping the cache tensors alive (the engine holds references).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from . import _ext
from . import ops as _ops
from ._ids import BlockIds
from .host import HostKVPool
from .layout import PagedKV
from .profile import Profile
from .transfer import CudaSignal, ThreadSignal, Transfer

__all__ = ["TransferEngine", "TransferConflictError", "COPY_STREAM_PRIORITY"]

# torch stream priorities: lower numbers run first, 0 is the least (and the
# default stream's). Copy streams take the least, so decode on a stream of
# higher priority wins the SMs; only used when kvcopy's own streams cannot be made.
COPY_STREAM_PRIORITY = 0


class TransferConflictError(RuntimeError):
    """Debug mode: a new transfer would touch a block that an unfinished transfer still uses."""


@dataclass
class _BlockUse:
    """The blocks one transfer reads and writes, per side ("device" / "host")."""

    transfer: Transfer
    reads: dict[str, set[int]] = field(default_factory=dict)
    writes: dict[str, set[int]] = field(default_factory=dict)


class _ConflictTracker:
    """Debug mode: remembers the blocks of unfinished transfers and refuses overlapping ones."""

    def __init__(self) -> None:
        self._live: list[_BlockUse] = []

    def check(self, direction: str, reads: dict[str, set[int]], writes: dict[str, set[int]]) -> None:
        self._live = [use for use in self._live if not use.transfer.done()]
        for use in self._live:
            for side, blocks in writes.items():
                for verb, theirs in (("reads", use.reads.get(side, set())), ("writes", use.writes.get(side, set()))):
                    both = blocks & theirs
                    if both:
                        raise TransferConflictError(
                            f"{direction} would write {side} block {min(both)}, which an unfinished "
                            f"{use.transfer.direction} still {verb}; wait for that transfer first"
                        )
            for side, blocks in reads.items():
                both = blocks & use.writes.get(side, set())
                if both:
                    raise TransferConflictError(
                        f"{direction} would read {side} block {min(both)}, which an unfinished "
                        f"{use.transfer.direction} still writes; wait for that transfer first"
                    )

    def add(self, use: _BlockUse) -> None:
        self._live.append(use)


def _destroy_streams(handles: list[int]) -> None:
    module = _ext.extension()
    for handle in handles:
        module.destroy_stream(handle)
    handles.clear()


class _EventPool:
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


class TransferEngine:
    """Asynchronous offloads (device pages -> host pool) and reloads (host pool -> device pages).

    ``method``: the copy method for both directions ("auto" by default, see
    kvcopy.copy_blocks). ``profile``: the calibrated Profile "auto" consults
    (default: kvcopy's default profile, see kvcopy.profile.default_profile). ``debug`` (or ``KVCOPY_DEBUG=1``):
    track blocks in flight and raise TransferConflictError when a new transfer
    would write a block an unfinished transfer reads or writes, or read one it
    writes, on either side; ids must then be host-resident. A context manager:
    leaving it (or :meth:`close`) waits for every transfer in flight.
    """

    def __init__(
        self,
        kv: PagedKV,
        host: HostKVPool,
        *,
        method: str = "auto",
        profile: Profile | None = None,
        debug: bool | None = None,
    ) -> None:
        if not isinstance(kv, PagedKV):
            raise TypeError(f"kv: expected a PagedKV, got {type(kv).__name__}")
        if not isinstance(host, HostKVPool):
            raise TypeError(f"host: expected a HostKVPool, got {type(host).__name__}")
        _ops._check_pair(kv, host.paged)
        self.kv = kv
        self.host = host
        self.profile = profile
        self.debug = os.environ.get("KVCOPY_DEBUG") == "1" if debug is None else bool(debug)
        self._method = method
        self._tracker = _ConflictTracker() if self.debug else None
        self._in_flight: list[Transfer] = []
        self._lock = threading.Lock()  # guards _in_flight and the tracker: transfers may come from many threads
        self._closed = False
        self._cuda = kv.device.type == "cuda"
        # Resolve once, so that bad methods fail here and not on the first transfer.
        for src, dst in ((kv, host.paged), (host.paged, kv)):
            _ops._resolve(method, src, dst, host_ids=True)
        for i in range(kv.num_layers):  # layer views (and their plane tables) made now, off the hot path
            kv.layer(i), host.paged.layer(i)
        if self._cuda:
            self._streams = {direction: self._new_copy_stream() for direction in ("offload", "reload")}
            owned = [s.cuda_stream for s in self._streams.values() if isinstance(s, torch.cuda.ExternalStream)]
            # Destroyed at close(), or when the engine is collected without one (CUDA frees a
            # destroyed stream's resources once its queued work is done).
            self._stream_finalizer = weakref.finalize(self, _destroy_streams, owned)
            self._signal_events = _EventPool(enable_timing=False)
            self._timing_events = _EventPool(enable_timing=True)
        else:
            self._workers = {
                direction: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvcopy-{direction}")
                for direction in ("offload", "reload")
            }

    def _new_copy_stream(self) -> torch.cuda.Stream:
        """A dedicated stream of the device's least priority (decode on any higher-priority
        stream wins the SMs), non-blocking. torch.cuda.Stream() would hand out one of torch's
        shared pool streams, which other code may be using."""
        module = _ext.extension()
        if module is None or not hasattr(module, "create_copy_stream"):
            return torch.cuda.Stream(self.kv.device, priority=COPY_STREAM_PRIORITY)  # no CUDA kernels built
        with torch.cuda.device(self.kv.device):
            handle = module.create_copy_stream(self.kv.device.index)
        return torch.cuda.ExternalStream(handle, device=self.kv.device)

    # ----------------------------------------------------------------- public API

    def offload(self, block_ids: BlockIds, host_ids: BlockIds) -> Transfer:
        """Copies device blocks ``block_ids`` to host blocks ``host_ids``; returns at once.

        The device blocks are read only after all work already queued on the
        caller's current stream has finished.
        """
        return self._submit("offload", self.kv, block_ids, "block_ids", self.host.paged, host_ids, "host_ids", False)

    def reload(self, host_ids: BlockIds, block_ids: BlockIds, *, layerwise: bool = False) -> Transfer:
        """Copies host blocks ``host_ids`` into device blocks ``block_ids``; returns at once.

        The device blocks are written only after all work already queued on the
        caller's current stream. ``layerwise``: copy layer by layer and signal
        each (``Transfer.wait_layer``), so attention of layer l can start as soon
        as layer l has arrived.
        """
        return self._submit("reload", self.host.paged, host_ids, "host_ids", self.kv, block_ids, "block_ids", layerwise)

    def close(self) -> None:
        """Waits for every transfer in flight (their errors stay with their handles), then frees the streams or workers."""
        with self._lock:  # from here on, new transfers are refused
            if self._closed:
                return
            self._closed = True
            in_flight, self._in_flight = self._in_flight, []
        for transfer in in_flight:
            with contextlib.suppress(Exception):
                transfer.wait()
        if not self._cuda:
            for worker in self._workers.values():
                worker.shutdown(wait=True)
            return
        for stream in self._streams.values():
            stream.synchronize()  # every transfer was waited for above; this also covers captured ones' replays
        self._streams.clear()
        self._stream_finalizer()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def num_in_flight(self) -> int:
        """Transfers submitted and not yet seen done."""
        with self._lock:
            self._in_flight = [t for t in self._in_flight if not t.done()]
            return len(self._in_flight)

    # ----------------------------------------------------------------- submission

    def _submit(
        self,
        direction: str,
        src: PagedKV,
        src_ids: BlockIds,
        src_name: str,
        dst: PagedKV,
        dst_ids: BlockIds,
        dst_name: str,
        layerwise: bool,
    ) -> Transfer:
        if self._closed:
            raise RuntimeError(f"{direction}: this TransferEngine is closed")
        src_t, dst_t, host_ids = _ops._prepare_pair(src, src_ids, dst, dst_ids, (src_name, dst_name))
        capturing = self._cuda and torch.cuda.is_current_stream_capturing()
        method = _ops._resolve(self._method, src, dst, host_ids=host_ids, capturing=capturing,
                               num_blocks=src_t.numel(), profile=self.profile)
        # A captured transfer runs at replay, not now: it is neither tracked nor waited for at close.
        num_blocks = src_t.numel()
        nbytes = num_blocks * self.kv.nbytes_per_block
        with self._lock:  # check, submit and record as one step, so two threads cannot both pass the check
            if self._closed:
                raise RuntimeError(f"{direction}: this TransferEngine is closed")
            use = self._block_use(direction, src_t, dst_t, host_ids) if self._tracker and not capturing else None
            if self._cuda:
                transfer = self._submit_cuda(direction, method, src, src_t, dst, dst_t, layerwise, num_blocks, nbytes,
                                             capturing)
            else:
                transfer = self._submit_cpu(direction, method, src, src_t, dst, dst_t, layerwise, num_blocks, nbytes)
            if not capturing:
                self._in_flight = [t for t in self._in_flight if not t.done()]
                self._in_flight.append(transfer)
            if use is not None:
                use.transfer = transfer
                self._tracker.add(use)  # type: ignore[union-attr]
        return transfer

    def _block_use(self, direction: str, src_ids: torch.Tensor, dst_ids: torch.Tensor, host_ids: bool) -> _BlockUse:
        """Checks the new transfer against those in flight (debug mode); what it will touch."""
        if not host_ids:
            raise ValueError(f"{direction}: debug mode needs host-resident ids to track blocks in flight")
        src_side, dst_side = ("device", "host") if direction == "offload" else ("host", "device")
        reads = {src_side: set(src_ids.tolist())}
        writes = {dst_side: set(dst_ids.tolist())}
        self._tracker.check(direction, reads, writes)  # type: ignore[union-attr]
        return _BlockUse(transfer=None, reads=reads, writes=writes)  # type: ignore[arg-type]

    def _copy(self, method: str, src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor,
              layer: int | None) -> None:
        if layer is not None:
            src, dst = src.layer(layer), dst.layer(layer)
        _ops._run(method, src, src_ids, dst, dst_ids)

    def _submit_cuda(self, direction: str, method: str, src: PagedKV, src_ids: torch.Tensor, dst: PagedKV,
                     dst_ids: torch.Tensor, layerwise: bool, num_blocks: int, nbytes: int,
                     capturing: bool) -> Transfer:
        stream = self._streams[direction]
        ready = self._signal_events.get()
        ready.record(torch.cuda.current_stream(self.kv.device))
        stream.wait_event(ready)  # the copy starts after the caller's queued work
        self._signal_events.put([ready])  # the wait is bound: the event may be recorded again
        layer_events: list[torch.cuda.Event] = []
        for ids in (src_ids, dst_ids):
            if ids.is_cuda:  # made or given on the caller's stream, read on the copy stream: keep them until then
                ids.record_stream(stream)
        with torch.cuda.stream(stream):
            if method in ("cuda", "triton"):  # staged once on the copy stream, shared by every layer
                src_ids, dst_ids = _ops._ids_on(src_ids, dst_ids, self.kv.device)
            # Timing events are not recorded inside a graph capture: elapsed stays None there.
            timer = None if capturing else (self._timing_events.get(), self._timing_events.get())
            if timer:
                timer[0].record(stream)
            for layer in range(self.kv.num_layers) if layerwise else [None]:
                self._copy(method, src, src_ids, dst, dst_ids, layer)
                if layerwise:
                    layer_events.append(self._signal_events.get())
                    layer_events[-1].record(stream)
            if timer:
                timer[1].record(stream)
                done_event = timer[1]
            else:
                done_event = self._signal_events.get()
                done_event.record(stream)
                layer_events.append(done_event)  # back to the signal pool with the layers
        layers = [CudaSignal(e) for e in layer_events[: self.kv.num_layers]] if layerwise else None
        transfer = Transfer(direction, num_blocks, nbytes, CudaSignal(done_event), layers, timer,
                            keepalive=(src, dst, src_ids, dst_ids))
        weakref.finalize(transfer, self._signal_events.put, layer_events)
        if timer:
            weakref.finalize(transfer, self._timing_events.put, list(timer))
        return transfer

    def _submit_cpu(self, direction: str, method: str, src: PagedKV, src_ids: torch.Tensor, dst: PagedKV,
                    dst_ids: torch.Tensor, layerwise: bool, num_blocks: int, nbytes: int) -> Transfer:
        # The worker reads the ids later, and the caller may reuse its id buffers as soon as this returns.
        src_ids, dst_ids = src_ids.clone(), dst_ids.clone()
        done = ThreadSignal()
        layers = [ThreadSignal() for _ in range(self.kv.num_layers)] if layerwise else None
        stamps: list[float] = []

        def run() -> None:
            stamps.append(time.perf_counter())
            try:
                for layer in range(self.kv.num_layers) if layers else [None]:
                    self._copy(method, src, src_ids, dst, dst_ids, layer)
                    if layers:
                        layers[layer].set()
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits
                for signal in layers or []:
                    if not signal.query():
                        signal.set(err)
                done.set(err)
                return
            stamps.append(time.perf_counter())
            done.set()

        self._workers[direction].submit(run)
        return Transfer(direction, num_blocks, nbytes, done, layers, stamps)
