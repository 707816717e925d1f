"""kvcopy as transformers' continuous-batching ``OffloadingManager``.

Imported only after :mod:`._hf_compat` has checked the installed transformers.
transformers keeps deciding *which* requests to preempt (its
``offload_requests`` is inherited unchanged); this class decides *what happens
to their KV* and moves it:

- offload: the victims' blocks of each cache allocator go to the host pool in
  one :class:`~kvcopy.TransferEngine` submission on a copy stream, ordered
  after the forward that produced them; the host never waits on it;
- ordering, by construction: a batch that writes device blocks an unfinished
  offload still reads (a new request given the freed blocks, a reload into
  them, a fork's copy) first makes the compute stream wait on that offload's
  event; a reload of host blocks an unfinished offload still writes runs
  after it (the TransferEngine orders its own transfers). Everything else
  overlaps;
- reload: one submission per allocator into the blocks transformers' scheduler
  gave the request, which the next forward waits for (an event wait on the
  compute stream; on a CPU the thread waits);
- the choice per victim (reload or recompute) comes from the session's policy
  and Planner; a victim kvcopy drops is soft reset by transformers as usual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.utils import stream_context

from kvcopy.engine.engine import TransferEngine
from kvcopy.engine.transfer import Transfer
from kvcopy.integrations.common.offload_session import OffloadSession
from kvcopy.integrations.common.offload_stats import OffloadDecision
from kvcopy.integrations.common.path_clock import ForwardRequest, PathClock, StreamTimer
from kvcopy.layout import PagedKV

__all__ = ["KvcopyOffloadingManager"]


@dataclass(frozen=True, eq=False)
class _Offload:
    """An offload in flight: the device memory it still reads, the host blocks it writes."""

    transfer: Transfer
    allocator: str
    device_units: frozenset[int]
    host_ids: frozenset[int]


class KvcopyOffloadingManager(OffloadingManager):
    """transformers' OffloadingManager with kvcopy's host pool, copy engine and decisions.

    Built by transformers' ContinuousBatchProcessor with the base class's
    arguments (bound to a session by ``kvcopy.integrations.transformers``);
    ``cpu_offload_space_gib`` and ``safety_threshold`` are not used: the host
    pool is the session's (``host_gib``).
    """

    def __init__(
        self,
        cache: Any,
        scheduler: Any,
        cpu_offload_space_gib: float | None,
        safety_threshold: float,
        compute_stream: Any,
        distributed_helper: Any,
        *,
        session: OffloadSession,
    ) -> None:
        # Not the base __init__: it would pin a CPU pool of its own (which fails without a GPU).
        del cpu_offload_space_gib, safety_threshold, distributed_helper
        self.cache = cache
        self.scheduler = scheduler
        self._compute_stream = compute_stream
        self._cpu_pool = None  # transformers' own pool is never made
        self._cpu_views: dict[str, Any] = {}
        self._request_id_to_cpu_blocks: dict[str, dict[str, list[int]]] = {}  # request -> allocator -> host ids
        self._session = session
        allocators = cache.cache_allocators
        caches = {name: PagedKV.from_planes([allocator._copy_view]) for name, allocator in allocators.items()}
        pools = session.pools_for(caches)
        live = session.live
        self._engines = {
            name: TransferEngine(
                caches[name], pool, method=session.method, profile=session.profile, observer=live.observe_transfer
            )
            for name, pool in pools.items()
            if pool is not None
        }
        # Allocators view one cache tensor with different block sizes, and a sector one allocator frees may go
        # to another: overlap is judged in units of the largest size dividing every block.
        self._unit = math.gcd(*(allocator.bytes_per_block for allocator in allocators.values()))
        self._offloads: list[_Offload] = []
        self._awaiting: dict[str, OffloadDecision] = {}  # preempted, not scheduled again yet
        # On CUDA the forward's seconds are the compute stream's (transformers' asynchronous batching prepares the
        # next batch while this one runs); on a CPU, the host's.
        on_gpu = next(iter(caches.values())).device.type == "cuda"
        self._clock = PathClock(live, timer=StreamTimer(compute_stream) if on_gpu else None)
        self._detached = False
        cache.perform_cache_copy = self._ordered_fork_copy(cache.perform_cache_copy)  # this cache only

    # ------------------------------------------------------------------ ordering

    def _units(self, allocator: str, block_ids: Iterable[int]) -> set[int]:
        per_block = self.cache.cache_allocators[allocator].bytes_per_block // self._unit
        return {block * per_block + i for block in block_ids for i in range(per_block)}

    def _wait_for_offloads(self, device_units: Callable[[], set[int]]) -> None:
        """Makes the compute stream wait for unfinished offloads that read any of ``device_units()`` (the
        memory about to be written; only computed while an offload is in flight); forgets finished ones. An
        offload waited for stays listed until it is done: the host blocks it writes are in use until then.
        (A reload of host blocks an offload still writes needs nothing here: the engine orders its own
        transfers.)"""
        self._offloads = [o for o in self._offloads if not o.transfer.done()]
        if not self._offloads:
            return
        written = device_units()
        with stream_context(self._compute_stream):
            for offload in self._offloads:
                if offload.device_units & written:
                    offload.transfer.wait_stream()

    def _ordered_fork_copy(self, perform_cache_copy: Any) -> Any:
        def ordered(copy_src_and_dst: dict[str, tuple[list[int], list[int]]]) -> None:
            self._wait_for_offloads(
                lambda: set().union(*(self._units(name, dst) for name, (_, dst) in copy_src_and_dst.items()))
            )
            perform_cache_copy(copy_src_and_dst)

        return ordered

    # ------------------------------------------------------------------ offload

    def _decide(self, state: Any, tables: dict[str, list[int]]) -> OffloadDecision:
        total = len(state.initial_tokens) + len(state.generated_tokens)
        cached = state.position_offset
        if state.status == RequestStatus.DECODING and cached == total:
            cached -= 1  # in flight in async batching: transformers rolls the last token back
        allocators = self.cache.cache_allocators
        return self._session.decide(
            state.request_id,
            prefix_tokens=cached,
            new_tokens=total - cached,
            reload_blocks=sum(len(blocks) for blocks in tables.values()),
            reload_nbytes=sum(len(blocks) * allocators[name].bytes_per_block for name, blocks in tables.items()),
            max_forward_tokens=getattr(self.cache, "max_batch_tokens", None),
        )

    def _offload_to_cpu(self, victims: list[Any], victim_block_tables: dict[str, dict[str, list[int]]]) -> set[str]:
        """Keeps the KV of the victims the policy reloads (while the host pool has room); the rest are soft reset."""
        if self._detached:
            return set()
        device_ids: dict[str, list[int]] = {name: [] for name in self._engines}
        host_ids: dict[str, list[int]] = {name: [] for name in self._engines}
        kept: set[str] = set()
        for state in victims:
            request_id = state.request_id
            self._clock.forget(request_id)  # preempted again before catching up: that path is not measured
            tables = {name: blocks for name, blocks in victim_block_tables[request_id].items() if blocks}
            decision = self._decide(state, tables)
            reserved = None
            if decision.action == "reload":
                reserved = (
                    self._session.reserve({name: len(blocks) for name, blocks in tables.items()}) if tables else None
                )
                if reserved is None:
                    decision.action = "recompute"
                    decision.reason = "host pool full" if tables else "nothing cached"
            self._session.record(decision, decision.reload_blocks if reserved else 0)
            self._awaiting[request_id] = decision
            if reserved is None:
                continue
            self._request_id_to_cpu_blocks[request_id] = reserved
            for name, blocks in tables.items():
                device_ids[name].extend(blocks)
                host_ids[name].extend(reserved[name])
            state.is_cpu_offloaded = True
            kept.add(request_id)
        with stream_context(self._compute_stream):  # ordered after the forward that wrote these blocks
            for name, ids in device_ids.items():
                if ids:
                    transfer = self._engines[name].offload(ids, host_ids[name])
                    self._offloads.append(
                        _Offload(transfer, name, frozenset(self._units(name, ids)), frozenset(host_ids[name]))
                    )
        return kept

    # ------------------------------------------------------------------ reload

    def restore_scheduled_requests(self, requests_in_batch: list[Any]) -> None:
        """Reloads the offloaded requests of the batch transformers just scheduled, before its forward."""
        self._clock.stop()  # the previous forward has ended
        allocators = self.cache.cache_allocators
        device_ids: dict[str, list[int]] = {name: [] for name in self._engines}
        host_ids: dict[str, list[int]] = {name: [] for name in self._engines}
        releases: dict[str, list[int]] = {name: [] for name in self._engines}
        restored: dict[str, dict[str, int]] = {}  # request -> allocator -> blocks reloaded
        for future_state in requests_in_batch:
            state = future_state.state
            decision = self._awaiting.pop(state.request_id, None)
            if decision is not None:
                self._clock.resumed(state.request_id, decision)
            if not state.is_cpu_offloaded:
                continue
            counts = restored[state.request_id] = {}
            for name, ids in self._request_id_to_cpu_blocks.pop(state.request_id).items():
                # Positional pairing, as transformers does: the k-th host block is the k-th block of the table.
                table = allocators[name].block_table.get(state.request_id, [])
                n = counts[name] = min(len(ids), len(table))
                device_ids[name].extend(table[:n])
                host_ids[name].extend(ids[:n])
                releases[name].extend(ids)
            state.is_cpu_offloaded = False
            if self.cache.use_prefix_sharing:  # restored blocks are fresh: the next update hashes them (as the base)
                for name, allocator in allocators.items():
                    restored_blocks = state.position_offset // allocator.tokens_per_page
                    if restored_blocks:
                        future_state.complete_blocks[name] = future_state.complete_blocks.get(name, 0) + restored_blocks
        self._wait_for_offloads(
            lambda: set().union(  # this batch writes into every block of its requests
                *(
                    self._units(name, allocators[name].block_table.get(f.state.request_id, []))
                    for f in requests_in_batch
                    for name in allocators
                )
            )
        )
        transfers: dict[str, Transfer] = {}
        try:
            with stream_context(self._compute_stream):
                for name, ids in device_ids.items():
                    if ids:
                        transfers[name] = self._engines[name].reload(host_ids[name], ids)
                        transfers[name].wait_stream()  # the forward that reads them comes after
        finally:  # also when a submission fails: these host blocks belong to no request any more
            for name, ids in releases.items():
                if ids:
                    reload = [transfers[name]] if name in transfers else []
                    self._session.release(name, ids, after=reload + self._offloads_writing(name, ids))
        self._clock.reloaded(list(restored), list(transfers.values()))
        if restored:
            self._session.count_reloaded(len(restored))
        self._clock.start(
            [
                ForwardRequest(f.state.request_id, f.query_length, f.state.position_offset, f.has_new_token)
                for f in requests_in_batch
            ]
        )

    # ------------------------------------------------------------------ freeing

    def _offloads_writing(self, name: str, ids: list[int]) -> list[Transfer]:
        """The unfinished offloads that write any of these host blocks."""
        wanted = set(ids)
        return [o.transfer for o in self._offloads if o.allocator == name and o.host_ids & wanted]

    def free_request_cpu_cache(self, state: Any) -> None:
        """Frees a cancelled or failed request's host blocks (once a copy still writing them is done)."""
        self._awaiting.pop(state.request_id, None)
        self._clock.forget(state.request_id)
        host = self._request_id_to_cpu_blocks.pop(state.request_id, None)
        state.is_cpu_offloaded = False
        for name, ids in (host or {}).items():
            self._session.release(name, ids, after=self._offloads_writing(name, ids))

    def reset(self) -> None:
        """A new generation run on the same processor: nothing of the last one stays on the host."""
        self.free_all_waiting_cpu_caches()
        for request_id in list(self._request_id_to_cpu_blocks):
            for name, ids in self._request_id_to_cpu_blocks.pop(request_id).items():
                self._session.release(name, ids, after=self._offloads_writing(name, ids))
        self._clock.drop_forward()  # not charged: the time since it ended may be idle
        self._clock.settle(wait=True)
        self._awaiting.clear()
        self._clock.clear()

    def detach(self) -> None:
        """The offloading context is closing: finish every copy, give requests still on the host back to
        transformers as soft resets, and take kvcopy out of this cache."""
        if self._detached:
            return
        self._detached = True
        for engine in self._engines.values():
            engine.close()
        self._clock.settle()
        for request_id in list(self._request_id_to_cpu_blocks):
            state = self.scheduler.waiting_requests.get(request_id)
            if state is not None and state.is_cpu_offloaded:
                state.is_cpu_offloaded = False
                self.scheduler.waiting_requests[request_id] = state.create_equivalent_initial_request()
        self._request_id_to_cpu_blocks.clear()
        self._offloads.clear()
        self._engines = {}
        self.cache.__dict__.pop("perform_cache_copy", None)
