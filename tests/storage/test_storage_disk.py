"""kvcopy.storage.store.DiskKVStore on the CPU: bitwise round trips through NIXL's POSIX backend, persistence
across processes, refusal of another CacheKey or layout, eviction, coalescing, corruption found, bad input, and
a writer killed with SIGKILL mid-put whose committed blocks all read back right; the GDS backend refused where
there is no GPU, and the checksum of a PagedKV's blocks (tests/storage/test_storage_gds.py runs GDS on a GPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import xxhash
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy.storage.files import fill_with_zeros
from kvcopy.storage.gpu_blocks import paged_block_bytes, paged_checksums
from kvcopy.storage.store import CorruptBlockError, DiskKVStore

from helpers import HAS_CUDA
from helpers.exit_status import assert_ucx_modules_chosen_for_this_machine, run_python
from helpers.forked import Child
from helpers.storage import filled_pool, hashes, key, layout

NUM_BLOCKS = 16
# tests/, where the processes a test starts find the helpers
TESTS = str(Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("kind", ["bf16", "fp8_scales"])
def test_put_then_get_is_bitwise_for_random_ids(tmp_path, kind):
    paged = layout(kind)
    src, dst = filled_pool(paged, 1), filled_pool(paged, 2)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(32, generator=gen)[:10]
    with DiskKVStore.create(tmp_path / "store", src, NUM_BLOCKS, cache_key=key()) as store:
        store.put(hashes(10), src, ids).wait()
        slots = store.match(hashes(10))
        assert len(slots) == 10
        back = torch.randperm(32, generator=gen)[:10]
        store.get(slots, dst, back).wait()
        for i, j in zip(ids.tolist(), back.tolist(), strict=True):
            assert torch.equal(src.block_bytes(i), dst.block_bytes(j))


@pytest.mark.slow
def test_a_store_survives_its_process(tmp_path):
    path = tmp_path / "store"
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {TESTS!r})
        from helpers.storage import filled_pool, hashes, key, layout
        from kvcopy.storage.store import DiskKVStore
        pool = filled_pool(layout(), 1)
        with DiskKVStore.create({str(path)!r}, pool, {NUM_BLOCKS}, cache_key=key()) as store:
            store.put(hashes(8), pool, list(range(8))).wait()
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    src, dst = filled_pool(layout(), 1), filled_pool(layout(), 9)
    with DiskKVStore.open(path, dst, cache_key=key()) as store:
        slots = store.match(hashes(8) + hashes(1, start=99))
        assert len(slots) == 8  # the prefix present, then the first unknown hash ends it
        store.get(slots, dst, list(range(8, 16))).wait()
    for i in range(8):
        assert torch.equal(src.block_bytes(i), dst.block_bytes(8 + i))


@pytest.mark.slow
def test_a_process_that_used_a_store_exits_with_status_0(tmp_path):
    code = f"""
        import torch
        from helpers.storage import filled_pool, hashes, key, layout
        from kvcopy.storage import DiskKVStore
        src, dst = filled_pool(layout(), 1), filled_pool(layout(), 2)
        with DiskKVStore.create({str(tmp_path / "store")!r}, src, 8, cache_key=key()) as store:
            store.put(hashes(4), src, [0, 1, 2, 3]).wait()
            store.get(store.match(hashes(4)), dst, [4, 5, 6, 7]).wait()
        print("read back:", all(torch.equal(src.block_bytes(i), dst.block_bytes(4 + i)) for i in range(4)))
    """
    result = run_python(code)
    assert result.returncode == 0, result.described
    assert "read back: True" in result.stdout, result.described
    assert_ucx_modules_chosen_for_this_machine(result)


def test_another_cache_key_or_layout_is_refused(tmp_path):
    pool = filled_pool(layout(), 1)
    DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key()).close()
    with pytest.raises(ValueError, match=r"cache_key: .* holds blocks of CacheKey context"):
        DiskKVStore.open(tmp_path / "store", pool, cache_key=key("other weights"))
    with pytest.raises(ValueError, match=r"like: .* holds plane 0 of 4096 bytes of bfloat16 per block, not 2048 "):
        DiskKVStore.open(tmp_path / "store", layout("fp8_scales"), cache_key=key())
    with pytest.raises(FileExistsError):
        DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key())


def test_a_full_store_evicts_the_least_recently_used(tmp_path):
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(hashes(4), pool, [0, 1, 2, 3]).wait()
        store.match(hashes(1))  # block 0 used again: block 1 is now the least recent
        store.put(hashes(1, start=10), pool, [4]).wait()
        assert store.match(hashes(1, start=1)) == []  # evicted
        assert len(store.match(hashes(1))) == 1 and len(store.match(hashes(1, start=10))) == 1


def test_a_run_of_adjacent_blocks_is_one_descriptor(tmp_path):
    paged = layout(num_blocks=64)
    pool = filled_pool(paged, 1)
    with DiskKVStore.create(tmp_path / "store", pool, 64, cache_key=key()) as store:
        put = store.put(hashes(64), pool, list(range(64)))
        assert put.num_descriptors == 1 and put.nbytes == 64 * pool.nbytes_per_block
        put.wait()
        scattered = store.get(store.match(hashes(64))[::2], pool, list(range(0, 64, 2)))
        assert scattered.num_descriptors == 32
        scattered.wait()


def test_a_put_of_stored_hashes_and_a_get_of_nothing_move_nothing(tmp_path):
    """An engine saving a prefix it saved before (a second run) or resuming with no hit: done at once."""
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    with DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key()) as store:
        store.put(hashes(3), pool, [0, 1, 2]).wait()
        slots = store.match(hashes(3))
        again = store.put(hashes(3), other, [0, 1, 2])  # the same hashes, other bytes: the stored blocks stay
        assert again.done() and again.num_descriptors == 0 and again.nbytes == 0
        again.wait()
        nothing = store.get([], other, [])
        assert nothing.done() and nothing.num_descriptors == 0
        assert store.match(hashes(3)) == slots
        store.get(slots, other, [3, 4, 5]).wait()
        assert all(other.block_bytes(3 + i).equal(pool.block_bytes(i)) for i in range(3))


def test_a_corrupt_block_is_named_never_returned(tmp_path):
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    with DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key()) as store:
        store.put(hashes(3), pool, [0, 1, 2]).wait()
        slots = store.match(hashes(3))
        with open(tmp_path / "store" / "blocks.data", "r+b") as f:  # a lost write the disk acknowledged
            f.seek(slots[1] * pool.nbytes_per_block + 100)
            f.write(b"\x00" * 8)
            f.flush()
            os.fsync(f.fileno())
        store.drop_page_cache()
        with pytest.raises(CorruptBlockError, match=rf"slots \[{slots[1]}\]") as caught:
            store.get(slots, other, [5, 6, 7]).wait()
        assert caught.value.slots == [slots[1]]
        store.get(slots, other, [5, 6, 7], verify=False).wait()  # unchecked: the bytes as the disk has them
        assert other.block_bytes(5).equal(pool.block_bytes(0)) and other.block_bytes(7).equal(pool.block_bytes(2))
        changed = (other.block_bytes(6) != pool.block_bytes(1)).nonzero().flatten().tolist()
        assert changed and set(changed) <= set(range(100, 108))  # only where the disk lost the write


def test_a_put_that_fails_after_its_write_began_commits_nothing_and_frees_its_slots(tmp_path, monkeypatch):
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key()) as store:

        def failing_checksums(pool, ids):  # as a GPU's gather might, mid-put
            raise RuntimeError("the checksums failed")

        monkeypatch.setattr(store, "_checksums", failing_checksums)
        with pytest.raises(RuntimeError, match="the checksums failed"):
            store.put(hashes(4), pool, [0, 1, 2, 3])
        monkeypatch.undo()
        assert store.match(hashes(4)) == []  # never committed
        store.put(hashes(NUM_BLOCKS, start=100), pool, list(range(NUM_BLOCKS))).wait()  # every slot is free again
        assert len(store.match(hashes(NUM_BLOCKS, start=100))) == NUM_BLOCKS


def test_fill_with_zeros_writes_the_whole_data_file_and_not_the_index(tmp_path):
    pool = filled_pool(layout(), 1)
    DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key()).close()
    data = tmp_path / "store" / "blocks.data"
    with open(data, "r+b") as f:  # not zeros yet: fallocate's reservation reads as zeros, so mark it
        f.write(b"\xff" * 4096)
    index = (tmp_path / "store" / "index.log").read_bytes()
    fill_with_zeros(str(tmp_path / "store"))
    assert data.stat().st_size == NUM_BLOCKS * pool.nbytes_per_block
    assert data.read_bytes() == bytes(NUM_BLOCKS * pool.nbytes_per_block)
    assert (tmp_path / "store" / "index.log").read_bytes() == index


def test_bad_input_fails_before_anything_is_written(tmp_path):
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key()) as store:
        with pytest.raises(ValueError, match="pool_ids: expected 2 ids, got 1"):
            store.put(hashes(2), pool, [0])
        with pytest.raises(ValueError, match="block_hashes: expected distinct hashes"):
            store.put(hashes(1) * 2, pool, [0, 1])
        with pytest.raises(IndexError):
            store.put(hashes(1), pool, [32])
        with pytest.raises(TypeError, match="pool: expected a HostKVPool"):
            store.put(hashes(1), pool.paged, [0])
        with pytest.raises(ValueError, match="do not fit a store of 16"):
            store.put(hashes(17), filled_pool(layout(num_blocks=32), 1), list(range(17)))
        with pytest.raises(ValueError, match="slots: \\[3\\] hold no committed block"):
            store.get([3], pool, [0])
        with pytest.raises(TypeError, match="verify: expected a bool, got str"):
            store.get([3], pool, [0], verify="no")
        assert store.match(hashes(2)) == []
    with pytest.raises(TypeError, match="cache_key: expected a CacheKey"):
        DiskKVStore.create(tmp_path / "other", pool, 4, cache_key="k")
    with pytest.raises(ValueError, match="backend: expected one of \\('auto', 'posix', 'gds'\\), got 'nfs'"):
        DiskKVStore.create(tmp_path / "other", pool, 4, cache_key=key(), backend="nfs")
    assert not (tmp_path / "other").exists()


@pytest.mark.skipif(
    HAS_CUDA, reason="a GPU may have GPUDirect Storage: tests/storage/test_storage_gds.py runs it there"
)
def test_gds_without_a_gpu_says_why_and_leaves_nothing(tmp_path):
    pool = filled_pool(layout(), 1)
    with pytest.raises(RuntimeError, match=r"GDS backend \(GPUDirect Storage\) would not start here.*CUDA GPU"):
        DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key(), backend="gds")
    assert not (tmp_path / "store").exists()
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:  # "auto": POSIX for host pools
        assert store.backend == "posix" and store.queue in ("use_uring", "use_aio", "use_posix_aio", "posix")
    with pytest.raises(RuntimeError, match="GDS backend"):
        DiskKVStore.open(tmp_path / "store", pool, cache_key=key(), backend="gds")
    with DiskKVStore.open(tmp_path / "store", pool, cache_key=key()) as store:  # the failed open left it whole
        assert store.num_blocks == 4


def test_a_paged_caches_blocks_hash_as_their_page_first_host_blocks():
    """The checksum of a GPU's block (gathered on its device, then hashed on the host) is the one its page-first
    host copy has, so blocks written through either backend check alike: here on a CPU PagedKV, bf16 and fp8
    with scale planes, random ids."""
    for kind in ("bf16", "fp8"):
        paged = layout(kind)
        for seed, plane in enumerate(paged.planes):
            generator = torch.Generator().manual_seed(seed)
            raw = torch.randint(0, 256, (plane.numel() * plane.element_size(),), dtype=torch.uint8, generator=generator)
            plane.view(-1).view(torch.uint8).copy_(raw)
        pool = kvcopy.HostKVPool(paged, paged.num_blocks, pin_memory=False)
        ids = torch.randperm(paged.num_blocks, generator=torch.Generator().manual_seed(7))[:9]
        kvcopy.copy_blocks(paged, ids, pool, ids)
        rows = paged_block_bytes(paged, ids)
        for row, block in zip(rows, ids.tolist(), strict=True):
            assert torch.equal(row, pool.block_bytes(block))
        assert paged_checksums(paged, ids) == [
            xxhash.xxh3_64_intdigest(pool.block_bytes(i).numpy()) for i in ids.tolist()
        ]


def test_a_store_that_does_not_fit_is_an_error_at_create(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tiny tmpfs needs root")
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("this sandbox does not allow mounting a tmpfs")
    try:
        with pytest.raises(OSError, match="do not fit on"):
            DiskKVStore.create(mount / "store", filled_pool(layout(), 1), 1024, cache_key=key())
        assert not (mount / "store").exists()  # nothing half-made left behind
    finally:
        subprocess.run(["umount", str(mount)], check=True)


WRITER = """
import sys
sys.path.insert(0, {tests!r})
from helpers.storage import hashes, key, layout
from kvcopy.storage.store import DiskKVStore
import kvcopy, torch
pool = kvcopy.HostKVPool(layout(), 32, pin_memory=False)
store = DiskKVStore.open({path!r}, pool, cache_key=key())
for i in range(100000):
    slot = i % 32
    pool.block_bytes(slot).fill_(i % 251)  # content derived from the block's hash (its index i)
    store.put(hashes(1, start=i), pool, [slot]).wait()
    print(i, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.02, 0.1, 0.3, 0.6])
