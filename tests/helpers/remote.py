"""A remote peer in another process, for tests/remote/test_remote.py: it builds a pool of known random bytes,
sends its descriptor over a pipe, and answers commands (connect to ours, its pool's bytes, exit)."""

from __future__ import annotations

import multiprocessing
from contextlib import contextmanager

import torch

from helpers import HANG_TIMEOUT_S

# Seconds a test waits for the remote process to answer (it imports torch and NIXL first): only a hang.
REPLY_TIMEOUT_S = HANG_TIMEOUT_S

# Pool shapes, by name: (block shapes per plane, dtypes, planes per layer). fp8 K/V with float32 scale planes too.
LAYOUTS = {
    "bf16": ([(16, 2, 32), (16, 2, 32)] * 2, [torch.bfloat16] * 4, 2),
    "fp8-scales": (
        [(16, 2, 32), (16, 2, 32), (16, 2), (16, 2)] * 2,
        [torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, torch.float32] * 2,
        4,
    ),
    "wide": ([(16, 2, 64), (16, 2, 64)] * 2, [torch.bfloat16] * 4, 2),
    # Llama-3.1-8B's 16-token block: 32 layers of K and V, 8 KV heads of 128 (2 MiB a block).
    "llama-8b": ([(16, 8, 128)] * 64, [torch.bfloat16] * 64, 2),
}


def make_pool(kind: str, num_blocks: int, host_layout: str, seed: int):  # HostKVPool or PagedKV
    """A HostKVPool of ``kind`` (``host_layout`` page_first or layer_first), or for ``"paged"`` an engine's cache
    (a PagedKV whose planes are byte slices of one block-major allocation, so the planes of a block interleave),
    whose every byte is drawn from ``seed``."""
    import kvcopy

    shapes, dtypes, per_layer = LAYOUTS[kind]
    if host_layout == "paged":
        sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
        raw = torch.empty(num_blocks, sum(sizes), dtype=torch.uint8)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        planes = [
            raw[:, off : off + size].view(dtype).view(num_blocks, *shape)
            for off, size, shape, dtype in zip(offsets, sizes, shapes, dtypes, strict=True)
        ]
        pool = kvcopy.PagedKV.from_planes(planes, planes_per_layer=per_layer)
    else:
        planes = [torch.empty((1, *shape), dtype=dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
        like = kvcopy.PagedKV.from_planes(planes, planes_per_layer=per_layer)
        pool = kvcopy.HostKVPool(like, num_blocks, layout=host_layout, pin_memory=False)
    data = storage_bytes(pool)
    data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return pool


def storage_bytes(kv) -> torch.Tensor:  # a HostKVPool or make_pool's PagedKV
    """Every byte of ``kv``'s memory, as a writable uint8 tensor."""
    import kvcopy

    if isinstance(kv, kvcopy.HostKVPool):
        return kv.buffer
    return torch.empty(0, dtype=torch.uint8).set_(kv.planes[0].untyped_storage())


def planes_of(kv) -> tuple[torch.Tensor, ...]:  # a HostKVPool or a PagedKV
    import kvcopy

    return kv.paged.planes if isinstance(kv, kvcopy.HostKVPool) else kv.planes


def serve(conn, kind: str, num_blocks: int, host_layout: str, seed: int, context: str | None) -> None:
    import kvcopy
    from kvcopy.remote import KVPeer

    pool = make_pool(kind, num_blocks, host_layout, seed)
    key = None
    if context is not None:
        key = kvcopy.CacheKey(kvcopy.ModelSpec.preset("llama-3.1-8b"), weights_id=context, block_tokens=16)
    peer = KVPeer(pool, f"remote-{seed}", cache_key=key)
    conn.send(peer.descriptor())
    while True:
        command, *args = conn.recv()
        if command == "connect":
            peer.connect(args[0])
            conn.send("connected")
        elif command == "bytes":
            conn.send(storage_bytes(pool).numpy().tobytes())
        elif command == "exit":
            peer.close()
            conn.send("bye")
            return


class Remote:
    """The parent's side of a served peer."""

    def __init__(self, process, conn, descriptor: bytes) -> None:
        self.process, self.conn, self.descriptor = process, conn, descriptor

    def ask(self, *command: object) -> object:
        self.conn.send(command)
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"the remote process did not answer {command[0]!r}")
        return self.conn.recv()

    def pool_bytes(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.ask("bytes")), dtype=torch.uint8)


@contextmanager
def remote_peer(
    kind: str = "bf16", num_blocks: int = 96, host_layout: str = "page_first", seed: int = 1, context: str | None = None
):
    """A peer serving from another process (spawned: NIXL and torch start fresh there)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=serve, args=(child, kind, num_blocks, host_layout, seed, context), daemon=True)
    process.start()
    child.close()  # the child has its own end now: a dead child is EOF here, not a silent pipe
    try:
        if not parent.poll(REPLY_TIMEOUT_S):
            raise TimeoutError("the remote process did not start")
        yield Remote(process, parent, parent.recv())
    finally:
        if process.is_alive():
            try:
                parent.send(("exit",))
                parent.poll(REPLY_TIMEOUT_S) and parent.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
        process.join(REPLY_TIMEOUT_S)
        if process.is_alive():
            process.kill()
