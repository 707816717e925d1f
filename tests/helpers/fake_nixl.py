"""A fake NIXL agent for kvcopy.remote's unit tests: the calls a KVPeer makes, answered as NIXL 1.5 with UCX
answers them, with the network under the test's control.

A transfer stays in flight until the test lands it (:meth:`FakeNetwork.land`) or fails it
(:meth:`FakeNetwork.fail`). Landing copies the bytes, as UCX's reads and writes do, whatever became of the
handle (released) or of its remote agent (removed): NIXL's handle is gone, the operation on the wire is not.
As NIXL 1.5 does, removing a remote agent makes every handle of a transfer to it answer NIXL_ERR_NOT_FOUND
from then on, also once an agent of that name is added again; and NIXL's errors are its own classes
(:class:`nixlNotFoundError` and the others, not kvcopy's, not builtins).

Use: ``network = install(monkeypatch)``; then every KVPeer made is a fake agent on ``network``, which holds
each agent's registered memory (host tensors) by name. ``network.unreachable`` (a set of names): adding those
agents fails as UCX fails on a peer it cannot reach.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field

# NIXL's exception classes are named so (nixl_cu13._bindings); kvcopy must never let one escape.


class nixlNotFoundError(Exception):
    pass


class nixlBackendError(Exception):
    pass


class nixlInvalidParamError(Exception):
    pass


_METADATA_MAGIC = b"fake-nixl-md:"


@dataclass
class _Xfer:
    """One posted transfer: ``copies`` are (destination address, source address, bytes)."""

    agent: str
    generation: int  # the remote agent's generation when it was made: a removal since makes it unknown
    copies: list[tuple[int, int, int]]
    state: str = "NEW"  # NEW, PROC, DONE, ERR
    released: bool = False


@dataclass
class FakeNetwork:
    """Every fake agent of a test, by name, and the transfers on the wire."""

    agents: dict[str, FakeAgent] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    xfers: list[_Xfer] = field(default_factory=list)

    def in_flight(self) -> list[_Xfer]:
        return [x for x in self.xfers if x.state == "PROC"]

    def land(self) -> int:
        """Every transfer in flight arrives: its bytes are copied (handle released or not) and it is DONE."""
        landing = self.in_flight()
        for xfer in landing:
            for dst, src, n in xfer.copies:
                ctypes.memmove(dst, src, n)
            xfer.state = "DONE"
        return len(landing)

    def fail(self) -> None:
        """Every transfer in flight ends in an error reported by NIXL (UCX purged it: nothing more lands)."""
        for xfer in self.in_flight():
            xfer.state = "ERR"


class _Handle:
    def __init__(self, xfer: _Xfer) -> None:
        self.xfer = xfer
        self.status = "NEW"  # NIXL's status of it as last checked: NIXL rechecks only one in progress


class FakeAgent:
    """The nixl_agent calls a KVPeer makes."""

    network: FakeNetwork  # set by install()

    def __init__(self, name: str, config: object) -> None:
        self.name = name
        self.backends = {"UCX": object()}
        self.remotes: dict[str, int] = {}  # loaded remote agents: name -> generation
        self.generations = itertools.count(1)
        self.regions: list[tuple[int, int]] = []
        self.released: list[_Handle] = []
        self.network.agents[name] = self

    def get_plugin_list(self) -> list[str]:
        return ["UCX"]

    def register_memory(self, regions: list[tuple[int, int, int, str]], memory: str) -> object:
        self.regions = [(address, nbytes) for address, nbytes, _, _ in regions]
        return self.regions

    def deregister_memory(self, registered: object) -> None:
        self.regions = []

    def get_agent_metadata(self) -> bytes:
        return _METADATA_MAGIC + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        if not metadata.startswith(_METADATA_MAGIC):
            raise nixlInvalidParamError("NIXL_ERR_INVALID_PARAM")
        name = metadata[len(_METADATA_MAGIC) :].decode()
        if name in self.network.unreachable:
            raise nixlBackendError("NIXL_ERR_BACKEND")
        self.remotes[name] = next(self.generations)
        return name.encode()

    def remove_remote_agent(self, name: str) -> None:
        if self.remotes.pop(name, None) is None:
            raise nixlNotFoundError("NIXL_ERR_NOT_FOUND")

    def get_xfer_descs(self, ranges: list[tuple[int, int, int]], memory: str) -> list[tuple[int, int]]:
        return [(address, nbytes) for address, nbytes, _ in ranges]

    def initialize_xfer(self, op: str, local: list, remote: list, agent: str) -> _Handle:
        if agent not in self.remotes:
            raise nixlNotFoundError("NIXL_ERR_NOT_FOUND")
        pairs = zip(local, remote, strict=True)
        copies = [(lo, ro, n) if op == "READ" else (ro, lo, n) for (lo, n), (ro, _) in pairs]
        xfer = _Xfer(agent, self.remotes[agent], copies)
        self.network.xfers.append(xfer)
        return _Handle(xfer)

    def transfer(self, handle: _Handle) -> str:
        handle.xfer.state = handle.status = "PROC"
        return "PROC"

    def _known(self, handle: _Handle) -> bool:
        return self.remotes.get(handle.xfer.agent) == handle.xfer.generation

    def check_xfer_state(self, handle: _Handle) -> str:
        if handle.status == "PROC":
            if not self._known(handle):
                raise nixlNotFoundError("NIXL_ERR_NOT_FOUND")  # NIXL 1.5: "invalidated or re-registered"
            handle.status = handle.xfer.state
        if handle.status == "ERR":
            raise nixlBackendError("NIXL_ERR_BACKEND")  # what the binding raises for a failed transfer
        return handle.status

    def release_xfer_handle(self, handle: _Handle) -> None:
        handle.xfer.released = True  # NIXL frees its handle; UCX's operation in flight goes on
        self.released.append(handle)


class _Config:
    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs


def install(monkeypatch) -> FakeNetwork:  # a pytest MonkeyPatch
    """Every KVPeer made from now on (in this test) is a fake agent on the returned network."""
    network = FakeNetwork()
    agent_class = type("FakeAgentOnNetwork", (FakeAgent,), {"network": network})
    monkeypatch.setattr("kvcopy.remote.peer.nixl_module", lambda: (agent_class, _Config))
    return network
