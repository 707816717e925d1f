"""kvcopy.remote's edge, tried as a new user would: every bad input is a ValueError or TypeError naming the
argument, raised by kvcopy (never NIXL's own exception classes, never a JSONDecodeError or KeyError), before
anything moves."""

from __future__ import annotations

import contextlib
import json
import struct
import zlib

import pytest

pytest.importorskip("nixl_cu13", reason="kvcopy.remote needs the nixl extra (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy.remote import KVPeer
from kvcopy.remote import descriptor as desc

from helpers.remote import make_pool

HEADER = struct.Struct("<4sIII")  # the descriptor's header (docs/remote.md): magic, format, length, CRC-32


def _parts(data: bytes) -> tuple[bytes, dict, bytes]:
    """(header, layout fields, agent metadata) of a descriptor, split here by its documented format."""
    _, _, length, _ = HEADER.unpack_from(data)
    return data[: HEADER.size], json.loads(data[HEADER.size : HEADER.size + length]), data[HEADER.size + length :]


def _join(fields: dict, metadata: bytes) -> bytes:
    """A descriptor of these parts, signed (its checksum right): what a buggy or hostile peer could send."""
    text = json.dumps(fields).encode()
    return HEADER.pack(b"KVCP", desc.DESCRIPTOR_FORMAT, len(text), zlib.crc32(text + metadata)) + text + metadata


@pytest.fixture(scope="module")
def peers():
    """Two peers in this process: ``local`` connects to ``other``'s descriptor."""
    with (
        KVPeer(make_pool("bf16", 8, "page_first", seed=1), "bad-input-local") as local,
        KVPeer(make_pool("bf16", 8, "page_first", seed=2), "bad-input-other") as other,
    ):
        yield local, other


def _cases(good: bytes) -> dict[str, tuple[bytes, str]]:
    header, fields, metadata = _parts(good)
    layout = json.dumps(fields).encode()
    garbled = bytearray(good)
    garbled[HEADER.size + 2 : HEADER.size + 6] = b"\xff\x00{]"
    no_planes = {k: v for k, v in fields.items() if k != "planes"}
    return {
        "cut inside the header": (good[: HEADER.size - 3], r"header: expected a KVPeer descriptor of at least 16"),
        "cut inside the layout": (good[: HEADER.size + len(layout) // 2], "layout: expected .* bytes of layout"),
        "garbled layout": (bytes(garbled), r"checksum: expected CRC-32 .* \(garbled or cut short in transit"),
        "garbled layout, signed": (_join_text(bytes(garbled[HEADER.size :])), "layout: expected valid JSON"),
        "a field missing": (_join(no_planes, metadata), "planes: expected .*, found nothing: the field is missing"),
        "a field of the wrong form": (_join({**fields, "num_blocks": "many"}, metadata), "num_blocks: expected a"),
        "no agent metadata": (header + layout, "checksum: expected CRC-32"),
        "no agent metadata, signed": (_join(fields, b""), "agent metadata: expected NIXL agent metadata"),
        "agent metadata of another agent": (_join(fields, metadata.replace(b"other", b"OTHER")), "of agent"),
        "agent metadata cut short": (header + layout + metadata[: len(metadata) // 2], "checksum: expected"),
        "agent metadata cut to a few bytes": (header + layout + metadata[:8], "checksum: expected"),
        "agent metadata cut short, signed": (_join(fields, metadata[: len(metadata) // 2]), "NIXL refused the agent"),
        "agent metadata cut to a few bytes, signed": (_join(fields, metadata[:8]), "NIXL refused the agent"),
    }


def _join_text(body: bytes) -> bytes:
    """``body`` (layout and metadata as sent) behind a header whose length and checksum match it."""
    length = body.index(b"}") + 1 if b"}" in body else len(body)
    return HEADER.pack(b"KVCP", desc.DESCRIPTOR_FORMAT, length, zlib.crc32(body)) + body


CASES = list(_cases(desc.encode(desc.PoolLayout("x", "page_first", 1, ((0, 1, 1, "uint8"),), None), b"m")))


@pytest.mark.parametrize("case", CASES)
def test_a_broken_descriptor_is_a_value_error_naming_it(peers, case):
    local, other = peers
    data, message = _cases(other.descriptor())[case]
    # Metadata NIXL refuses spoils the agent's name in the NIXL agent that read it (NIXL 1.5 keeps the half-loaded
    # connection): a peer of its own reads it.
    refused_by_nixl = "NIXL refused" in message
    reader = KVPeer(make_pool("bf16", 8, "page_first", seed=5), "bad-input-nixl") if refused_by_nixl else local
    with (
        reader if refused_by_nixl else contextlib.nullcontext(),
        pytest.raises(ValueError, match=rf"remote_descriptor: .*{message}") as caught,
    ):
        reader.connect(data)
    # kvcopy's own (the descriptor's format: FileFormatError), never NIXL's or json's (a JSONDecodeError is a
    # ValueError too)
    assert type(caught.value) in (ValueError, kvcopy.FileFormatError)
    if not refused_by_nixl:
        assert local.connect(other.descriptor()) is not None  # the peer still works


def test_a_descriptor_of_a_newer_format_is_refused_by_name():
    layout = desc.PoolLayout("peer-a", "page_first", 4, ((4096, 512, 512, "bfloat16"),), None)
    data = bytearray(desc.encode(layout, b"metadata"))
    data[4:8] = (desc.DESCRIPTOR_FORMAT + 1).to_bytes(4, "little")
    with pytest.raises(
        kvcopy.FileFormatError,
        match=rf"remote_descriptor: format: expected format {desc.DESCRIPTOR_FORMAT} .*, "
        rf"found {desc.DESCRIPTOR_FORMAT + 1}",
    ):
        desc.decode(bytes(data))
    assert desc.decode(desc.encode(layout, b"metadata")) == (layout, b"metadata")  # the format it reads


def test_ones_own_descriptor_is_refused(peers):
    local, _ = peers
    with pytest.raises(ValueError, match=r"remote_descriptor: .*this peer's own name"):
        local.connect(local.descriptor())


def test_backends_are_checked():
    pool = make_pool("bf16", 4, "page_first", seed=3)
    with pytest.raises(TypeError, match=r"backends: expected a tuple of NIXL backend names.*'UCX'"):
        KVPeer(pool, "bad-backends-str", backends="UCX")
    with pytest.raises(TypeError, match=r"progress_thread: expected a bool, got str"):
        KVPeer(pool, "bad-progress", progress_thread="no")
    with pytest.raises(ValueError, match=r"backends: NIXL could not start \['NO_SUCH_BACKEND'\]") as caught:
        KVPeer(pool, "bad-backends-name", backends=("NO_SUCH_BACKEND",))
    assert type(caught.value) is ValueError


def test_a_wait_timeout_must_be_seconds(peers):
    local, other = peers
    remote = local.connect(other.descriptor())
    transfer = local.read(remote, [0], [1])
    with pytest.raises(TypeError, match="timeout: expected a finite number >= 0, got str"):
        transfer.wait(timeout="x")
    with pytest.raises(ValueError, match="timeout: expected a finite number >= 0, got nan"):
        transfer.wait(timeout=float("nan"))
    transfer.wait(60)


def test_a_pool_of_another_peer_says_what_differs_not_its_layout(peers):
    local, other = peers
    with KVPeer(make_pool("bf16", 8, "page_first", seed=4), "bad-input-third") as third:
        theirs = third.connect(other.descriptor())
        with pytest.raises(
            ValueError, match="'bad-input-other' is not this peer's to use: KVPeer 'bad-input-third' connected it"
        ) as caught:
            local.read(theirs, [0], [0])
    assert "0x" not in str(caught.value) and "planes" not in str(caught.value)  # no layout, no addresses
    with pytest.raises(TypeError, match="remote: expected a RemotePool"):
        local.read("bad-input-other", [0], [0])


def test_a_directory_as_the_profile_is_a_value_error(tmp_path):
    with pytest.raises(kvcopy.FileFormatError, match=rf"^{tmp_path}: \(the file\): .* found a directory$"):
        kvcopy.Profile.load(tmp_path)
