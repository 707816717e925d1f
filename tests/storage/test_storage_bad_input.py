"""A disk store's arguments and files checked before anything is written (kvcopy/storage): pool ids as
kvcopy.ids takes them and on the host (a meta tensor once crashed the process in the range planner), one form
of block hash, a wait whose argument is wrong that changes nothing, a transfer that failed saying so on every
later wait, and a store whose files disagree refused with a message naming the disagreement."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy import _ext
from kvcopy._checks import FileFormatError
from kvcopy.ranges import plan_table_ranges
from kvcopy.storage.store import CorruptBlockError, DiskKVStore

from helpers import HAS_CUDA
from helpers.storage import filled_pool, hashes, key, layout, store_files


def flip_byte(path: Path, offset: int) -> None:
    """One byte of ``path`` inverted on disk (a lost or rotted write the disk acknowledged)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- pool ids and slots


class _UnreachablePlanner:
    """The compiled extension with its range planner replaced: reaching it with a meta tensor's ids would have
    crashed the process (it reads them at their data pointer), so here reaching it at all fails the test."""

    def __init__(self) -> None:
        self._real = _ext.extension()

    def plan_copy_ranges(self, *args: object) -> list:
        raise AssertionError("the compiled range planner was reached with ids it cannot read")

    def __getattr__(self, name: str) -> object:  # the id checks and the rest: the real ones
        return getattr(self._real, name)


def test_ids_not_on_the_host_are_refused_before_the_planner_reads_them(tmp_path, monkeypatch):
    """A meta tensor's data pointer is no host address: get, put and the range planner read ids there, and
    crashed the process with it (a segfault in kvcopy.ranges.plan_table_ranges)."""
    pool = filled_pool(layout(), 1)
    meta = torch.tensor([0], device="meta")
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(hashes(1), pool, [0]).wait()
        before = store_files(tmp_path / "store")
        planner = _UnreachablePlanner()
        monkeypatch.setattr(_ext, "extension", lambda: planner)
        with pytest.raises(ValueError, match=r"^pool_ids: expected ids on the host \(cpu\), got ids on meta$"):
            store.get([0], pool, meta)
        with pytest.raises(ValueError, match=r"^slots: expected ids on the host \(cpu\), got ids on meta$"):
            store.get(meta, pool, [1])
        with pytest.raises(ValueError, match=r"^pool_ids: expected ids on the host \(cpu\), got ids on meta$"):
            store.put(hashes(1, start=5), pool, meta)
        with pytest.raises(
            ValueError, match=r"^src_ids: expected ids on the host \(the planner reads them there\), got ids on meta$"
        ):
            plan_table_ranges(store._table, meta, store._table, meta)
        with pytest.raises(ValueError, match=r"^src_table: expected a plane table on the host, got one on meta"):
            plan_table_ranges(store._table.to("meta"), torch.tensor([0]), store._table, torch.tensor([0]))
        assert store_files(tmp_path / "store") == before


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA ids need a GPU")
def test_cuda_ids_are_refused_by_a_store(tmp_path):
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key(), backend="posix") as store:
        store.put(hashes(1), pool, [0]).wait()
        before = store_files(tmp_path / "store")
        with pytest.raises(ValueError, match="pool_ids: expected ids on the host"):
            store.put(hashes(1, start=5), pool, torch.tensor([0], device="cuda"))
        with pytest.raises(ValueError, match="slots: expected ids on the host"):
            store.get(torch.tensor([0], device="cuda"), pool, [1])
        assert store_files(tmp_path / "store") == before


def test_pool_ids_of_another_form_are_refused_or_taken_as_kvcopy_ids_takes_them(tmp_path):
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    with DiskKVStore.create(tmp_path / "store", pool, 8, cache_key=key()) as store:
        before = store_files(tmp_path / "store")
        with pytest.raises(TypeError, match=r"pool_ids: expected dtype int32 or int64, got torch\.float32"):
            store.put(hashes(2), pool, torch.tensor([0.0, 1.0]))
        with pytest.raises(IndexError, match=r"pool_ids: expected ids in \[0, 32\), got 32"):
            store.put(hashes(2), pool, torch.tensor([0, 32]))
        with pytest.raises(IndexError, match=r"pool_ids: expected ids in \[0, 32\), got -1"):
            store.put(hashes(2), pool, [-1, 0])
        with pytest.raises(ValueError, match="pool_ids: expected a 1-D tensor"):
            store.put(hashes(2), pool, torch.tensor([[0, 1]]))
        assert store_files(tmp_path / "store") == before
        # int32 and a strided view are the ids they hold: written and read back as those blocks
        strided = torch.arange(0, 8, dtype=torch.int32)[::2]  # 0, 2, 4, 6: not contiguous
        store.put(hashes(4), pool, strided).wait()
        store.get(store.match(hashes(4)), other, torch.tensor([7, 5, 3, 1], dtype=torch.int32)[::1]).wait()
        assert all(other.block_bytes(7 - 2 * i).equal(pool.block_bytes(2 * i)) for i in range(4))
        with pytest.raises(IndexError, match=r"slots: expected ids in \[0, 8\), got 8"):
            store.get([8], other, [0])


