"""What one peer tells another about its pool: the NIXL agent's metadata and the pool's layout, as bytes."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from kvcopy.layout import PLANE_ADDRESS, PLANE_BLOCK_BYTES, PLANE_BLOCK_STRIDE
from kvcopy.model.dtypes import torch_name
from kvcopy.nixl.registration import Registration

__all__ = ["DESCRIPTOR_FORMAT", "PoolLayout", "decode", "encode"]

# Bumped when the encoding changes: a peer refuses a descriptor of another format. 2: NIXL memory kind and
# device id of the pool (a PagedKV on a GPU is VRAM).
DESCRIPTOR_FORMAT = 2
_MAGIC = b"KVCP"
_HEADER = struct.Struct("<4sII")  # magic, format, bytes of the JSON layout that follows (then the agent metadata)
_FIELDS = ("agent", "layout", "num_blocks", "planes", "context_hash", "memory", "device_id")  # of the JSON layout


@dataclass(frozen=True)
class PoolLayout:
    """A pool as a remote peer sees it: its agent's name, ``page_first``, ``layer_first`` or ``paged`` (an
    engine's cache), its block count, one ``(address, block stride, block bytes, dtype)`` per plane (addresses
    in the owner's process), the context hash of its CacheKey (None without one), and where it lives: NIXL's
    memory kind (``DRAM`` or ``VRAM``) and device id."""

    agent: str
    layout: str
    num_blocks: int
    planes: tuple[tuple[int, int, int, str], ...]
    context_hash: str | None
    memory: str = "DRAM"
    device_id: int = 0

    @classmethod
    def of(cls, registration: Registration, agent: str, context_hash: str | None) -> PoolLayout:
        paged = registration.paged
        dtypes = [torch_name(d) for d in paged.dtypes]
        planes = tuple(
            (row[PLANE_ADDRESS], row[PLANE_BLOCK_STRIDE], row[PLANE_BLOCK_BYTES], dtype)
            for row, dtype in zip(paged.plane_table.tolist(), dtypes, strict=True)
        )
        return cls(
            agent,
            registration.layout,
            paged.num_blocks,
            planes,
            context_hash,
            registration.memory,
            registration.device_id,
        )

    def shape(self) -> tuple[str, tuple[tuple[int, str], ...]]:
        """What two pools must share to exchange blocks: the layout kind and each plane's block bytes and dtype."""
        return self.layout, tuple((nbytes, dtype) for _, _, nbytes, dtype in self.planes)

    def plane_table(self) -> torch.Tensor:
        """The plane table (kvcopy.layout) of this pool, at the owner's addresses: for planning ranges only."""
        return torch.tensor([[a, s, n] for a, s, n, _ in self.planes], dtype=torch.int64)


def encode(layout: PoolLayout, agent_metadata: bytes) -> bytes:
    text = json.dumps(
        {
            "agent": layout.agent,
            "layout": layout.layout,
            "num_blocks": layout.num_blocks,
            "planes": [list(p) for p in layout.planes],
            "context_hash": layout.context_hash,
            "memory": layout.memory,
            "device_id": layout.device_id,
        },
        sort_keys=True,
    ).encode()
    return _HEADER.pack(_MAGIC, DESCRIPTOR_FORMAT, len(text)) + text + agent_metadata


def decode(data: bytes) -> tuple[PoolLayout, bytes]:
    """(the pool's layout, the agent's metadata); ValueError for anything that is not a kvcopy descriptor."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"remote_descriptor: expected bytes from KVPeer.descriptor(), got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise ValueError(f"remote_descriptor: expected a KVPeer descriptor, got {len(data)} bytes")
    magic, version, length = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("remote_descriptor: not a KVPeer descriptor (no kvcopy header)")
    if version != DESCRIPTOR_FORMAT:
        raise ValueError(f"remote_descriptor: format {version}, this kvcopy reads format {DESCRIPTOR_FORMAT}")
    if len(data) < _HEADER.size + length:
        raise ValueError(
            f"remote_descriptor: cut short: its header announces {length} bytes of layout, "
            f"{len(data) - _HEADER.size} follow it"
        )
    try:
        fields = json.loads(data[_HEADER.size : _HEADER.size + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"remote_descriptor: its layout is not valid JSON ({err}): garbled in transit?") from None
    missing = [k for k in _FIELDS if not isinstance(fields, dict) or k not in fields]
    if missing:
        raise ValueError(f"remote_descriptor: its layout lacks {missing} (expected the fields {list(_FIELDS)})")
    try:
        planes = tuple((int(a), int(s), int(n), str(d)) for a, s, n, d in fields["planes"])
        layout = PoolLayout(
            str(fields["agent"]),
            str(fields["layout"]),
            int(fields["num_blocks"]),
            planes,
            None if fields["context_hash"] is None else str(fields["context_hash"]),
            str(fields["memory"]),
            int(fields["device_id"]),
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"remote_descriptor: a field of its layout has the wrong form ({err})") from None
    metadata = data[_HEADER.size + length :]
    if not metadata:
        raise ValueError("remote_descriptor: no NIXL agent metadata after the layout (cut short?)")
    return layout, metadata