def test_a_writer_killed_mid_put_leaves_only_right_blocks(tmp_path, delay_s):
    path = str(tmp_path / "store")
    DiskKVStore.create(path, layout(), NUM_BLOCKS, cache_key=key()).close()
    code = WRITER.format(tests=TESTS, path=path)
    with Child(code) as child:
        first = child.readline()
        while first and not first.strip().isdigit():  # a start-up line of NIXL's, printed from Python
            first = child.readline()
        time.sleep(delay_s)
        child.kill()
        reported = [int(first), *(int(line) for line in child.communicate() if line.strip().isdigit())]
    assert child.returncode == -signal.SIGKILL
    assert len(reported) > 1  # killed among its puts
    pool = kvcopy.HostKVPool(layout(), 32, pin_memory=False)
    with DiskKVStore.open(path, pool, cache_key=key()) as store:  # never raises
        last = reported[-1]
        for i in range(max(0, last - NUM_BLOCKS + 2), last + 1):  # the blocks it saw complete, not yet evicted
            (slot,) = store.match(hashes(1, start=i))
            store.get([slot], pool, [0]).wait()
            assert bool((pool.block_bytes(0) == i % 251).all())
        for i in range(max(0, last - 200), last + 2):  # every matched block is right too
            slots = store.match(hashes(1, start=i))
            if slots:
                store.get(slots, pool, [1]).wait()
                assert bool((pool.block_bytes(1) == i % 251).all())


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flipped_first_or_last_byte_of_a_block_is_found(tmp_path, where):
    """The checksum covers every byte of a block: the committed one is XXH3-64 over the whole page-first
    block, and a flip of its first or last byte on disk is a CorruptBlockError."""
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    size = pool.nbytes_per_block
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(hashes(2), pool, [3, 9]).wait()
        slots = store.match(hashes(2))
        assert [store._index.entry_at(s).checksum for s in slots] == [
            xxhash.xxh3_64_intdigest(pool.block_bytes(i).numpy()) for i in (3, 9)
        ]
        offset = slots[1] * size + (0 if where == "first" else size - 1)
        with open(tmp_path / "store" / "blocks.data", "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x01]))
            f.flush()
            os.fsync(f.fileno())
        store.drop_page_cache()
        with pytest.raises(CorruptBlockError, match=rf"slots \[{slots[1]}\]"):
            store.get(slots, other, [0, 1]).wait()


def test_a_put_of_a_stored_hash_counts_it_as_used(tmp_path):
    """In a full store, putting hash 0 again makes it the most recently used: the next new hash evicts hash 1."""
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(hashes(4), pool, [0, 1, 2, 3]).wait()
        store.put(hashes(1), pool, [0]).wait()  # stored already: nothing written, used again
        store.put(hashes(1, start=10), pool, [4]).wait()
        assert store.match(hashes(1, start=1)) == []  # hash 1 was the least recent
        assert len(store.match(hashes(1))) == 1 and len(store.match(hashes(1, start=10))) == 1


def test_a_get_without_verify_computes_no_checksum(tmp_path, monkeypatch):
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    hashed: list[int] = []
    real = xxhash.xxh3_64_intdigest

    def counting(data, *args):
        hashed.append(1)
        return real(data, *args)

    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        store.put(hashes(3), pool, [0, 1, 2]).wait()
        slots = store.match(hashes(3))
        monkeypatch.setattr(xxhash, "xxh3_64_intdigest", counting)
        store.get(slots, other, [4, 5, 6], verify=False).wait()
        assert hashed == []
        assert all(other.block_bytes(4 + i).equal(pool.block_bytes(i)) for i in range(3))
        store.get(slots, other, [4, 5, 6]).wait()  # verified: one checksum per block (the spy sees them)
        assert len(hashed) == 3


def test_a_failed_put_frees_its_slots_only_once_nixl_reports_its_write_ended(tmp_path, monkeypatch):
    """A put whose checksums fail while NIXL still reports its write in flight waits for NIXL to report it
    ended before its slots come free (its DMA would still write them): here NIXL is made to say "in flight"
    for its first polls."""
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        events: list[str] = []
        in_flight_polls = 20
        real_state = store._agent.check_xfer_state

        def slow_state(handle):
            state = real_state(handle)
            reported = "PROC" if events.count("PROC") < in_flight_polls else state
            events.append(reported)
            return reported

        real_hold = store._hold

        def recorded_hold(slots):
            release = real_hold(slots)

            def recorded_release():
                events.append("released")
                release()

            return recorded_release

        def failing_checksums(pool, ids):
            raise RuntimeError("the checksums failed")

        monkeypatch.setattr(store._agent, "check_xfer_state", slow_state)
        monkeypatch.setattr(store, "_hold", recorded_hold)
        monkeypatch.setattr(store, "_checksums", failing_checksums)
        with pytest.raises(RuntimeError, match="the checksums failed"):
            store.put(hashes(2), pool, [0, 1])
        assert events.count("released") == 1
        before = events[: events.index("released")]
        assert before.count("PROC") >= in_flight_polls and before[-1] in ("DONE", "ERR")
        monkeypatch.undo()
        assert store.match(hashes(2)) == [] and store._busy == {}


def test_a_closed_store_says_so_and_closes_once(tmp_path):
    pool = filled_pool(layout(), 1)
    store = DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key())
    store.put(hashes(1), pool, [0]).wait()
    slots = store.match(hashes(1))
    store.close()
    for call in (
        lambda: store.match(hashes(1)),
        lambda: store.put(hashes(1, start=3), pool, [1]),
        lambda: store.get(slots, pool, [2]),
        store.drop_page_cache,
    ):
        with pytest.raises(ValueError, match="closed"):
            call()
    opened = os.listdir("/proc/self/fd")
    store.close()  # nothing: no file closed twice (its descriptor numbers may be another file's by now)
    assert os.listdir("/proc/self/fd") == opened


