"""What one peer tells another about its pool: the NIXL agent's metadata and the pool's layout, as bytes."""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import torch

from kvcopy._checks import FileFormatError, file_field
from kvcopy.layout import PLANE_ADDRESS, PLANE_BLOCK_BYTES, PLANE_BLOCK_STRIDE
from kvcopy.model.dtypes import torch_name
from kvcopy.nixl.registration import DEVICE_LAYOUT, DRAM, VRAM, Registration

__all__ = ["DESCRIPTOR_FORMAT", "PoolLayout", "decode", "encode"]

# Bumped when the encoding changes: a peer refuses a descriptor of another format. 2: NIXL memory kind and
# device id of the pool (a PagedKV on a GPU is VRAM). 3: a CRC-32 of what follows the header, so that bytes
# garbled or cut short in transit are refused before NIXL reads its metadata (NIXL 1.5 keeps a half-loaded
# agent's connection after refusing its metadata, and then refuses that agent's good metadata too).
DESCRIPTOR_FORMAT = 3
_MAGIC = b"KVCP"
# magic, format, bytes of the JSON layout that follows (then the agent metadata), CRC-32 of all that follows
_HEADER = struct.Struct("<4sIII")


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
    body = text + agent_metadata
    return _HEADER.pack(_MAGIC, DESCRIPTOR_FORMAT, len(text), zlib.crc32(body)) + body


def decode(data: bytes) -> tuple[PoolLayout, bytes]:
    """(the pool's layout, the agent's metadata). TypeError for anything but bytes; FileFormatError (a
    ValueError) naming ``remote_descriptor`` and the field for bytes that are not a kvcopy descriptor of this
    format: cut short, garbled, a field missing or of the wrong type or out of range. Checked whole here, so
    that nothing later reads a value it cannot use."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"remote_descriptor: expected bytes from KVPeer.descriptor(), got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise FileFormatError(_NAME, "header", f"a KVPeer descriptor of at least {_HEADER.size} bytes", data)
    magic, version, length, checksum = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise FileFormatError(_NAME, "header", f"a KVPeer descriptor (magic {_MAGIC!r})", magic)
    if version != DESCRIPTOR_FORMAT:
        raise FileFormatError(_NAME, "format", f"format {DESCRIPTOR_FORMAT} (the one this kvcopy reads)", version)
    if len(data) < _HEADER.size + length:
        raise FileFormatError(
            _NAME, "layout", f"{length} bytes of layout, as its header announces (cut short?)", len(data) - _HEADER.size
        )
    if zlib.crc32(data[_HEADER.size :]) != checksum:
        raise FileFormatError(
            _NAME,
            "checksum",
            f"CRC-32 {checksum:#010x} of what follows the header (garbled or cut short in transit?)",
            f"{zlib.crc32(data[_HEADER.size :]):#010x}",
        )
    text = data[_HEADER.size : _HEADER.size + length]
    try:
        fields = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise FileFormatError(_NAME, "layout", "valid JSON (garbled in transit?)", text) from None
    layout = PoolLayout(
        file_field(fields, "agent", str, "a non-empty agent name", file=_NAME),
        file_field(fields, "layout", str, f"one of {list(_LAYOUT_KINDS)}", file=_NAME),
        file_field(fields, "num_blocks", int, "a positive int", file=_NAME),
        _planes(fields),
        _context_hash(fields),
        file_field(fields, "memory", str, f"one of {list(_MEMORY_KINDS)}", file=_NAME),
        file_field(fields, "device_id", int, "a device index (an int >= 0)", file=_NAME),
    )
    _check_values(layout)
    metadata = data[_HEADER.size + length :]
    if not metadata:
        raise FileFormatError(_NAME, "agent metadata", "NIXL agent metadata after the layout (cut short?)", b"")
    named = _metadata_agent(metadata)
    if named is not None and named != layout.agent.encode():
        # checked before NIXL sees it: NIXL would load it as another agent, which then spoils a later load
        raise FileFormatError(_NAME, "agent metadata", f"NIXL agent metadata of agent {layout.agent!r}", named)
    return layout, metadata


# How NIXL's metadata begins (its nixlSerDes): this tag, the agent name's length (8 bytes, little-endian), the
# name, and a separator. Metadata of another beginning is left to NIXL to read.
_SERDES_AGENT = b"nixlSerDes|Agent"
_SERDES_LENGTH = struct.Struct("<Q")


def _metadata_agent(metadata: bytes) -> bytes | None:
    """The agent name NIXL's metadata gives (its bytes, possibly cut short), or None when it does not begin as
    NIXL's serialization does."""
    if not metadata.startswith(_SERDES_AGENT):
        return None
    at = len(_SERDES_AGENT)
    if len(metadata) < at + _SERDES_LENGTH.size:
        return metadata[at:]
    (length,) = _SERDES_LENGTH.unpack_from(metadata, at)
    at += _SERDES_LENGTH.size
    return metadata[at : at + min(length, len(metadata))]


