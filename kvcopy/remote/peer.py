"""KVPeer: one NIXL agent that registers a HostKVPool (or an engine's PagedKV) and moves its blocks to and from
other peers."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from kvcopy.cachekey.key import context_hash_of
from kvcopy.host.pool import HostKVPool
from kvcopy.ids import BlockIds, as_ids, check_host_pair
from kvcopy.layout import PagedKV
from kvcopy.nixl.agent import nixl_module
from kvcopy.nixl.registration import registration_of
from kvcopy.nixl.transfer import NixlTransfer as RemoteTransfer
from kvcopy.nixl.transfer import RemoteTransferError, RemoteTransferTimeout, WrittenBlocks
from kvcopy.ranges import plan_table_ranges
from kvcopy.remote.descriptor import PoolLayout, decode, encode
from kvcopy.remote.quarantine import Quarantine

__all__ = ["KVPeer", "RemotePool", "RemoteTransfer", "RemoteTransferError", "RemoteTransferTimeout"]


@dataclass(frozen=True)
class RemotePool:
    """A connected peer's pool: its agent's name, layout and block count (from its descriptor)."""

    agent: str
    layout: PoolLayout
    plane_table: torch.Tensor = field(repr=False, compare=False)  # its planes at the owner's addresses (planning)
    connected_by: str = ""  # the name of the KVPeer whose connect made it: only that peer may use it

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks


class KVPeer:
    """One NIXL agent with a pool registered, moving its blocks to and from other peers. A context manager;
    :meth:`close` deregisters the pool. Not thread-safe: use a peer from one thread at a time.

    Every transfer is held until NIXL reports it ended, also one dropped or timed out (its data may still
    land): a transfer that would race it on the same blocks is refused (ValueError naming them), and
    :meth:`quarantined` lists them. A block is let go only once NIXL reports its transfer done or failed:
    when its bytes can no longer change. A peer whose transfers failed (it vanished, or the link dropped it)
    is reconnected by :meth:`connect` with the same descriptor again, or by :meth:`reconnect`, once none of
    its transfers is unfinished (NIXL forgets the transfers of a connection made anew, without stopping them).


    Parameters:

    - ``pool``: a HostKVPool, or an engine's PagedKV (on a GPU: NIXL's VRAM, so two GPUs exchange blocks
      directly where UCX supports GPUDirect).
    - ``name``: the NIXL agent's name, unique among the peers that connect.
    - ``backends``: NIXL's backends for the agent (UCX by default).
    - ``cache_key``: the CacheKey whose blocks the pool holds (a peer refuses to connect to a pool of another
      context).
    - ``progress_thread``: NIXL's progress thread, which busy-polls a core for as long as the peer lives
      (NIXL's Python wrapper sets it no delay). Without it a peer spends no core while idle and progresses
      its own transfers when it polls them, but over UCX TCP a pool nobody polls cannot be read: the
      holder's CPU serves each READ. Turn it off only on a peer that reads and writes, never on one that is
      read from.
    """

    def __init__(
        self,
        pool: HostKVPool | PagedKV,
        name: str,
        *,
        backends: tuple[str, ...] = ("UCX",),
        cache_key: object | None = None,
        progress_thread: bool = True,
    ) -> None:
        registration = registration_of(pool)
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty agent name, got {name!r}")
        if not isinstance(progress_thread, bool):
            raise TypeError(f"progress_thread: expected a bool, got {type(progress_thread).__name__}")
        if isinstance(backends, str) or not all(isinstance(b, str) for b in backends):
            raise TypeError(f"backends: expected a tuple of NIXL backend names such as ('UCX',), got {backends!r}")
        context_hash = None if cache_key is None else context_hash_of(cache_key)
        nixl_agent, nixl_agent_config = nixl_module()
        self.pool, self.name, self.backends = pool, name, tuple(backends)
        try:
            config = nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
            self._agent = nixl_agent(name, config)
        except Exception as err:  # NIXL's errors are its own classes: none escapes kvcopy's API
            raise ValueError(f"backends: NIXL could not start {list(backends)} ({type(err).__name__}: {err})") from None
        missing = [b for b in backends if b not in getattr(self._agent, "backends", {})]
        if missing:  # NIXL skips a backend it has no plugin for, with a warning, and fails at the first use
            raise ValueError(
                f"backends: NIXL could not start {missing} here (its plugins: {self._agent.get_plugin_list()}); "
                "kvcopy's remote transfers use 'UCX'"
            )
        self._registered = self._agent.register_memory(list(registration.regions), registration.memory)
        self._layout = PoolLayout.of(registration, name, context_hash)
        self._table = registration.paged.plane_table
        self._num_blocks = registration.paged.num_blocks
        self._remotes: dict[str, RemotePool] = {}
        self._metadata: dict[str, bytes] = {}  # each connected agent's NIXL metadata, to know a reconnect
        self._quarantine = Quarantine()
        self._broken: set[str] = set()  # agents a transfer to failed: NIXL fails every later one until re-added

    def descriptor(self) -> bytes:
        """What a remote peer needs to connect: this agent's metadata, the pool's layout and its context hash."""
        return encode(self._layout, self._agent.get_agent_metadata())

    def connect(self, remote_descriptor: bytes) -> RemotePool:
        """The remote peer's pool, ready for :meth:`read` and :meth:`write`. ValueError when its layout (layout
        kind, planes, plane-block bytes, dtypes) or its CacheKey context differs from this pool's. The same
        descriptor again gives the same pool, unless a transfer to it failed since: then NIXL's connection is
        made anew and a new RemotePool replaces the old one (as for a restarted peer's new descriptor). Making
        it anew is refused while transfers to that peer are unfinished, and says "unreachable"
        (ConnectionError, the old pool kept) when NIXL cannot connect again, as :meth:`reconnect` does."""
        layout, metadata = decode(remote_descriptor)
        if layout.shape() != self._layout.shape():
            raise ValueError(
                f"remote_descriptor: pool {layout.agent!r} is laid out {layout.shape()}, this one "
                f"{self._layout.shape()} (layout, then each plane's block bytes and dtype): its blocks cannot be "
                "read as this pool's"
            )
        if layout.context_hash != self._layout.context_hash:
            raise ValueError(
                f"remote_descriptor: pool {layout.agent!r} holds blocks of CacheKey context {layout.context_hash}, "
                f"this one {self._layout.context_hash}: a block of another model configuration is never read as "
                "this one's"
            )
        self._check_open()
        if layout.agent == self.name:
            raise ValueError(
                f"remote_descriptor: the descriptor of agent {layout.agent!r}, this peer's own name: connect to "
                "another peer's descriptor (two peers need distinct names)"
            )
        self._reap()  # first: a transfer that failed since the last call breaks the connection it used
        known = self._remotes.get(layout.agent)
        if known is None:
            return self._add(layout, metadata, accepted_before=False)
        same = known.layout == layout and self._metadata[layout.agent] == metadata
        if same and layout.agent not in self._broken:
            return known  # the same descriptor again: the same pool
        # the peer came back (a restart), or its connection broke: made anew
        return self._renew(layout, metadata, accepted_before=same)

    def reconnect(self, remote: RemotePool) -> RemotePool:
        """``remote``'s connection made anew from the descriptor it was connected with: what continues after a
        RemoteTransferError from a peer that is still there (a link that dropped the connection). The new
        RemotePool replaces ``remote``.

        Refused (ValueError naming the blocks, nothing changed) while a transfer to that peer is unfinished:
        making the connection anew makes NIXL forget such a transfer, but not stop it, so its blocks could
        never be let go. Retry once :meth:`quarantined` no longer lists them (the transfer lands, or fails,
        when the link returns). ConnectionError when NIXL cannot reach the peer: ``remote`` stays this peer's
        pool, so ``reconnect(remote)`` may be tried again."""
        self._check_current(remote)
        self._reap()
        return self._renew(remote.layout, self._metadata[remote.agent], accepted_before=True)

    def _renew(self, layout: PoolLayout, metadata: bytes, *, accepted_before: bool) -> RemotePool:
        """The connection to ``layout.agent`` made anew from ``metadata``: NIXL's agent removed and added."""
        agent = layout.agent
        in_flight = self._quarantine.in_flight(agent)
        if in_flight:
            raise ValueError(
                f"remote: the connection to agent {agent!r} cannot be made anew while transfers to it are "
                f"unfinished (blocks {in_flight}, by side): NIXL would forget them without stopping them, and "
                "their data may still land. Wait for them, or retry once KVPeer.quarantined() no longer lists "
                "them"
            )
        with contextlib.suppress(Exception):  # a vanished peer is already gone
            self._agent.remove_remote_agent(agent)
        self._broken.add(agent)  # until added again: NIXL no longer knows it
        return self._add(layout, metadata, accepted_before=accepted_before)

    def quarantined(self) -> dict[str, list[int]]:
        """The blocks that unfinished transfers (waited for or not, timed out or not) may still write, by side:
        "local" for this pool's (reads), the remote agent's name for its (writes); empty when none."""
        self._reap()
        return self._quarantine.blocks()

    def _reap(self) -> None:
        """Lets the ended transfers go; the agents of those that failed are broken until connected anew."""
        self._broken.update(self._quarantine.reap())

    def _add(self, layout: PoolLayout, metadata: bytes, *, accepted_before: bool) -> RemotePool:
        """NIXL's agent for ``metadata`` added and its new RemotePool; ``accepted_before``: NIXL took this
        metadata once already, so a refusal now is an unreachable peer, not garbled bytes. On a failure the
        old pool (if any) stays, for a retry."""
        try:
            added = self._agent.add_remote_agent(metadata)
        except Exception as err:  # NIXL's errors are its own classes: none escapes kvcopy's API
            cause = f"{type(err).__name__}: {err}"
            if accepted_before:
                raise ConnectionError(
                    f"remote: agent {layout.agent!r} is unreachable: NIXL could not connect to it again ({cause}). "
                    "Its pool is kept: reconnect (or connect with its descriptor) once it is reachable"
                ) from None
            raise ValueError(
                f"remote_descriptor: NIXL refused the agent metadata of {layout.agent!r} ({cause}): cut short or "
                "garbled in transit, or the peer unreachable"
            ) from None
        name = added.decode(errors="replace") if isinstance(added, bytes) else str(added)
        if name != layout.agent:  # the metadata names another agent than the layout: bytes garbled in transit
            if name not in self._remotes and name != self.name:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
            raise ValueError(
                f"remote_descriptor: its agent metadata is of agent {name!r}, its layout of {layout.agent!r}: "
                "garbled in transit?"
            )
        remote = RemotePool(name, layout, layout.plane_table(), self.name)
        self._remotes[remote.agent], self._metadata[remote.agent] = remote, metadata
        self._broken.discard(remote.agent)
        return remote

    def read(self, remote: RemotePool, remote_ids: BlockIds, local_ids: BlockIds) -> RemoteTransfer:
        """Copies the remote pool's blocks ``remote_ids`` into this pool's ``local_ids``: one NIXL READ."""
        return self._transfer("READ", remote, remote_ids, local_ids)

    def write(self, local_ids: BlockIds, remote: RemotePool, remote_ids: BlockIds) -> RemoteTransfer:
        """Copies this pool's blocks ``local_ids`` into the remote pool's ``remote_ids``: one NIXL WRITE."""
        return self._transfer("WRITE", remote, remote_ids, local_ids)

    def _transfer(self, op: str, remote: RemotePool, remote_ids: BlockIds, local_ids: BlockIds) -> RemoteTransfer:
        self._check_current(remote)
        reading = op == "READ"
        names = ("remote_ids", "local_ids") if reading else ("local_ids", "remote_ids")
        remote_t = as_ids(remote_ids, "remote_ids", remote.num_blocks)
        local_t = as_ids(local_ids, "local_ids", self._num_blocks)
        for name, ids in (("remote_ids", remote_t), ("local_ids", local_t)):
            if ids.device.type != "cpu":
                raise ValueError(f"{name}: expected ids on the host, got ids on {ids.device}")
        src, dst = (remote_t, local_t) if reading else (local_t, remote_t)
        src_blocks, dst_blocks = (
            (remote.num_blocks, self._num_blocks) if reading else (self._num_blocks, remote.num_blocks)
        )
        check_host_pair(src, dst, src_blocks, dst_blocks, same_cache=False, names=names)
        self._reap()
        self._quarantine.check(op, remote.agent, local_t, remote_t)
        remote_table = remote.plane_table
        src_table, dst_table = (remote_table, self._table) if reading else (self._table, remote_table)
        ranges = plan_table_ranges(src_table, src, dst_table, dst)
        here, there = self._layout, remote.layout
        local_ranges = [(d if reading else s, n, here.device_id) for s, d, n in ranges]
        remote_ranges = [(s if reading else d, n, there.device_id) for s, d, n in ranges]
        written = WrittenBlocks("local", local_t) if reading else WrittenBlocks(remote.agent, remote_t)
        try:  # NIXL's errors are its own classes; after NIXL dropped the agent, initialize_xfer raises one
            handle = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(local_ranges, here.memory),
                self._agent.get_xfer_descs(remote_ranges, there.memory),
                remote.agent,
            )
        except Exception as err:
            self._broken.add(remote.agent)
            raise self._failed_to_start(op, written, err) from err
        transfer = RemoteTransfer(self._agent, handle, op.lower(), len(ranges), sum(n for _, _, n in ranges), written)
        try:
            state = self._agent.transfer(handle)
        except Exception as err:  # NIXL's errors are its own classes
            transfer._release()
            self._broken.add(remote.agent)
            raise self._failed_to_start(op, written, err) from err
        self._quarantine.hold(transfer, op, remote.agent, local_t, remote_t)
        if state == "ERR":
            transfer.done()  # raises RemoteTransferError
        return transfer

    @staticmethod
    def _failed_to_start(op: str, written: WrittenBlocks, err: Exception) -> RemoteTransferError:
        return RemoteTransferError(
            f"{op.lower()} failed to start ({type(err).__name__}: {err}); {written} hold no valid data (connect "
            "again, or reconnect, once the peer is reachable)",
            written,
        )

    def _check_current(self, remote: RemotePool) -> None:
        self._check_open()
        if not isinstance(remote, RemotePool):
            raise TypeError(f"remote: expected a RemotePool from KVPeer.connect, got {type(remote).__name__}")
        if self._remotes.get(remote.agent) is not remote:
            if remote.connected_by != self.name:
                why = f"KVPeer {remote.connected_by!r} connected it, not this one ({self.name!r})"
            elif remote.agent in self._remotes:
                why = "a later connect or reconnect to that agent replaced it (a restart, or a broken connection)"
            else:
                why = "this peer has forgotten it (a connect that replaced it, or close)"
            raise ValueError(f"remote: the pool of agent {remote.agent!r} is not this peer's to use: {why}")

    def close(self) -> None:
        """Forgets the connected peers and deregisters the pool. Wait for this peer's transfers first: the
        handles of unfinished ones are released (NIXL aborts what it can), and their writes may still land."""
        self._quarantine.release_all()
        for agent in list(self._remotes):
            self._forget(agent)
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None

    def _forget(self, agent: str) -> None:
        del self._remotes[agent], self._metadata[agent]
        with contextlib.suppress(Exception):  # a vanished peer is already gone
            self._agent.remove_remote_agent(agent)

    def _check_open(self) -> None:
        if self._registered is None:
            raise ValueError(f"KVPeer {self.name!r} is closed: its pool is no longer registered")

    def __enter__(self) -> KVPeer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
