"""TransferEngine: asynchronous offload and reload with ordering that cannot corrupt.

On CUDA the engine owns a least-priority copy stream per direction on the
cache's device, and sends expedited reloads (a step waits for them) to a
third, of the greatest priority (kvcopy.engine.streams says which is which).
Each transfer records an event on the caller's current stream and makes its
copy stream wait on it, so the copy reads (offload) or
writes (reload) device blocks only after all work the caller had already
queued: the producer of an offloaded block has finished, and the readers of a
reloaded block's old contents are done. Completion comes back as events in a
:class:`~kvcopy.engine.transfer.Transfer`; nothing here synchronises the host.

On CPU the same API runs on one worker thread per such queue (FIFO, like a
stream). Work the caller did before the call has finished by then, so the
ordering guarantees hold as they are.

The engine also orders its own transfers against each other, per block
(kvcopy.engine.block_order): a transfer that reads a block an unfinished one
writes, or writes a block an unfinished one reads or writes, on either side,
starts after it (its copy stream waits on that transfer's event; on CPU its
worker waits). Transfers that share no block overlap. Transfers captured in
a CUDA graph are the exception: they run at replay, so they are neither
ordered nor tracked; order replays against eager transfers yourself.

What stays the caller's job (debug mode catches what it can see: the
caller's own copy_blocks on the engine's cache or pool, and HostKVPool.free):
not writing a block being offloaded, nor reading or writing a block being
reloaded, with its own work until the transfer's ``wait``/``wait_stream``/
``wait_layer`` says so; not freeing or reusing a host or device block before
its transfer is done; keeping the cache tensors alive (the engine holds
references).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple, TypedDict

import torch

from kvcopy import _ext, dispatch
from kvcopy._checks import boolean
from kvcopy._version import warn_renamed
from kvcopy.conflicts import TransferConflictError, watch
from kvcopy.engine.block_order import BlockOrder, Blocks
from kvcopy.engine.cpu_worker import cpu_copy_job
from kvcopy.engine.streams import (
    COPY_STREAM_PRIORITY,
    EventPool,
    new_copy_stream,
    new_expedited_stream,
    release_streams,
)
from kvcopy.engine.transfer import CudaSignal, ThreadSignal, Transfer
from kvcopy.host.pool import HostKVPool
from kvcopy.ids import BlockIds
from kvcopy.layout import PagedKV
from kvcopy.methods import registry
from kvcopy.methods.choice import available_methods, choose_method
from kvcopy.methods.cta_budget import check_num_ctas
from kvcopy.methods.registry import CopyMethod
from kvcopy.methods.staging import ids_on
from kvcopy.profile import Profile, default_profile, direction_of

__all__ = ["COPY_STREAM_PRIORITY", "TransferConflictError", "TransferEngine", "engine_method"]

# The method a CUDA engine never runs: its cross-device ``.to(device)`` makes the submitting thread wait for
# every kernel the caller had queued (the forward) before the call returns, where the engine promises to return
# at once. On CPU the copy runs on the engine's worker thread anyway, so it is allowed there.
BLOCKING_METHOD = "torch"

# The method an eager transfer with host ids runs while a CUDA graph capture of the engine's transfers is in
# progress in another thread, in place of one that stages the ids on the GPU: staging goes through torch's
# pinned-memory allocator, which queries CUDA events, and global capture mode (torch.cuda.graph's default)
# forbids event queries from every thread: the staging call fails and the capture with it (seen on an H200,
# 2026-12-04). The copy engines take host ids as they are, in the batch they submit.
UNSTAGED_METHOD = "copy_engine"

# The engine's queues (a copy stream each on CUDA, a worker thread each on CPU): stores, prefetch loads, and
# expedited loads (which a step waits for), so that those never queue behind prefetch loads.
LANES = ("offload", "reload", "expedited")


def engine_method(
    method: str,
    src: PagedKV,
    dst: PagedKV,
    *,
    cuda: bool,
    host_ids: bool,
    capturing: bool = False,
    num_blocks: int = 1,
    profile: Profile | None = None,
    beside_capture: bool = False,
) -> CopyMethod:
    """The method a TransferEngine runs for this pair (``cuda``: the engine's cache is on a GPU).

    As kvcopy.dispatch.resolve, except that a CUDA engine never runs the host-blocking "torch" method: asked
    for, it is a ValueError; "auto" chooses among the other methods, and is a ValueError when none can run.
    ``beside_capture``: an eager transfer while another thread captures this engine's transfers in a CUDA
    graph; with host ids it runs "copy_engine" (UNSTAGED_METHOD) in place of a method that would stage them,
    where "copy_engine" can run for the pair (it can wherever the SM kernels can and kvcopy's extension, which
    tells a capture in progress, is built)."""

    def resolved() -> CopyMethod:
        return dispatch.resolve(
            method, src, dst, host_ids=host_ids, capturing=capturing, num_blocks=num_blocks, profile=profile
        )

    if not cuda:
        return resolved()
    asynchronous = [name for name in available_methods(src, dst) if name != BLOCKING_METHOD]
    if method == BLOCKING_METHOD:
        raise ValueError(
            f"method: {BLOCKING_METHOD!r} cannot run in a CUDA TransferEngine: its copy to the device blocks the "
            f"submitting thread until the caller's queued work (the forward) is done; use 'auto' or one of "
            f"{asynchronous}"
        )
    chosen = resolved()
    if chosen.name == BLOCKING_METHOD:
        chosen = _without_blocking_method(src, dst, asynchronous, host_ids, capturing, num_blocks, profile)
    if beside_capture and host_ids and chosen.stages_ids and UNSTAGED_METHOD in asynchronous:
        unstaged = registry.get(UNSTAGED_METHOD)
        assert unstaged is not None  # available for the pair: registered
        return unstaged
    return chosen


def _without_blocking_method(
    src: PagedKV,
    dst: PagedKV,
    asynchronous: list[str],
    host_ids: bool,
    capturing: bool,
    num_blocks: int,
    profile: Profile | None,
) -> CopyMethod:
    """What "auto" runs in a CUDA engine when it would have run "torch"; ValueError when nothing else can run."""
    # "auto" fell back to torch (nothing else ranked, or a profile measured it fastest): choose without it
    name = choose_method(
        src,
        dst,
        asynchronous,
        host_ids=host_ids,
        capturing=capturing,
        num_blocks=num_blocks,
        profile=profile if profile is not None else default_profile(),
    )
    found = registry.get(name) if name != BLOCKING_METHOD else None
    if found is None:
        raise ValueError(
            f"method: 'auto' found no copy method for a CUDA TransferEngine but {BLOCKING_METHOD!r}, which blocks "
            f"the submitting thread (methods that can run here: {available_methods(src, dst)}); build kvcopy's "
            "CUDA extension or install Triton"
        )
    return found


class _Labels(TypedDict):
    """A Transfer's keyword arguments that say what it is besides its size (TransferEngine._labels)."""

    method: str
    profile_direction: str
    observer: Callable[[Transfer], None] | None


class _Submission(NamedTuple):
    """One transfer as TransferEngine._submit resolved it, handed to the CUDA or the CPU path to run."""

    direction: str
    lane: str
    method: CopyMethod
    src: PagedKV
    src_ids: torch.Tensor
    dst: PagedKV
    dst_ids: torch.Tensor
    layerwise: bool
    num_blocks: int
    nbytes: int
    after: list[Transfer]  # the engine's earlier transfers (of other lanes) that touch its blocks


class TransferEngine:
    """Asynchronous offloads (device pages -> host pool) and reloads (host pool -> device pages).

    Transfers that touch a common block, on either side, run in the order they were submitted; others
    overlap. A context manager: leaving it (or :meth:`close`) waits for every transfer in flight.

    Parameters:

    - ``kv``: the engine's cache (a PagedKV).
    - ``host``: the host pool its blocks go to (a HostKVPool laid out like ``kv``).
    - ``method``: the copy method for both directions ("auto" by default, see kvcopy.copy_blocks). A CUDA engine
      never runs "torch", which would block the submitting thread, and runs "copy_engine" for an eager transfer
      with host ids while another thread captures its transfers in a CUDA graph (:func:`engine_method`).
    - ``profile``: the calibrated Profile "auto" consults (default: kvcopy's default profile, see
      kvcopy.profile.default_profile).
    - ``debug`` (or ``KVCOPY_DEBUG=1``): raise TransferConflictError when the caller's own ``copy_blocks`` on
      this engine's cache or pool, or ``HostKVPool.free``, would touch a block an unfinished transfer uses
      (reads what it writes, or writes what it reads or writes).
    - ``num_ctas``: the CTAs each SM-kernel copy may use, as kvcopy.copy_blocks' ``num_ctas`` (None: its
      host-memory default of 4).
    - ``observer``: called once with each transfer that finished without error (its ``turnaround``,
      ``queued``, ``elapsed``, ``profile_direction``, ``method``, bytes and blocks are set), e.g.
      ``OnlineProfile.observe_copy``'s feed. On a CPU the worker that ran the copy calls it, before the
      transfer reads as done; on CUDA whoever first finds the transfer done (its ``done()``, ``wait()``, the
      engine's next submission). It must be quick; its errors are logged.
    - ``sm_budget``: deprecated spelling of ``num_ctas``.
    """

    def __init__(
        self,
        kv: PagedKV,
        host: HostKVPool,
        *,
        method: str = "auto",
        profile: Profile | None = None,
        debug: bool | None = None,
        num_ctas: int | None = None,
        observer: Callable[[Transfer], None] | None = None,
        sm_budget: int | None = None,
    ) -> None:
        if not isinstance(kv, PagedKV):
            raise TypeError(f"kv: expected a PagedKV, got {type(kv).__name__}")
        if not isinstance(host, HostKVPool):
            raise TypeError(f"host: expected a HostKVPool, got {type(host).__name__}")
        dispatch.check_pair(kv, host.paged, ("kv", "host"))
        dispatch.check_copyable(kv, host.paged, ("kv", "host"))
        dispatch.check_method(method)
        if profile is not None and not isinstance(profile, Profile):
            raise TypeError(f"profile: expected a Profile or None, got {type(profile).__name__}")
        self.kv = kv
        self.host = host
        self.profile = profile
        self.debug = os.environ.get("KVCOPY_DEBUG") == "1" if debug is None else boolean("debug", debug)
        if sm_budget is not None:
            warn_renamed("TransferEngine(sm_budget=...)", "TransferEngine(num_ctas=...)")
            if num_ctas is not None:
                raise TypeError("TransferEngine: give num_ctas (or its deprecated spelling sm_budget), not both")
            num_ctas = sm_budget
        self.num_ctas = check_num_ctas(num_ctas)
        if observer is not None and not callable(observer):
            raise TypeError(f"observer: expected a callable or None, got {type(observer).__name__}")
        self.observer = observer
        self._method = method
        self._order = BlockOrder()  # the transfers in flight, by block
        self._lock = threading.Lock()  # guards _order: transfers may come from many threads
        self._closed = False
        self._cuda = kv.device.type == "cuda"
        # Resolve once, so that bad methods (and "torch" on CUDA) fail here and not on the first transfer.
        for src, dst in ((kv, host.paged), (host.paged, kv)):
            engine_method(method, src, dst, cuda=self._cuda, host_ids=True, profile=profile)
        for i in range(kv.num_layers):  # layer views (and their plane tables) made now, off the hot path
            kv.layer(i), host.paged.layer(i)
        if self.debug:
            watch(kv, "device", self)
            watch(host.paged, "host", self)
        if self._cuda:
            self._streams = {
                "offload": new_copy_stream(self.kv.device),
                "reload": new_copy_stream(self.kv.device),
                "expedited": new_expedited_stream(self.kv.device),
            }
            owned = [s.cuda_stream for s in self._streams.values() if isinstance(s, torch.cuda.ExternalStream)]
            # Handed back for the next engine at close(), or when the engine is collected without one; never
            # destroyed, so the allocator's record_stream events of ids freed later still find them.
            self._owned_streams = owned  # capture streams made later join them
            self._stream_finalizer = weakref.finalize(self, release_streams, self.kv.device.index, owned)
            # Captures get streams of their own, per direction and capturing stream: eager transfers queued
            # meanwhile on the shared copy streams must run, not join someone's graph.
            self._capture_streams: dict[tuple[str, int], torch.cuda.Stream] = {}
            self._captures: set[int] = set()  # caller streams seen capturing this engine's transfers
            self._captures_lock = threading.Lock()
            self._captured_any = False
            self._signal_events = EventPool(enable_timing=False)
            self._timing_events = EventPool(enable_timing=True)
        else:
            self._workers = {
                lane: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvcopy-{lane}") for lane in LANES
            }

    def _capture_in_progress(self) -> bool:
        """Whether a caller stream is still capturing one of this engine's transfers. While one is
        (global capture mode), a cudaEventQuery from any thread would invalidate that capture, so the
        engine's transfers answer done() with False and wait() waits for the capture to end, and eager
        transfers with host ids run UNSTAGED_METHOD."""
        if not self._captures:
            return False
        module = _ext.extension()
        if module is None or not hasattr(module, "stream_is_capturing"):
            return False  # built without CUDA kernels: no way to ask about another thread's stream
        with self._captures_lock:  # done() may run in any thread, beside a submission adding a capture
            for handle in [h for h in self._captures if not module.stream_is_capturing(h)]:
                self._captures.discard(handle)
            return bool(self._captures)

    def _stream_for(self, lane: str, capturing: bool) -> torch.cuda.Stream:
        if not capturing:
            return self._streams[lane]
        caller = torch.cuda.current_stream(self.kv.device).cuda_stream
        with self._captures_lock:
            self._captures.add(caller)
        self._captured_any = True
        key = (lane, caller)
        if key not in self._capture_streams:
            self._capture_streams[key] = (
                new_expedited_stream(self.kv.device) if lane == "expedited" else new_copy_stream(self.kv.device)
            )
            if isinstance(self._capture_streams[key], torch.cuda.ExternalStream):
                self._owned_streams.append(self._capture_streams[key].cuda_stream)
        return self._capture_streams[key]

    # ----------------------------------------------------------------- public API

    def offload(self, block_ids: BlockIds, host_ids: BlockIds) -> Transfer:
        """Copies device blocks ``block_ids`` to host blocks ``host_ids``; returns at once.

        The device blocks are read only after all work already queued on the
        caller's current stream has finished.
        """
        return self._submit(
            "offload", "offload", self.kv, block_ids, "block_ids", self.host.paged, host_ids, "host_ids", False
        )

    def reload(
        self, host_ids: BlockIds, block_ids: BlockIds, *, layerwise: bool = False, expedited: bool = False
    ) -> Transfer:
        """Copies host blocks ``host_ids`` into device blocks ``block_ids``; returns at once.

        The device blocks are written only after all work already queued on the
        caller's current stream. ``layerwise``: copy layer by layer and signal
        each (``Transfer.wait_layer``), so attention of layer l can start as soon
        as layer l has arrived. ``expedited``: the caller will wait for it soon (the next step reads it): it runs
        on a queue of its own, of the greatest priority on CUDA, and does not wait behind other reloads (only
        behind transfers that touch its blocks).
        """
        layerwise = boolean("layerwise", layerwise)
        lane = "expedited" if boolean("expedited", expedited) else "reload"
        return self._submit(
            "reload", lane, self.host.paged, host_ids, "host_ids", self.kv, block_ids, "block_ids", layerwise
        )

    def close(self) -> None:
        """Waits for every transfer in flight (their errors stay with their handles), then frees the streams or
        workers. If any transfer was captured in a CUDA graph, it also waits for the device, so replays queued
        before the call are done; do not replay those graphs after it."""
        with self._lock:  # from here on, new transfers are refused
            if self._closed:
                return
            self._closed = True
            in_flight = self._order.unfinished()
        for transfer in in_flight:
            with contextlib.suppress(Exception):
                transfer.wait()
        if not self._cuda:
            for worker in self._workers.values():
                worker.shutdown(wait=True)
            return
        for lane, stream in self._streams.items():
            if lane != "expedited":  # a torch pool stream, maybe shared: its transfers were waited for above
                stream.synchronize()  # every transfer was waited for above
        if self._captured_any:
            # A graph replays its captured copies on the stream that replays it, not on the engine's:
            # wait for the device, so no replay queued before close still reads the pool (replaying such a
            # graph after close is the caller's error: the pool may be unpinned by then).
            torch.cuda.synchronize(self.kv.device)
        self._streams.clear()
        self._capture_streams.clear()
        self._stream_finalizer()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def num_in_flight(self) -> int:
        """Transfers submitted and not yet seen done."""
        with self._lock:
            return len(self._order.unfinished())

    # ----------------------------------------------------------------- submission

    def _submit(
        self,
        direction: str,
        lane: str,
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
        src_t, dst_t, host_ids = dispatch.prepare_pair(src, src_ids, dst, dst_ids, (src_name, dst_name))
        capturing = self._cuda and torch.cuda.is_current_stream_capturing()
        method = engine_method(
            self._method,
            src,
            dst,
            cuda=self._cuda,
            host_ids=host_ids,
            capturing=capturing,
            num_blocks=src_t.numel(),
            profile=self.profile,
            beside_capture=self._cuda and not capturing and host_ids and self._capture_in_progress(),
        )
        # A captured transfer runs at replay, not now: it is neither tracked nor waited for at close.
        num_blocks = src_t.numel()
        nbytes = num_blocks * self.kv.nbytes_per_block
        with self._lock:  # order, submit and record as one step, so two threads cannot interleave them
            if self._closed:
                raise RuntimeError(f"{direction}: this TransferEngine is closed")
            reads, writes = self._blocks(direction, src_t, dst_t, host_ids)
            # Transfers of one lane share a stream (worker): they already run in submission order.
            after = [] if capturing else [t for t in self._order.dependencies(reads, writes) if t.lane != lane]
            job = _Submission(direction, lane, method, src, src_t, dst, dst_t, layerwise, num_blocks, nbytes, after)
            transfer = self._submit_cuda(job, capturing) if self._cuda else self._submit_cpu(job)
            if not capturing:
                self._order.add(transfer, reads, writes)
        return transfer

    @staticmethod
    def _blocks(
        direction: str, src_ids: torch.Tensor, dst_ids: torch.Tensor, host_ids: bool
    ) -> tuple[Blocks | None, Blocks | None]:
        """The blocks a transfer reads and writes, per side; None where the ids live on the GPU."""
        if not host_ids:
            return None, None
        src_side, dst_side = ("device", "host") if direction == "offload" else ("host", "device")
        return {src_side: set(src_ids.tolist())}, {dst_side: set(dst_ids.tolist())}

    def caller_conflict(self, side: str, blocks: list[int], *, writes: bool) -> tuple[int, Transfer, str] | None:
        """Debug mode (kvcopy.conflicts.check_caller asks): what the caller's own work on these blocks would
        conflict with.
        The caller's work is queued on its current stream, which wait_stream may have ordered already."""
        stream = torch.cuda.current_stream(self.kv.device).cuda_stream if self._cuda else None
        with self._lock:
            return self._order.conflict(side, blocks, writes=writes, stream=stream)

    def _labels(self, method: CopyMethod, src: PagedKV, dst: PagedKV) -> _Labels:
        """What a Transfer says of itself besides its size: method, its direction in a Profile's terms, and who
        observes it."""
        profile_direction = direction_of(src.device.type, dst.device.type)
        return _Labels(method=method.name, profile_direction=profile_direction, observer=self.observer)

    def _copy(
        self,
        method: CopyMethod,
        src: PagedKV,
        src_ids: torch.Tensor,
        dst: PagedKV,
        dst_ids: torch.Tensor,
        layer: int | None,
    ) -> None:
        if layer is not None:
            src, dst = src.layer(layer), dst.layer(layer)
        dispatch.run(method, src, src_ids, dst, dst_ids, self.num_ctas)

    def _submit_cuda(self, job: _Submission, capturing: bool) -> Transfer:
        direction, lane, method, src, src_ids, dst, dst_ids, layerwise, num_blocks, nbytes, after = job
        stream = self._stream_for(lane, capturing)
        # Timed outside a capture: the submission on the caller's stream (see kvcopy.engine.transfer.Timer).
        ready = self._signal_events.get() if capturing else self._timing_events.get()
        ready.record(torch.cuda.current_stream(self.kv.device))
        stream.wait_event(ready)  # the copy starts after the caller's queued work
        if capturing:
            self._signal_events.put([ready])  # the wait is bound: the event may be recorded again
        for earlier in after:  # and after the engine's own transfers that touch its blocks
            earlier.wait_stream(stream)
        layer_events: list[torch.cuda.Event] = []
        for ids in (src_ids, dst_ids):
            if ids.is_cuda:  # made or given on the caller's stream, read on the copy stream: keep them until then
                ids.record_stream(stream)
        with torch.cuda.stream(stream):
            if method.stages_ids:  # staged once on the copy stream, shared by every layer
                src_ids, dst_ids = ids_on(src_ids, dst_ids, self.kv.device)
            # Timing events are not recorded inside a graph capture: elapsed stays None there.
            timer = None if capturing else (ready, self._timing_events.get(), self._timing_events.get())
            if timer:
                timer[1].record(stream)
            for layer in range(self.kv.num_layers) if layerwise else [None]:
                self._copy(method, src, src_ids, dst, dst_ids, layer)
                if layerwise:
                    layer_events.append(self._signal_events.get())
                    layer_events[-1].record(stream)
            if timer:
                timer[2].record(stream)
                done_event = timer[2]
            else:
                done_event = self._signal_events.get()
                done_event.record(stream)
                layer_events.append(done_event)  # back to the signal pool with the layers
        unsafe = weakref.WeakMethod(self._capture_in_progress)
        layers = [CudaSignal(e, unsafe) for e in layer_events[: self.kv.num_layers]] if layerwise else None
        transfer = Transfer(
            direction,
            num_blocks,
            nbytes,
            CudaSignal(done_event, unsafe),
            layers,
            timer,
            keepalive=(src, dst, src_ids, dst_ids),
            lane=lane,
            **self._labels(method, src, dst),
        )
        weakref.finalize(transfer, self._signal_events.put, layer_events)
        if timer:
            weakref.finalize(transfer, self._timing_events.put, list(timer))
        return transfer

    def _submit_cpu(self, job: _Submission) -> Transfer:
        direction, lane, method, src, src_ids, dst, dst_ids, layerwise, num_blocks, nbytes, after = job
        # The worker reads the ids later, and the caller may reuse its id buffers as soon as this returns.
        src_ids, dst_ids = src_ids.clone(), dst_ids.clone()
        done = ThreadSignal()
        layers = [ThreadSignal() for _ in range(self.kv.num_layers)] if layerwise else None
        stamps = [time.perf_counter()]  # submitted; the worker adds started and ended (kvcopy.engine.transfer.Timer)
        transfer = Transfer(
            direction, num_blocks, nbytes, done, layers, stamps, lane=lane, **self._labels(method, src, dst)
        )

        def copy(layer: int | None) -> None:
            self._copy(method, src, src_ids, dst, dst_ids, layer)

        run = cpu_copy_job(copy, self.kv.num_layers, after, transfer, done, layers, stamps)
        self._workers[lane].submit(run)
        return transfer