# What the errors name as the file: the descriptor comes as bytes, from any transport the caller chose.
_NAME = "remote_descriptor"
# The layout kinds a pool may have (kvcopy.host.pool's and an engine cache's) and NIXL's memory kinds.
_LAYOUT_KINDS = ("page_first", "layer_first", DEVICE_LAYOUT)
_MEMORY_KINDS = (DRAM, VRAM)
# Addresses, strides and byte counts are C int64s in the range planner: every byte of a plane below this.
_INT64_END = 1 << 63
# A plane's four values, in the order encode() writes them.
_PLANE_FIELDS = ("address", "stride", "bytes", "dtype")
# A CUDA device index (NIXL's device id is a 32-bit int).
_DEVICE_ID_END = 1 << 31


def _planes(fields: object) -> tuple[tuple[int, int, int, str], ...]:
    planes = file_field(fields, "planes", list, "a non-empty list of [address, stride, bytes, dtype]", file=_NAME)
    if not planes:
        raise FileFormatError(_NAME, "planes", "a non-empty list of [address, stride, bytes, dtype]", planes)
    parsed = []
    for i, plane in enumerate(planes):
        if not isinstance(plane, list) or len(plane) != 4:
            raise FileFormatError(_NAME, f"planes[{i}]", "[address, block stride, block bytes, dtype]", plane)
        row = dict(zip(_PLANE_FIELDS, plane, strict=True))
        at = f"planes[{i}]."
        address = file_field(row, "address", int, "an address (an int >= 0)", file=_NAME, at=at)
        stride = file_field(row, "stride", int, "a block stride (an int >= 0)", file=_NAME, at=at)
        nbytes = file_field(row, "bytes", int, "block bytes (an int >= 1)", file=_NAME, at=at)
        dtype = file_field(row, "dtype", str, "a dtype name such as 'bfloat16'", file=_NAME, at=at)
        parsed.append((address, stride, nbytes, dtype))
    return tuple(parsed)


def _context_hash(fields: object) -> str | None:
    return file_field(fields, "context_hash", (str, type(None)), "a context hash (str) or null", file=_NAME)


def _check_values(layout: PoolLayout) -> None:
    """FileFormatError for a value of the right type that no pool has."""
    if not layout.agent:
        raise FileFormatError(_NAME, "agent", "a non-empty agent name", layout.agent)
    if layout.layout not in _LAYOUT_KINDS:
        raise FileFormatError(_NAME, "layout", f"one of {list(_LAYOUT_KINDS)}", layout.layout)
    if not 1 <= layout.num_blocks < _INT64_END:
        raise FileFormatError(_NAME, "num_blocks", "a positive int below 2**63", layout.num_blocks)
    if layout.memory not in _MEMORY_KINDS:
        raise FileFormatError(_NAME, "memory", f"one of {list(_MEMORY_KINDS)}", layout.memory)
    if not 0 <= layout.device_id < _DEVICE_ID_END:
        raise FileFormatError(_NAME, "device_id", "a device index (an int >= 0, below 2**31)", layout.device_id)
    for i, (address, stride, nbytes, dtype) in enumerate(layout.planes):
        if address < 0 or stride < 0 or nbytes < 1 or not dtype:
            raise FileFormatError(
                _NAME, f"planes[{i}]", "address >= 0, stride >= 0, bytes >= 1 and a dtype name", layout.planes[i]
            )
        if address + (layout.num_blocks - 1) * stride + nbytes >= _INT64_END:
            raise FileFormatError(
                _NAME, f"planes[{i}]", f"a plane of {layout.num_blocks} blocks below address 2**63", layout.planes[i]
            )