# --------------------------------------------------------------------------- waits


@pytest.mark.parametrize(
    ("timeout", "error"), [(-1, ValueError), (math.nan, ValueError), ("x", TypeError), (True, TypeError)]
)
def test_a_wait_with_a_wrong_timeout_changes_nothing(tmp_path, timeout, error):
    """The put is still committed by the next right wait, and the get of a corrupt block still refused by it
    (a wrong timeout once ended both as failed, and the next wait returned as if they had succeeded)."""
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        put = store.put(hashes(2), pool, [0, 1])
        with pytest.raises(error, match="timeout: expected"):
            put.wait(timeout)
        put.wait()
        slots = store.match(hashes(2))
        assert len(slots) == 2  # committed
        flip_byte(tmp_path / "store" / "blocks.data", slots[1] * pool.nbytes_per_block + 7)
        store.drop_page_cache()
        get = store.get(slots, other, [4, 5])
        with pytest.raises(error, match="timeout: expected"):
            get.wait(timeout)
        with pytest.raises(CorruptBlockError, match=rf"slots \[{slots[1]}\]"):
            get.wait()


def test_a_transfer_that_failed_says_so_on_every_later_wait_and_done(tmp_path):
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(hashes(2), pool, [0, 1]).wait()
        slots = store.match(hashes(2))
        flip_byte(tmp_path / "store" / "blocks.data", slots[0] * pool.nbytes_per_block)
        store.drop_page_cache()
        get = store.get(slots, other, [4, 5])
        with pytest.raises(CorruptBlockError):
            get.wait()
        for _ in range(2):
            with pytest.raises(CorruptBlockError):
                get.wait()
            with pytest.raises(CorruptBlockError):
                get.done()
        good = store.get(slots[1:], other, [6])  # the slots came free: a later get of the good block reads it
        good.wait()
        assert good.done() and other.block_bytes(6).equal(pool.block_bytes(1))


def test_a_data_file_truncated_while_open_is_named_as_the_cause(tmp_path):
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(hashes(4), pool, [0, 1, 2, 3]).wait()
        os.truncate(tmp_path / "store" / "blocks.data", 2 * pool.nbytes_per_block)
        store.drop_page_cache()
        with pytest.raises(RuntimeError, match=r"blocks.data is \d+ bytes, shorter than the \d+ its 4 blocks need"):
            store.get(store.match(hashes(4)), other, [4, 5, 6, 7]).wait()


# --------------------------------------------------------------------------- block hashes


BAD_HASHES = {
    "non-hex": ("g" * 64, ValueError),
    "40 digits (SHA-1)": ("a" * 40, ValueError),
    "65 digits": ("a" * 65, ValueError),
    "spaces fromhex skips": ("ab " * 21 + "a", ValueError),
    "raw digest bytes": (bytes(32), TypeError),
    "an int": (5, TypeError),
    "None": (None, TypeError),
}


@pytest.mark.parametrize("bad", list(BAD_HASHES))
def test_a_malformed_hash_on_a_full_store_evicts_and_writes_nothing(tmp_path, bad):
    """It used to be parsed after the eviction and after NIXL's write was posted: a full store lost its least
    recently used block for good."""
    value, error = BAD_HASHES[bad]
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(hashes(4), pool, [0, 1, 2, 3]).wait()  # full
        before = store_files(tmp_path / "store")
        with pytest.raises(error, match=r"block_hashes\[1\]: expected"):
            store.put([hashes(1, start=10)[0], value], pool, [4, 5])
        with pytest.raises(error, match=r"block_hashes\[0\]: expected"):
            store.match([value])
        assert store_files(tmp_path / "store") == before
        assert len(store.match(hashes(4))) == 4  # every block still there