def _slow_nixl(store: DiskKVStore, monkeypatch, events: list[str], in_flight_polls: int) -> None:
    """NIXL made to report every transfer of ``store`` in flight for its first ``in_flight_polls`` polls, and
    what the store frees recorded in ``events`` (NIXL's answers, "deregistered", "fd closed")."""
    real_state, real_deregister, real_close = store._agent.check_xfer_state, store._agent.deregister_memory, os.close

    def slow_state(handle):
        state = real_state(handle)
        reported = "PROC" if events.count("PROC") < in_flight_polls else state
        events.append(reported)
        return reported

    def recorded_deregister(registered):
        events.append("deregistered")
        real_deregister(registered)

    def recorded_close(fd):
        if fd == store._fd:
            events.append("fd closed")
        real_close(fd)

    monkeypatch.setattr(store._agent, "check_xfer_state", slow_state)
    monkeypatch.setattr(store._agent, "deregister_memory", recorded_deregister)
    monkeypatch.setattr(os, "close", recorded_close)


def test_close_frees_nothing_a_put_in_flight_still_uses_and_commits_it(tmp_path, monkeypatch):
    """A ``with`` block left by an exception while a put is in flight: close waits until NIXL reports the write
    ended before it deregisters the memory or closes the data file, and the put, whose bytes are on disk, is
    committed: it reads back right from a reopened store."""
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    events: list[str] = []
    in_flight_polls = 20
    store = DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key())
    with pytest.raises(RuntimeError, match="the caller failed"), store:
        _slow_nixl(store, monkeypatch, events, in_flight_polls)
        transfer = store.put(hashes(2), pool, [5, 6])
        raise RuntimeError("the caller failed")
    monkeypatch.undo()
    first_freed = min(events.index("deregistered"), events.index("fd closed"))
    before = events[:first_freed]
    assert before.count("PROC") >= in_flight_polls and before[-1] == "DONE"
    assert "PROC" not in events[first_freed:]  # nothing polled (nothing in flight) once anything was freed
    transfer.wait()  # ended well by close: its own wait says so
    with DiskKVStore.open(tmp_path / "store", pool, cache_key=key()) as store:
        slots = store.match(hashes(2))
        assert len(slots) == 2
        store.get(slots, other, [0, 1]).wait()
    assert other.block_bytes(0).equal(pool.block_bytes(5)) and other.block_bytes(1).equal(pool.block_bytes(6))


