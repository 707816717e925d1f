"""DiskKVStore.open over corrupted files (hypothesis): a store's header.json, index.log and blocks.data come
from outside the process (a crashed writer, another version, a full disk, a hand), so each is truncated,
has bytes flipped or garbage appended, loses a field or has one swapped for another type or a huge number.
Every such store either is refused with a typed error naming its file, or opens, and then every block that
``match`` finds reads back bitwise as it was put, or is refused by its checksum. Never a crash, a hang, a
library's traceback, or a block served wrong."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcopy._checks import FileFormatError
from kvcopy.storage.store import CorruptBlockError, DiskKVStore

from helpers.storage import filled_pool, hashes, key, layout, store_files

NUM_BLOCKS, PUT = 4, 3  # a store with one slot free, so that a put block and an empty slot both get corrupted
FILES = ("header.json", "index.log", "blocks.data")
HEADER_FIELDS = ("format", "num_blocks", "context_hash", "layout", "planes", "nbytes_per_block")
# values a field may be swapped for: other types, huge and negative numbers, non-finite floats
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**31, 2**32, 2**63, 10**30, 1.0, 4.0, 1e308, float("inf"), float("nan")]),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=2**20), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def corruption(draw, sizes: dict[str, int]) -> tuple:
    """One change to one file: ("field", name, value | None to delete), ("top", value), or a byte-level one."""
    kind = draw(st.sampled_from(["field", "field", "top", "truncate", "flip", "append", "overwrite"]))
    if kind == "field":
        name = draw(st.sampled_from(HEADER_FIELDS))
        return ("field", name, draw(st.one_of(st.just(None), ODD_VALUES)))
    if kind == "top":
        return ("top", draw(st.one_of(st.lists(st.integers(), max_size=2), st.text(max_size=4), st.integers())))
    file = draw(st.sampled_from(FILES))
    size = sizes[file]
    if kind == "truncate":
        return ("truncate", file, draw(st.integers(0, max(size - 1, 0))))
    if kind == "flip":
        return ("flip", file, draw(st.integers(0, size - 1)), draw(st.integers(1, 255)))
    if kind == "append":
        return ("append", file, draw(st.binary(min_size=1, max_size=200)))
    at = draw(st.integers(0, size - 1))
    return ("overwrite", file, at, draw(st.binary(min_size=1, max_size=64)))


def apply(path: Path, change: tuple) -> None:
    """``change`` made to the store at ``path`` (after earlier ones: positions past a file's end now clamp, and
    a field change to a header that is no longer an object is skipped)."""
    kind = change[0]
    if kind in ("field", "top"):
        try:
            header = json.loads((path / "header.json").read_bytes())
        except ValueError:
            return
        if kind == "top":
            header = change[1]
        elif not isinstance(header, dict):
            return
        elif change[2] is None:
            header.pop(change[1], None)
        else:
            header[change[1]] = change[2]
        (path / "header.json").write_text(json.dumps(header))
        return
    target = path / change[1]
    data = bytearray(target.read_bytes())
    if kind == "append":
        data += change[2]
    elif data:
        at = min(change[2], len(data) - 1)
        if kind == "truncate":
            del data[at:]
        elif kind == "flip":
            data[at] ^= change[3]
        else:
            data[at : at + len(change[3])] = change[3]
    target.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A store of NUM_BLOCKS slots holding PUT blocks, reopened once (so its log holds its records alone: the
    zeros written ahead of appends are cut off, and byte-level changes land among the records)."""
    path = tmp_path_factory.mktemp("pristine") / "store"
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key()) as store:
        store.put(hashes(PUT), pool, list(range(PUT))).wait()
    DiskKVStore.open(path, pool, cache_key=key()).close()
    return path, pool


def _sizes(path: Path) -> dict[str, int]:
    return {name: len(data) for name, data in store_files(path).items()}


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_corrupted_store_is_refused_by_name_or_serves_only_right_blocks(pristine, data):
    source, pool = pristine
    changes = data.draw(st.lists(corruption(_sizes(source)), min_size=1, max_size=3))
    folder = Path(tempfile.mkdtemp(prefix="kvcopy-fuzz-"))
    try:
        path = folder / "store"
        shutil.copytree(source, path)
        for change in changes:
            apply(path, change)
        reader = filled_pool(layout(), 2)
        try:
            store = DiskKVStore.open(path, reader, cache_key=key(), backend="posix")
        except FileFormatError as err:
            assert str(path) in str(err) and err.file.startswith(str(path)), err
            event(f"refused: {Path(err.file).name} {err.field.split()[0]}")
            return
        except ValueError as err:  # the header, still well formed, now names another context or layout
            assert str(err).startswith(("cache_key: ", "like: ")) and str(path) in str(err), err
            event(f"refused: {str(err).split(':')[0]}")
            return
        with store:
            for i, block_hash in enumerate(hashes(PUT)):
                slots = store.match([block_hash])
                if not slots:
                    event("opened: a block lost with a torn tail")
                    continue  # its commit record was lost with a torn tail: never served
                try:
                    store.get(slots, reader, [10 + i]).wait()
                except CorruptBlockError as err:
                    assert err.slots == slots
                    event("opened: a corrupt block refused")
                    continue
                assert reader.block_bytes(10 + i).equal(pool.block_bytes(i)), (i, changes)
                event("opened: a block served right")
            assert store.match(hashes(2, start=PUT)) == []  # nothing that was never put
    finally:
        shutil.rmtree(folder, ignore_errors=True)