def test_block_hashes_must_be_a_sequence_of_hashes(tmp_path):
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(hashes(1), pool, [0]).wait()
        for value in (hashes(1)[0], None, 5):
            with pytest.raises(TypeError, match="block_hashes: expected a sequence of block hashes"):
                store.match(value)
            with pytest.raises(TypeError, match="block_hashes: expected a sequence of block hashes"):
                store.put(value, pool, [1])


def test_uppercase_hashes_match_alike_before_and_after_a_reopen(tmp_path):
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    upper = [h.upper() for h in hashes(3)]
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(upper, pool, [0, 1, 2]).wait()
        slots = store.match(hashes(3))
        assert len(slots) == 3 and store.match(upper) == slots
        assert store.put(hashes(3), pool, [0, 1, 2]).num_descriptors == 0  # the same blocks: stored already
    with DiskKVStore.open(tmp_path / "store", other, cache_key=key()) as store:
        assert store.match(upper) == store.match(hashes(3)) == slots
        store.get(slots, other, [4, 5, 6]).wait()
        assert all(other.block_bytes(4 + i).equal(pool.block_bytes(i)) for i in range(3))


# --------------------------------------------------------------------------- create's and open's arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_blocks": 10**30}, ValueError, "num_blocks: expected at most"),
        ({"num_blocks": 4.0}, TypeError, "num_blocks: expected a positive int, got float"),
        ({"num_blocks": True}, TypeError, "num_blocks: expected a positive int, got bool"),
        ({"num_blocks": "4"}, TypeError, "num_blocks: expected a positive int, got str"),
        ({"num_blocks": 0}, ValueError, "num_blocks: expected a positive int"),
        ({"backend": 1}, TypeError, "backend: expected one of"),
        ({"path": 123}, TypeError, "path: expected a path"),
        ({"path": None}, TypeError, "path: expected a path"),
        ({"path": b"store"}, TypeError, "path: expected a path"),
    ],
)
def test_create_refuses_a_wrong_argument_and_leaves_nothing(tmp_path, kwargs, error, message):
    arguments = {"path": tmp_path / "store", "num_blocks": 4, **kwargs}
    path, num_blocks = arguments.pop("path"), arguments.pop("num_blocks")
    os.chdir(tmp_path)  # b"store" would be made here
    with pytest.raises(error, match=message):
        DiskKVStore.create(path, filled_pool(layout(), 1), num_blocks, cache_key=key(), **arguments)
    assert list(tmp_path.iterdir()) == []


def test_open_refuses_a_wrong_path_or_backend(tmp_path):
    pool = filled_pool(layout(), 1)
    DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()).close()
    with pytest.raises(TypeError, match="path: expected a path"):
        DiskKVStore.open(123, pool, cache_key=key())
    with pytest.raises(TypeError, match="backend: expected one of"):
        DiskKVStore.open(tmp_path / "store", pool, cache_key=key(), backend=None)


def test_open_of_a_file_says_it_is_a_file_not_a_store_and_changes_nothing(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"not a store")
    pool = filled_pool(layout(), 1)
    with pytest.raises(NotADirectoryError, match=rf"^path: {re.escape(str(afile))} is a file, not a disk store"):
        DiskKVStore.open(afile, pool, cache_key=key())
    under = afile / "store"
    message = f"^path: no disk store at {re.escape(str(under))}: it lies under {re.escape(str(afile))}, which is a"
    with pytest.raises(NotADirectoryError, match=message):
        DiskKVStore.open(under, pool, cache_key=key())
    assert afile.read_bytes() == b"not a store" and list(tmp_path.iterdir()) == [afile]


def test_a_pool_of_another_layout_is_told_what_differs(tmp_path):
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        other = filled_pool(layout("fp8_scales"), 1)
        with pytest.raises(ValueError, match="pool: the store holds plane 0 of 4096 bytes of bfloat16 per block, not"):
            store.put(hashes(1), other, [0])
        paged = layout()
        layer_first = kvcopy.HostKVPool(paged, paged.num_blocks, pin_memory=False, layout="layer_first")
        with pytest.raises(ValueError, match="pool: the store keeps page_first blocks, this pool is laid out"):
            store.put(hashes(1), layer_first, [0])


