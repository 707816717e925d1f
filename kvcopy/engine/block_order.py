"""Which unfinished transfers touch which blocks: the engine's own ordering, and debug mode's checks.

A :class:`BlockOrder` belongs to one TransferEngine. For every block of an
unfinished transfer it remembers, per side ("device" pages, "host" pool),
the transfer that last writes it and the transfers that read it since. A
new transfer must come after:

- the last writer of each block it reads (read after write),
- the last writer and the readers of each block it writes (write after
  write, write after read).

Entries exist only for blocks of unfinished transfers and are dropped as
those finish, so the cost of a submission grows with the blocks it and the
transfers in flight touch, never with the pool's size. Ids that live on the
GPU cannot be read without a device synchronisation: such a transfer is
ordered after every unfinished one, and every later one after it.

Debug mode asks the same record about the caller's own work
(kvcopy/conflicts.py): the engine can order its transfers against each
other, not against work it does not see.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcopy.engine.transfer import Transfer

__all__ = ["BlockOrder", "Blocks"]

Blocks = dict[str, set[int]]  # side ("device" / "host") -> block ids
SIDES = ("device", "host")


class BlockOrder:
    """The unfinished transfers of one engine, by the blocks they read and write. Not thread-safe: the
    engine calls it under its lock."""

    def __init__(self) -> None:
        self._writer: dict[str, dict[int, Transfer]] = {side: {} for side in SIDES}
        self._readers: dict[str, dict[int, list[Transfer]]] = {side: {} for side in SIDES}
        self._live: list[tuple[Transfer, Blocks | None, Blocks | None]] = []  # (transfer, reads, writes)
        self._opaque: list[Transfer] = []  # unfinished transfers whose blocks are unknown (GPU-resident ids)

    def prune(self) -> None:
        """Forgets finished transfers (and the entries of their blocks)."""
        if all(not transfer.done() for transfer, _, _ in self._live):
            return
        still = []
        for transfer, reads, writes in self._live:
            if not transfer.done():
                still.append((transfer, reads, writes))
                continue
            for side, blocks in (writes or {}).items():
                for block in blocks:
                    if self._writer[side].get(block) is transfer:
                        del self._writer[side][block]
            for side, blocks in (reads or {}).items():
                readers = self._readers[side]
                for block in blocks:
                    mine = readers.get(block)
                    if mine is not None:
                        mine[:] = [t for t in mine if t is not transfer]
                        if not mine:
                            del readers[block]
        self._live = still
        self._opaque = [t for t in self._opaque if not t.done()]

    def unfinished(self) -> list[Transfer]:
        """The recorded transfers not yet done, in submission order."""
        self.prune()
        return [transfer for transfer, _, _ in self._live]

    def dependencies(self, reads: Blocks | None, writes: Blocks | None) -> list[Transfer]:
        """The unfinished transfers a new one reading ``reads`` and writing ``writes`` must follow
        (None: blocks unknown, so all of them)."""
        if reads is None or writes is None:
            return self.unfinished()
        self.prune()
        found: dict[int, Transfer] = {id(t): t for t in self._opaque}
        for side, blocks in reads.items():
            writer = self._writer[side]
            for block in blocks:
                if block in writer:
                    found[id(writer[block])] = writer[block]
        for side, blocks in writes.items():
            writer, readers = self._writer[side], self._readers[side]
            for block in blocks:
                if block in writer:
                    found[id(writer[block])] = writer[block]
                for transfer in readers.get(block, ()):
                    found[id(transfer)] = transfer
        return list(found.values())

    def add(self, transfer: Transfer, reads: Blocks | None, writes: Blocks | None) -> None:
        """Records a submitted transfer (after it was ordered behind its dependencies)."""
        self._live.append((transfer, reads, writes))
        if reads is None or writes is None:
            self._opaque.append(transfer)
            return
        for side, blocks in writes.items():
            writer, readers = self._writer[side], self._readers[side]
            for block in blocks:
                writer[block] = transfer
                readers.pop(block, None)  # they come before this transfer, which waited for them
        for side, blocks in reads.items():
            readers = self._readers[side]
            for block in blocks:
                readers.setdefault(block, []).append(transfer)

    def conflict(
        self, side: str, blocks: Iterable[int], *, writes: bool, stream: int | None = None
    ) -> tuple[int, Transfer, str] | None:
        """The first (block, transfer, "reads" | "writes") of an unfinished transfer that work reading
        (``writes=False``) or writing these blocks of ``side`` would conflict with; None if there is none.
        Work queued on ``stream`` (a CUDA stream handle) after that stream waited for a transfer
        (``Transfer.wait_stream``) is ordered after it: no conflict."""
        self.prune()

        def ordered(transfer: Transfer) -> bool:
            return stream is not None and stream in transfer.joined

        writer, readers = self._writer[side], self._readers[side]
        for block in blocks:
            if block in writer and not ordered(writer[block]):
                return block, writer[block], "writes"
            if writes:
                reader = next((t for t in readers.get(block, ()) if not ordered(t)), None)
                if reader is not None:
                    return block, reader, "reads"
        opaque = next((t for t in self._opaque if not ordered(t)), None)
        if opaque is not None:
            return -1, opaque, "may touch"
        return None