def test_close_waits_for_a_dropped_get_and_keeps_its_error_for_its_wait(tmp_path, monkeypatch):
    """A get in flight (its transfer dropped by its caller, or kept) ends before close frees anything; a get
    whose block does not match ends with its CorruptBlockError, raised by its own wait, not by close."""
    pool, other = filled_pool(layout(), 1), filled_pool(layout(), 2)
    store = DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key())
    store.put(hashes(2), pool, [0, 1]).wait()
    slots = store.match(hashes(2))
    with open(tmp_path / "store" / "blocks.data", "r+b") as f:  # slot of hash 1 corrupted
        f.seek(slots[1] * pool.nbytes_per_block)
        byte = f.read(1)[0]
        f.seek(slots[1] * pool.nbytes_per_block)
        f.write(bytes([byte ^ 0x01]))
    store.drop_page_cache()
    events: list[str] = []
    _slow_nixl(store, monkeypatch, events, 10)
    store.get(slots[:1], other, [3])  # dropped by its caller
    kept = store.get(slots[1:], other, [4])
    store.close()  # raises nothing
    monkeypatch.undo()
    first_freed = min(events.index("deregistered"), events.index("fd closed"))
    assert events[:first_freed].count("DONE") == 2 and "PROC" not in events[first_freed:]
    assert other.block_bytes(3).equal(pool.block_bytes(0))
    with pytest.raises(CorruptBlockError, match=rf"slots \[{slots[1]}\]"):
        kept.wait()


