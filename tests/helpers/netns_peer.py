"""A kvcopy peer process inside a test namespace (tests/helpers/netns.py starts it): one KVPeer whose pool
holds known random bytes, answering the test's commands over the socket whose descriptor is argv[1].

Each command is a tuple (name, *arguments); each answer ("ok", value) or ("error", (class name, message,
side, block ids)). Commands:
- ``pool(kind, num_blocks, seed, progress_thread=True)``: a page-first pool of helpers.remote.LAYOUTS[kind]
  filled from ``seed``, and a KVPeer on it; answers its descriptor;
- ``connect(descriptor)``: answers the remote agent's name; ``reconnect(agent)``: KVPeer.reconnect;
- ``read(agent, remote_ids, local_ids, timeout)`` / ``write(agent, local_ids, remote_ids, timeout)``: one
  transfer waited for; answers (seconds, descriptors);
- ``start(agent, op, remote_ids, local_ids)``: a read or write left in flight (number k);
  ``wait(k, timeout)``; ``drop(k)``: forgets the handle (what a caller does after giving up on it);
- ``fetch(agent, remote_ids, local_ids, chunks, timeout)``: the pipelined fetch the planner predicts:
  ``chunks`` network reads into the pool, each reloaded into a paged cache while the next one reads;
  answers seconds;
- ``digests(ids)``: the SHA-256 of each block's bytes (a page-first block is one contiguous run);
  ``quarantined()``: KVPeer.quarantined; ``fill(seed)``; ``fill_blocks(ids, seed)``: those blocks only,
  answering their digests; ``exit()``.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import time
from multiprocessing.connection import Connection

import torch

import kvcopy
from kvcopy.remote import KVPeer

from helpers.remote import make_pool, storage_bytes


class Served:
    def __init__(self, name: str) -> None:
        self.name = name
        self.pool = self.peer = self.cache = None
        self.remotes: dict[str, object] = {}
        self.transfers: dict[int, object] = {}

    def pool_(self, kind: str, num_blocks: int, seed: int, progress_thread: bool = True) -> bytes:
        self.pool = make_pool(kind, num_blocks, "page_first", seed)
        self.peer = KVPeer(self.pool, self.name, progress_thread=progress_thread)
        return self.peer.descriptor()

    def connect(self, descriptor: bytes) -> str:
        remote = self.peer.connect(descriptor)
        self.remotes[remote.agent] = remote
        return remote.agent

    def reconnect(self, agent: str) -> None:
        self.remotes[agent] = self.peer.reconnect(self.remotes[agent])

    def start(self, agent: str, op: str, remote_ids: list[int], local_ids: list[int]) -> int:
        if op == "read":
            transfer = self.peer.read(self.remotes[agent], remote_ids, local_ids)
        else:
            transfer = self.peer.write(local_ids, self.remotes[agent], remote_ids)
        number = len(self.transfers)
        self.transfers[number] = transfer
        return number

    def wait(self, number: int, timeout: float) -> tuple[float, int]:
        started = time.perf_counter()
        transfer = self.transfers[number]
        transfer.wait(timeout)
        return time.perf_counter() - started, transfer.num_descriptors

    def transfer(self, agent: str, op: str, ids_a: list[int], ids_b: list[int], timeout: float) -> tuple[float, int]:
        started = time.perf_counter()
        remote_ids, local_ids = (ids_a, ids_b) if op == "read" else (ids_b, ids_a)
        transfer = self.transfers[self.start(agent, op, remote_ids, local_ids)]
        transfer.wait(timeout)
        return time.perf_counter() - started, transfer.num_descriptors

    def fetch(self, agent: str, remote_ids: list[int], local_ids: list[int], chunks: int, timeout: float) -> float:
        if self.cache is None:
            self.cache = kvcopy.PagedKV.from_planes(
                [torch.empty_like(p) for p in self.pool.paged.planes], planes_per_layer=2
            )
        bounds = [round(i * len(local_ids) / chunks) for i in range(chunks + 1)]
        parts = [(remote_ids[a:b], local_ids[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
        started = time.perf_counter()
        remote = self.remotes[agent]
        pending = self.peer.read(remote, *parts[0])
        for i, (_, local) in enumerate(parts):
            pending.wait(timeout)
            if i + 1 < len(parts):  # the next chunk crosses the network while this one reloads
                pending = self.peer.read(remote, *parts[i + 1])
            kvcopy.scatter(self.pool, local, self.cache, local)
        return time.perf_counter() - started

    def digests(self, ids: list[int]) -> list[str]:
        rows = storage_bytes(self.pool).view(self.pool.num_blocks, -1)
        return [hashlib.sha256(rows[i].numpy().tobytes()).hexdigest() for i in ids]

    def fill_blocks(self, ids: list[int], seed: int) -> list[str]:
        rows = storage_bytes(self.pool).view(self.pool.num_blocks, -1)
        generator = torch.Generator().manual_seed(seed)
        for i in ids:
            rows[i].copy_(torch.randint(0, 256, (rows.shape[1],), dtype=torch.uint8, generator=generator))
        return self.digests(ids)

    def fill(self, seed: int) -> None:
        data = storage_bytes(self.pool)
        generator = torch.Generator().manual_seed(seed)
        data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8, generator=generator))


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    served = Served(sys.argv[2])
    commands = {
        "pool": served.pool_,
        "connect": served.connect,
        "reconnect": served.reconnect,
        "read": lambda agent, *a: served.transfer(agent, "read", *a),
        "write": lambda agent, *a: served.transfer(agent, "write", *a),
        "start": served.start,
        "wait": served.wait,
        "drop": lambda number: served.transfers.pop(number) and None,
        "fetch": served.fetch,
        "digests": served.digests,
        "quarantined": lambda: served.peer.quarantined(),
        "fill": served.fill,
        "fill_blocks": served.fill_blocks,
    }
    while True:
        try:
            name, *args = conn.recv()
        except EOFError:
            return
        if name == "exit":
            if served.peer is not None:
                served.peer.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[name](*args)))
        except Exception as err:  # every error goes back to the test, named
            conn.send(
                ("error", (type(err).__name__, str(err), getattr(err, "side", None), getattr(err, "block_ids", None)))
            )


if __name__ == "__main__":
    main()
