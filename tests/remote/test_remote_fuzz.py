"""What a peer reads from another, fuzzed: a descriptor cut short, bytes flipped, fields of its layout deleted,
of another type or huge, and the NIXL agent metadata inside it garbled. Every input ends in a pool, or in
kvcopy's own clear error naming ``remote_descriptor`` (FileFormatError for its format, ValueError where NIXL
refuses the metadata): never a crash, a hang, or an exception of json's, torch's or NIXL's."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcopy
from kvcopy.remote import descriptor as desc

HEADER = struct.Struct("<4sIII")  # magic, format, bytes of the JSON layout, CRC-32 of the rest (docs/remote.md)
# A valid layout to mutate: two planes of a page-first pool, as encode() writes it.
LAYOUT = desc.PoolLayout(
    "fuzz-holder",
    "page_first",
    64,
    ((1 << 20, 8192, 4096, "bfloat16"), ((1 << 20) + 4096, 8192, 4096, "bfloat16")),
    None,
)
METADATA = b"nixlSerDes|Agent\x0b\x00\x00\x00\x00\x00\x00\x00fuzz-holder|..."
GOOD = desc.encode(LAYOUT, METADATA)
FIELDS = ("agent", "layout", "num_blocks", "planes", "context_hash", "memory", "device_id")
# Values of every JSON type and the numbers that overflow C and float: what a type swap puts in a field.
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, 10**400]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _join(fields: object, metadata: bytes = METADATA) -> bytes:
    """A descriptor of these parts, signed (its checksum right): what a buggy or hostile peer could send."""
    return _signed(json.dumps(fields).encode(), metadata)


def _signed(text: bytes, metadata: bytes) -> bytes:
    return HEADER.pack(b"KVCP", desc.DESCRIPTOR_FORMAT, len(text), zlib.crc32(text + metadata)) + text + metadata


def _decodes_or_says_why(data: bytes) -> None:
    try:
        layout, metadata = desc.decode(data)
    except kvcopy.FileFormatError as err:
        assert str(err).startswith("remote_descriptor: "), err
        assert type(err) is kvcopy.FileFormatError
        return
    assert metadata and isinstance(layout, desc.PoolLayout)
    layout.plane_table()  # what a connect does with it next: every value fits
    assert layout.shape()


@FUZZ
@given(cut=st.integers(min_value=0, max_value=len(GOOD) - 1))
def test_a_descriptor_cut_short(cut):
    _decodes_or_says_why(GOOD[:cut])


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(1, 255)), min_size=1, max_size=4),
    signed=st.booleans(),
)
def test_a_descriptor_with_bytes_flipped(flips, signed):
    """Flipped in transit (its checksum refuses it), or by a peer that signs what it garbled."""
    data = bytearray(GOOD)
    for at, mask in flips:
        data[at] ^= mask
    if signed:
        data[12:16] = zlib.crc32(data[HEADER.size :]).to_bytes(4, "little")  # the header's CRC-32 field
    _decodes_or_says_why(bytes(data))


@FUZZ
@given(deleted=st.sets(st.sampled_from(FIELDS)), swapped=st.dictionaries(st.sampled_from(FIELDS), ODD_VALUES))
def test_a_layout_with_fields_deleted_or_of_another_type(deleted, swapped):
    fields = json.loads(GOOD[HEADER.size : HEADER.size + HEADER.unpack_from(GOOD)[2]])
    fields = {k: v for k, v in fields.items() if k not in deleted} | swapped
    _decodes_or_says_why(_join(fields))


@FUZZ
@given(plane=st.integers(0, 1), index=st.integers(0, 4), value=ODD_VALUES)
def test_a_plane_with_a_value_of_another_type_or_huge(plane, index, value):
    fields = json.loads(GOOD[HEADER.size : HEADER.size + HEADER.unpack_from(GOOD)[2]])
    row = fields["planes"][plane]
    if index < len(row):
        row[index] = value
    else:
        row.append(value)  # a fifth value
    _decodes_or_says_why(_join(fields))


@FUZZ
@given(top=ODD_VALUES)
def test_a_layout_that_is_not_an_object(top):
    _decodes_or_says_why(_join(top))


def test_deep_json_nesting_is_a_clear_error_not_a_recursion_error():
    _decodes_or_says_why(_join(json.loads("[" * 50 + "]" * 50)))
    text = b"[" * 100_000 + b"]" * 100_000
    _decodes_or_says_why(_signed(text, METADATA))


@pytest.fixture(scope="module")
def peers():
    pytest.importorskip("nixl_cu13", reason="the agent metadata is NIXL's (pip install 'kvcopy[nixl]')")
    from kvcopy.remote import KVPeer

    from helpers.remote import make_pool

    with (
        KVPeer(make_pool("bf16", 8, "page_first", seed=1), "fuzz-local") as local,
        KVPeer(make_pool("bf16", 8, "page_first", seed=2), "fuzz-other") as other,
    ):
        yield local, other


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_garbled_agent_metadata_is_a_clear_error_of_kvcopys(peers, data):
    """NIXL parses the metadata: garbled in transit, the checksum refuses it first; signed by a peer that garbled
    it, NIXL reads it, and kvcopy's connect says what happened in its own words (never one of NIXL's classes).
    NIXL 1.5 may keep a half-loaded agent after refusing its metadata, and then refuse that agent's good
    metadata too (docs/limits.md): so a later good connect may fail, but only ever in kvcopy's words too."""
    local, other = peers
    good = other.descriptor()
    length = HEADER.unpack_from(good)[2]
    text, metadata = good[HEADER.size : HEADER.size + length], bytearray(good[HEADER.size + length :])
    if data.draw(st.booleans(), label="cut"):
        metadata = metadata[: data.draw(st.integers(1, len(metadata) - 1), label="length")]
    for at, mask in data.draw(st.lists(st.tuples(st.integers(0, len(metadata) - 1), st.integers(1, 255)), max_size=4)):
        metadata[at] ^= mask
    signed = data.draw(st.booleans(), label="signed")
    sent = _signed(text, bytes(metadata)) if signed else good[: HEADER.size + length] + bytes(metadata)
    for descriptor in (sent, good):
        try:
            remote = local.connect(descriptor)
        except (ValueError, ConnectionError) as err:
            assert type(err) in (ValueError, kvcopy.FileFormatError, ConnectionError), type(err)
            assert str(err).startswith(("remote_descriptor: ", "remote: ")), err
            if not signed:
                assert descriptor == good or "checksum" in str(err)  # refused before NIXL saw it
        else:
            assert remote.agent == "fuzz-other"  # NIXL took it (a flip it does not read): the peer it names