@pytest.mark.skipif(HAS_CUDA, reason="a GPU may have GPUDirect Storage")
def test_gds_without_a_gpu_prints_nothing_of_its_own(tmp_path, capfd):
    with pytest.raises(RuntimeError, match="GDS backend"):
        DiskKVStore.create(tmp_path / "store", filled_pool(layout(), 1), 4, cache_key=key(), backend="gds")
    out, err = capfd.readouterr()
    assert "cuFile" not in out + err and "gds_utils" not in out + err and "createBackend" not in out + err


def test_native_output_is_captured_and_given_back():
    """What compiled code prints to the process's stdout and stderr during a GDS start lands in the error
    (or is printed again when it starts), never loose among the caller's output."""
    import ctypes

    from kvcopy.storage.files import native_output_captured

    libc = ctypes.CDLL(None)
    with native_output_captured() as printed:
        libc.write(1, b"to stdout\n", 10)
        libc.write(2, b"to stderr\n", 10)
    assert printed == ["to stdout", "to stderr"]


# --------------------------------------------------------------------------- a store's files


def _made(tmp_path: Path, num_blocks: int = 4, put: int = 4) -> tuple[Path, kvcopy.HostKVPool]:
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, num_blocks, cache_key=key()) as store:
        store.put(hashes(put), pool, list(range(put))).wait()
    return tmp_path / "store", pool


def _open_refused(path: Path, pool, match: str) -> None:
    before = store_files(path)
    with pytest.raises(FileFormatError, match=match):
        DiskKVStore.open(path, pool, cache_key=key())
    assert store_files(path) == before  # nothing changed, nothing cut off


def test_a_header_that_is_not_an_object_or_lacks_a_field_is_named(tmp_path):
    path, pool = _made(tmp_path)
    header = json.loads((path / "header.json").read_text())
    (path / "header.json").write_text(json.dumps([header]))
    _open_refused(path, pool, r"header.json: \(top level\): expected an object, found \[")
    for field in ("format", "num_blocks", "context_hash", "planes", "nbytes_per_block"):
        (path / "header.json").write_text(json.dumps({k: v for k, v in header.items() if k != field}))
        _open_refused(path, pool, rf"header.json: {field}: expected .*, found nothing: the field is missing")
    (path / "header.json").write_text(json.dumps({**header, "num_blocks": "4"}))
    _open_refused(path, pool, "header.json: num_blocks: expected a positive int, found '4'")
    (path / "header.json").write_text(json.dumps({**header, "num_blocks": 10**30}))
    _open_refused(path, pool, r"header.json: num_blocks: expected an int in \[1, ")
    (path / "header.json").write_bytes(b"\xff\xfe not json")
    _open_refused(path, pool, r"header.json: \(the file\): expected a JSON object")


def test_a_header_with_more_blocks_than_the_data_file_is_refused(tmp_path):
    """Puts would have written past the data file's end."""
    path, pool = _made(tmp_path)
    header = json.loads((path / "header.json").read_text())
    (path / "header.json").write_text(json.dumps({**header, "num_blocks": 8}))
    _open_refused(
        path,
        pool,
        r"blocks.data: size: expected \d+ bytes: header.json's num_blocks 8 x .*the header and the data file disagree",
    )


def test_a_header_with_fewer_blocks_than_the_log_holds_is_refused_and_the_log_kept(tmp_path):
    """Opening used to cut the log at the first record beyond the header's blocks: those blocks, lost for good."""
    path, pool = _made(tmp_path)
    header = json.loads((path / "header.json").read_text())
    (path / "header.json").write_text(json.dumps({**header, "num_blocks": 2, "room": 2}))
    os.truncate(path / "blocks.data", 2 * pool.nbytes_per_block)  # the data file agrees with the header
    _open_refused(path, pool, r"index.log: record 2 slot: expected a slot below the store's 2 \(header.json\)")


def test_a_missing_or_empty_index_is_refused_not_an_empty_store(tmp_path):
    path, pool = _made(tmp_path)
    log = (path / "index.log").read_bytes()
    (path / "index.log").unlink()
    _open_refused(path, pool, r"index.log: \(the file\): expected the store's index.*the file is missing")
    (path / "index.log").write_bytes(b"")
    _open_refused(path, pool, "index.log: magic: expected a kvcopy disk-store log")
    (path / "index.log").write_bytes(log)
    with DiskKVStore.open(path, pool, cache_key=key()) as store:
        assert len(store.match(hashes(4))) == 4


def test_a_missing_data_file_is_named(tmp_path):
    path, pool = _made(tmp_path)
    (path / "blocks.data").unlink()
    _open_refused(path, pool, r"blocks.data: \(the file\): expected the store's data file.*missing")