class _FreshAllocations(TorchDispatchMode):
    """Records the bytes of every tensor an operation returns in storage none of its arguments had: what a
    function allocates (views and ``out=`` results are its arguments' storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.nbytes.append(t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("chunk_blocks", [1, 3, 40])
def test_paged_checksums_hold_one_chunk_and_match_the_host_pools(kind, chunk_blocks):
    """The checksums of 20 blocks gathered ``chunk_blocks`` at a time are the page-first host blocks' (as a
    host pool's put takes them), and what the function allocates is one chunk (at most all 20 blocks), not a
    copy of every block moved (the ids' own int64 copy aside)."""
    paged = layout(kind)
    for seed, plane in enumerate(paged.planes):
        generator = torch.Generator().manual_seed(10 + seed)
        raw = torch.randint(0, 256, (plane.numel() * plane.element_size(),), dtype=torch.uint8, generator=generator)
        plane.view(-1).view(torch.uint8).copy_(raw)
    pool = kvcopy.HostKVPool(paged, paged.num_blocks, pin_memory=False)
    kvcopy.copy_blocks(paged, torch.arange(paged.num_blocks), pool, torch.arange(paged.num_blocks))
    ids = torch.randperm(paged.num_blocks, generator=torch.Generator().manual_seed(5))[:20]
    with _FreshAllocations() as allocations:
        checksums = paged_checksums(paged, ids, chunk_bytes=chunk_blocks * paged.nbytes_per_block)
    assert checksums == [xxhash.xxh3_64_intdigest(pool.block_bytes(i).numpy()) for i in ids.tolist()]
    chunk = min(chunk_blocks, len(ids)) * paged.nbytes_per_block
    assert sum(allocations.nbytes) <= chunk + ids.numel() * 8
