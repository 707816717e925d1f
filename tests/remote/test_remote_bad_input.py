"""kvcopy.remote's edge, tried as a new user would: every bad input is a ValueError or TypeError naming the
argument, raised by kvcopy (never NIXL's own exception classes, never a JSONDecodeError or KeyError), before
anything moves."""

from __future__ import annotations

import json
import struct

import pytest

pytest.importorskip("nixl_cu13", reason="kvcopy.remote needs the nixl extra (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy.remote import KVPeer
from kvcopy.remote import descriptor as desc

from helpers.remote import make_pool

HEADER = struct.Struct("<4sII")  # the descriptor's header, as docs/decisions.md describes it: magic, format, length


def _parts(data: bytes) -> tuple[bytes, dict, bytes]:
    """(header, layout fields, agent metadata) of a descriptor, split here by its documented format."""
    _, _, length = HEADER.unpack_from(data)
    return data[: HEADER.size], json.loads(data[HEADER.size : HEADER.size + length]), data[HEADER.size + length :]


def _join(fields: dict, metadata: bytes) -> bytes:
    text = json.dumps(fields).encode()
    return HEADER.pack(b"KVCP", desc.DESCRIPTOR_FORMAT, len(text)) + text + metadata


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
        "cut inside the header": (good[: HEADER.size - 3], "expected a KVPeer descriptor"),
        "cut inside the layout": (good[: HEADER.size + len(layout) // 2], "cut short"),
        "garbled layout": (bytes(garbled), "not valid JSON"),
        "a field missing": (_join(no_planes, metadata), r"lacks \['planes'\]"),
        "a field of the wrong form": (_join({**fields, "num_blocks": "many"}, metadata), "wrong form"),
        "no agent metadata": (header + layout, "no NIXL agent metadata"),
        "agent metadata cut short": (header + layout + metadata[: len(metadata) // 2], "NIXL refused the agent"),
        "agent metadata cut to a few bytes": (header + layout + metadata[:8], "NIXL refused the agent"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "cut inside the header",
        "cut inside the layout",
        "garbled layout",
        "a field missing",
        "a field of the wrong form",
        "no agent metadata",
        "agent metadata cut short",
        "agent metadata cut to a few bytes",
    ],
)
def test_a_broken_descriptor_is_a_value_error_naming_it(peers, case):
    local, other = peers
    data, message = _cases(other.descriptor())[case]
    with pytest.raises(ValueError, match=rf"remote_descriptor: .*{message}") as caught:
        local.connect(data)
    assert type(caught.value) is ValueError  # not NIXL's, not json's (a JSONDecodeError is a ValueError too)
    assert local.connect(other.descriptor()) is not None  # the peer still works


def test_a_descriptor_of_a_newer_format_is_refused_by_name():
    layout = desc.PoolLayout("peer-a", "page_first", 4, ((4096, 512, 512, "bfloat16"),), None)
    data = bytearray(desc.encode(layout, b"metadata"))
    data[4:8] = (desc.DESCRIPTOR_FORMAT + 1).to_bytes(4, "little")
    with pytest.raises(ValueError, match=rf"remote_descriptor: format {desc.DESCRIPTOR_FORMAT + 1}, this"):
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
    with pytest.raises(TypeError, match="timeout: expected seconds"):
        transfer.wait(timeout="x")
    with pytest.raises(ValueError, match="timeout: expected seconds >= 0"):
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
    with pytest.raises(ValueError, match=rf"profile: {tmp_path} is a directory"):
        kvcopy.Profile.load(tmp_path)
