"""The blocks a KVPeer's unfinished transfers still touch: held until NIXL reports each transfer ended.

Over a network, a transfer given up on (dropped, or timed out) is not stopped by releasing its handle: its
data may land seconds later, over blocks a caller has reused. So a peer keeps every transfer it started until
NIXL says it is done or failed, and refuses a new transfer that would race one still running:
- this pool's blocks: a read writes them, a write reads them; a clash is a read beside either;
- a remote pool's blocks: a write writes them, a read reads them; a clash is a write beside either.

A block is let go only when its bytes can no longer change: when NIXL reports its transfer done or failed.
Never because NIXL stopped knowing the handle (its agent removed while it ran: the transfer is "lost", and
UCX's reads already in flight still land), nor because its handle was released.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcopy.nixl.transfer import NixlTransfer

__all__ = ["Quarantine"]


@dataclass(frozen=True)
class _Held:
    transfer: NixlTransfer
    op: str  # "READ" or "WRITE"
    agent: str  # the remote agent's name
    local_ids: torch.Tensor
    remote_ids: torch.Tensor


class Quarantine:
    """One peer's unfinished transfers and the blocks they touch."""

    def __init__(self) -> None:
        self._held: list[_Held] = []

    def hold(
        self, transfer: NixlTransfer, op: str, agent: str, local_ids: torch.Tensor, remote_ids: torch.Tensor
    ) -> None:
        self._held.append(_Held(transfer, op, agent, local_ids, remote_ids))

    def reap(self) -> set[str]:
        """Polls the held transfers and lets go of those NIXL reported done or failed (a lost one is kept);
        the agents of those that failed."""
        failed, kept = set(), []
        for held in self._held:
            if not held.transfer.ended:
                kept.append(held)
            elif held.transfer.failed:
                failed.add(held.agent)
        self._held = kept
        return failed

    def in_flight(self, agent: str) -> dict[str, list[int]]:
        """The blocks of the held transfers to ``agent`` that NIXL still knows (not lost), by side (as
        :meth:`blocks`): what removing that agent from NIXL would lose track of. Empty when none."""
        return self._written([held for held in self._held if held.agent == agent and not held.transfer.lost])

    def check(self, op: str, agent: str, local_ids: torch.Tensor, remote_ids: torch.Tensor) -> None:
        """ValueError, naming the blocks, when a transfer ``op`` of these ids would race a held one."""
        for held in self._held:
            reading = op == "READ" or held.op == "READ"
            writing = op == "WRITE" or held.op == "WRITE"
            clashes = [("local_ids", local_ids, held.local_ids)] if reading else []
            if writing and agent == held.agent:
                clashes.append(("remote_ids", remote_ids, held.remote_ids))
            for name, ids, busy in clashes:
                overlap = ids[torch.isin(ids, busy)]
                if overlap.numel():
                    raise ValueError(
                        f"{name}: blocks {overlap.tolist()} are in use by an unfinished {held.op.lower()} (one not "
                        "yet waited for, or one that failed its wait's timeout and may still land): they stay "
                        "quarantined until NIXL reports it ended; wait for it, or poll KVPeer.quarantined()"
                    )

    def blocks(self) -> dict[str, list[int]]:
        """The blocks the held transfers write, by side: "local" (reads), or a remote agent's name (writes)."""
        return self._written(self._held)

    @staticmethod
    def _written(held: list[_Held]) -> dict[str, list[int]]:
        written: dict[str, set[int]] = {}
        for one in held:
            side, ids = ("local", one.local_ids) if one.op == "READ" else (one.agent, one.remote_ids)
            written.setdefault(side, set()).update(ids.tolist())
        return {side: sorted(ids) for side, ids in written.items()}

    def release_all(self) -> None:
        """Releases every held handle (NIXL aborts what it can) and forgets them: for the peer's close."""
        for held in self._held:
            held.transfer._release()
        self._held = []
