"""The engine-independent half of an offloading context: host pools, decisions, deferred frees, counters.

An engine adapter (e.g. transformers' continuous batching) owns the device
side and the engine's bookkeeping; the session owns what outlives one
generation run: the host pool per cache allocator, the Planner and the policy
that decide per preempted request, host blocks whose copies are still in
flight, and the :class:`OffloadStats` the user reads. Thread-safe: the engine
runs in its own thread while the user reads the counters.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Literal

from kvcopy.engine.transfer import Transfer
from kvcopy.host.pool import HostKVPool
from kvcopy.integrations.common.offload_stats import OffloadAction, OffloadDecision, OffloadStats
from kvcopy.integrations.common.online_planner import OnlinePlanner, predict_paths
from kvcopy.layout import PagedKV
from kvcopy.planner.decision import seconds_text
from kvcopy.profile import Profile

__all__ = ["POLICIES", "OffloadSession", "Policy"]

Policy = Literal["auto", "offload", "recompute"]
POLICIES: tuple[Policy, ...] = ("auto", "offload", "recompute")

logger = logging.getLogger("kvcopy.integrations")


class OffloadSession:
    """Host pools, the reload-or-recompute choice, and counters for one offloading context.

    ``host_bytes`` is split between the engine's cache allocators in proportion
    to their block sizes (a request holds about as many blocks in each).
    ``live``: the Planner of the moment (learning from the engine, or the
    calibrated one); while it has none, ``"auto"`` behaves as ``"offload"``.
    ``profile``: the calibrated profile the copy engines' ``method="auto"`` reads.
    """

    def __init__(
        self, *, host_bytes: int, policy: Policy, live: OnlinePlanner, method: str, profile: Profile | None
    ) -> None:
        self.host_bytes = host_bytes
        self.policy = policy
        self.live = live
        self.method = method
        self.profile = profile
        self.stats = OffloadStats(_blocks_in_use=self.host_blocks_in_use, _profile=live.profile)
        self.closed = False
        self._lock = threading.RLock()
        self._pools: dict[str, HostKVPool | None] = {}
        self._pool_layout: tuple[tuple[str, int, str], ...] | None = None
        # host ids freed once the copies that use them are done
        self._deferred: list[tuple[tuple[Transfer, ...], str, list[int]]] = []

    # ------------------------------------------------------------------ host pools

    def pools_for(self, caches: Mapping[str, PagedKV]) -> dict[str, HostKVPool | None]:
        """The host pool of each cache allocator (None where ``host_bytes`` holds no block of it).

        Made at the first call; a later engine run with the same block sizes
        reuses them, one with other sizes gets new pools once the old ones hold
        nothing.
        """
        layout = tuple((name, kv.nbytes_per_block, str(kv.device)) for name, kv in caches.items())
        with self._lock:
            if self.closed:
                raise RuntimeError("offloading: this context is closed")
            if layout == self._pool_layout:
                return self._pools
            self.retire()
            if self.host_blocks_in_use():
                raise RuntimeError("offloading: a new cache layout while the host pool still holds offloaded blocks")
            self._close_pools()
            weights = sum(kv.nbytes_per_block for kv in caches.values())
            for name, kv in caches.items():
                num_blocks = self.host_bytes * kv.nbytes_per_block // weights // kv.nbytes_per_block
                if num_blocks < 1:
                    warnings.warn(
                        f"offloading: host_gib={self.host_bytes / 2**30:g} holds no {kv.nbytes_per_block}-"
                        f"byte block of {name!r}; its requests are recomputed",
                        stacklevel=2,
                    )
                self._pools[name] = HostKVPool(kv, num_blocks) if num_blocks >= 1 else None
            self._pool_layout = layout
            return self._pools

    def _close_pools(self) -> None:
        for pool in self._pools.values():
            if pool is not None:
                pool.close()
        self._pools.clear()
        self._pool_layout = None

    def reserve(self, counts: Mapping[str, int]) -> dict[str, list[int]] | None:
        """Host ids for ``counts[name]`` blocks of each allocator, all or none (None: a pool is full)."""
        with self._lock:
            self.retire()
            pools: dict[str, HostKVPool] = {}
            for name, n in counts.items():
                pool = self._pools.get(name)
                if pool is None or pool.num_free < n:
                    return None
                pools[name] = pool
            return {name: pools[name].allocate(n).tolist() for name, n in counts.items()}

    def release(self, name: str, host_ids: list[int], after: Sequence[Transfer] = ()) -> None:
        """Returns host blocks to their pool, at once or once every copy in ``after`` (copies that use them)
        is done."""
        with self._lock:
            pending = tuple(t for t in after if not t.done())
            if pending:
                self._deferred.append((pending, name, host_ids))
                return
            self._free(name, host_ids)

    def _free(self, name: str, host_ids: list[int]) -> None:
        pool = self._pools.get(name)
        if pool is not None and host_ids:
            pool.free(host_ids)

    def retire(self, *, wait: bool = False) -> None:
        """Frees the host blocks of copies that have finished (all of them, waiting, with ``wait``)."""
        with self._lock:
            still: list[tuple[tuple[Transfer, ...], str, list[int]]] = []
            for transfers, name, host_ids in self._deferred:
                if wait:
                    for transfer in transfers:
                        try:
                            transfer.wait()
                        except Exception:  # a failed copy's blocks are free all the same
                            logger.exception("offloading: a copy failed; its host blocks are freed")
                if all(transfer.done() for transfer in transfers):
                    self._free(name, host_ids)
                else:
                    still.append((transfers, name, host_ids))
            self._deferred = still

    def host_blocks_in_use(self) -> int:
        """Host blocks allocated now, after freeing those whose copies have finished."""
        with self._lock:
            self.retire()
            return sum(pool.num_blocks - pool.num_free for pool in self._pools.values() if pool is not None)

    # ------------------------------------------------------------------ decisions

    def decide(
        self,
        request_id: str,
        *,
        prefix_tokens: int,
        new_tokens: int,
        reload_blocks: int,
        reload_nbytes: int,
        max_forward_tokens: int | None = None,
        cached_tokens: int = 0,
    ) -> OffloadDecision:
        """Reload (keep the KV on the host) or recompute, by the policy and the Planner of the moment; not yet
        counted. Both paths are predicted in the terms they are measured in (kvcopy.integrations.common.online_planner):
        forwards of at most ``max_forward_tokens`` (the engine's batch token budget; None: one forward), after
        ``cached_tokens`` the device holds either way."""
        planner, observations = self.live.current()
        predicted_reload = predicted_recompute = None
        if planner is not None:
            predicted_reload, predicted_recompute = predict_paths(
                planner, prefix_tokens, new_tokens, reload_nbytes, max_forward_tokens, cached_tokens=cached_tokens
            )
        action: OffloadAction
        if self.policy == "recompute":
            action, reason = "recompute", "policy 'recompute'"
        elif self.policy == "offload" or planner is None:
            action, reason = "reload", f"policy '{self.policy}'" + ("" if planner else " (no profile)")
        else:  # the engine reloads or recomputes whole requests: no split, so the cheaper of the two
            assert predicted_reload is not None and predicted_recompute is not None  # a planner predicted both
            action = "reload" if predicted_reload <= predicted_recompute else "recompute"
            source = f"learned from {observations} observations" if observations else "calibrated"
            reason = (
                f"planner ({source}): reload {seconds_text(predicted_reload)} vs recompute "
                f"{seconds_text(predicted_recompute)} for {prefix_tokens} cached + {new_tokens} new tokens"
            )
        return OffloadDecision(
            request_id=request_id,
            prefix_tokens=prefix_tokens,
            new_tokens=new_tokens,
            reload_blocks=reload_blocks,
            reload_nbytes=reload_nbytes,
            action=action,
            reason=reason,
            predicted_reload_s=predicted_reload,
            predicted_recompute_s=predicted_recompute,
            observations=observations,
        )

    def record(self, decision: OffloadDecision, offloaded_blocks: int = 0) -> None:
        """Counts a decision as carried out (``offloaded_blocks`` copied to the host for a reload)."""
        with self._lock:
            self.stats.decisions.append(decision)
            if decision.action == "reload":
                self.stats.offloaded_requests += 1
                self.stats.offloaded_blocks += offloaded_blocks
            else:
                self.stats.recomputed_requests += 1

    def count_reloaded(self, requests: int) -> None:
        with self._lock:
            self.stats.reloaded_requests += requests

    # ------------------------------------------------------------------ end

    def close(self) -> None:
        """Waits for every copy in flight, frees its host blocks and unpins the pools."""
        with self._lock:
            self.retire(wait=True)
            self._close_pools()
            self.closed = True
