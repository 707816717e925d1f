"""The requests a disk store posts to NIXL, checked on the CPU: O_DIRECT only where every request's file offset
and size is aligned (a GPU cache's through GDS are per plane-block), over the layouts kvcopy stores; rounds of
bounded requests, a GPU cache's through a page-first staging buffer (run here on the CPU); a round that fails
while another transfer waits for it fails its own put, which commits nothing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy.nixl.transfer import RemoteTransferError
from kvcopy.ranges import plan_table_ranges
from kvcopy.storage import rounds as rounds_module
from kvcopy.storage import staging as staging_module
from kvcopy.storage import store as store_module
from kvcopy.storage.files import DIRECT_ALIGNMENT, direct_io_fits, file_agent, file_table
from kvcopy.storage.gpu_blocks import paged_block_bytes
from kvcopy.storage.staging import GDS_REQUESTS, ROUND_REQUESTS, Staging, plan_rounds, staging_blocks
from kvcopy.storage.store import DiskKVStore

from helpers.storage import filled_pool, hashes, key, layout

TOKENS = 16  # tokens per block


def fp8_with_scales(layers: int, num_blocks: int = 4) -> kvcopy.PagedKV:
    """Llama-8B-like fp8 K and V (8 KV heads of 128) with float32 per-token-per-head scale planes: 16,384-byte
    data plane-blocks, 512-byte scale ones; blocks of 32 layers are aligned (1,081,344 bytes), planes are not."""
    planes = []
    for _ in range(layers):
        planes += [torch.empty(num_blocks, TOKENS, 8, 128, dtype=torch.float8_e4m3fn) for _ in range(2)]
        planes += [torch.empty(num_blocks, TOKENS, 8, dtype=torch.float32) for _ in range(2)]
    return kvcopy.PagedKV.from_planes(planes, planes_per_layer=4)


def mla(layers: int, num_blocks: int = 4) -> kvcopy.PagedKV:
    """DeepSeek-style MLA: one bf16 latent plane of 576 per token, 18,432 bytes per plane-block at 16 tokens."""
    planes = [torch.empty(num_blocks, TOKENS, 576, dtype=torch.bfloat16) for _ in range(layers)]
    return kvcopy.PagedKV.from_planes(planes, planes_per_layer=1)


LAYOUTS = {
    "bf16 4 KiB planes": lambda: layout("bf16", 4),
    "fp8 small scale planes": lambda: layout("fp8_scales", 4),
    "fp8 + scales, 32 layers": lambda: fp8_with_scales(32),
    "MLA, 1 layer": lambda: mla(1),
    "MLA, 4 layers": lambda: mla(4),
}


def plane_bytes_of(paged: kvcopy.PagedKV) -> list[int]:
    return [int(n) for n in paged.plane_table[:, 2].tolist()]


def all_aligned(ranges: list[tuple[int, int, int]]) -> bool:
    """The reference: every request's file offset (its destination, for a write) and size aligned."""
    return all(offset % DIRECT_ALIGNMENT == 0 and n % DIRECT_ALIGNMENT == 0 for _, offset, n in ranges)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_o_direct_is_chosen_only_when_every_request_is_aligned(name):
    """Against the requests kvcopy's range planner makes for a put of every block in shuffled slots: a GPU
    cache's planes (separate tensors, as on a GPU, here on the CPU) to the file, and a page-first host pool's."""
    paged = LAYOUTS[name]()
    planes = plane_bytes_of(paged)
    table = file_table(planes)
    ids = torch.arange(paged.num_blocks, dtype=torch.int64)
    slots = torch.randperm(paged.num_blocks, generator=torch.Generator().manual_seed(1)).to(torch.int64)
    gpu_requests = plan_table_ranges(paged.plane_table, ids, table, slots)
    host = kvcopy.HostKVPool(paged, paged.num_blocks, pin_memory=False)
    host_requests = plan_table_ranges(host.paged.plane_table, ids, table, slots)
    assert direct_io_fits(paged.nbytes_per_block, planes) == all_aligned(gpu_requests)
    assert direct_io_fits(paged.nbytes_per_block) == all_aligned(host_requests)


def test_the_layouts_cover_every_case():
    """The layouts above include the case the rule exists for: aligned blocks of unaligned planes."""
    cases = {
        (direct_io_fits(p.nbytes_per_block), direct_io_fits(p.nbytes_per_block, plane_bytes_of(p)))
        for p in (make() for make in LAYOUTS.values())
    }
    assert cases == {(True, True), (True, False), (False, False)}


@pytest.mark.parametrize(("name", "direct"), [("bf16 4 KiB planes", True), ("fp8 + scales, 32 layers", False)])
def test_a_gds_store_reads_through_the_page_cache_where_planes_are_unaligned(tmp_path, monkeypatch, name, direct):
    """A store opened with GDS (faked here by NIXL's POSIX backend under GDS's name: no GPU on the CPU) of fp8
    blocks with scale planes is not opened O_DIRECT, though its blocks are aligned; one of aligned planes is."""

    def gds_named(name_, backend, *, gpu=False):
        agent, _, _ = file_agent(name_, "posix")
        return agent, "gds", "cuFile"

    monkeypatch.setattr(store_module, "file_agent", gds_named)
    with DiskKVStore.create(tmp_path / "store", LAYOUTS[name](), 2, cache_key=key(), backend="gds") as store:
        assert store.backend == "gds" and store.direct is direct


PLANES = 64  # a 64-plane cache (32 layers of K and V), as a GPU holds it: one tensor per plane
STORE_BLOCKS = 300


def gpu_like_cache(num_blocks: int, seed: int) -> kvcopy.PagedKV:
    """A 64-plane cache of 64-byte plane-blocks, each plane its own tensor (as on a GPU), random bytes."""
    generator = torch.Generator().manual_seed(seed)
    planes = [
        torch.randint(0, 256, (num_blocks, 64), dtype=torch.uint8, generator=generator).view(torch.bfloat16)
        for _ in range(PLANES)
    ]
    return kvcopy.PagedKV.from_planes(planes, planes_per_layer=2)


class _Registering:
    """An agent that only registers (for a Staging made without NIXL)."""

    def register_memory(self, regions, memory):
        return (tuple(regions), memory)


def covered(rounds, nbytes_per_block: int) -> list[int]:
    """The file bytes the rounds' requests write, as sorted (offset, bytes) runs merged: the reference."""
    spans = sorted((f, n) for r in rounds for _, f, n in r.ranges)
    merged: list[list[int]] = []
    for offset, n in spans:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1][1] += n
        else:
            merged.append([offset, n])
    return [x for span in merged for x in span]


def test_a_gpu_caches_put_or_get_stays_within_the_gds_request_pool_for_every_size():
    """Every N from 1 to the store's size: the rounds of a put of N blocks of a 64-plane GPU cache through the
    staging buffer each post at most ROUND_REQUESTS requests (within NIXL's GDS pool, 16 x 128), and write
    exactly the N slots' bytes. Planned directly, one request per (block, plane), 33 blocks are already past
    the pool: the reference the staging is there for."""
    cache = gpu_like_cache(STORE_BLOCKS, 1)
    block = cache.nbytes_per_block
    table = file_table(list(cache.plane_block_nbytes))
    staging = Staging(cache, staging_blocks(block), _Registering())
    assert staging.paged.plane_table[0, 0] % DIRECT_ALIGNMENT == 0  # O_DIRECT takes its rows
    assert ROUND_REQUESTS <= GDS_REQUESTS
    generator = torch.Generator().manual_seed(2)
    for n in range(1, STORE_BLOCKS + 1):
        ids = torch.randperm(STORE_BLOCKS, generator=generator)[:n]
        slots = torch.randperm(STORE_BLOCKS, generator=generator)[:n]
        rounds = plan_rounds(
            cache.plane_table, ids, table, slots, staging_table=staging.paged.plane_table, per_round=staging.blocks
        )
        assert max(len(r.ranges) for r in rounds) <= ROUND_REQUESTS
        expected = sorted(slots.tolist())
        runs = []
        for slot in expected:
            if runs and runs[-2] + runs[-1] == slot * block:
                runs[-1] += block
            else:
                runs += [slot * block, block]
        assert covered(rounds, block) == runs
        if n == 33:
            direct = plan_table_ranges(cache.plane_table, ids, table, slots)
            assert len(direct) > GDS_REQUESTS  # 33 x 64: why the staging buffer


def test_a_host_pools_scattered_put_is_cut_into_rounds():
    """A host pool's put of 3,000 scattered blocks (3,000 requests: no two adjacent) is rounds of at most
    ROUND_REQUESTS, which together write exactly those blocks."""
    paged = kvcopy.PagedKV.from_planes([torch.empty(6000, 16, dtype=torch.uint8)])
    pool = kvcopy.HostKVPool(paged, 6000, pin_memory=False)
    ids = torch.arange(0, 6000, 2, dtype=torch.int64)
    slots = torch.arange(1, 6000, 2, dtype=torch.int64)
    rounds = plan_rounds(pool.paged.plane_table, ids, file_table([16]), slots)
    assert [len(r.ranges) for r in rounds] == [ROUND_REQUESTS] * 5 + [3000 - 5 * ROUND_REQUESTS]
    assert covered(rounds, 16) == [x for s in slots.tolist() for x in (s * 16, 16)]


def test_a_staged_put_and_get_round_trip_bitwise_in_rounds(tmp_path, monkeypatch):
    """The store's own staged path (a GPU cache's, here a 64-plane cache on the CPU through NIXL's POSIX
    backend, DRAM staging), with a staging buffer of 3 blocks: a put of 20 blocks is 7 rounds, never more than
    one round's requests per NIXL transfer; a get of them, interleaved with a second put that needs the buffer,
    reads every byte back; nothing is left in flight, and only the staging buffer was registered with NIXL."""
    monkeypatch.setattr(staging_module, "STAGING_BYTES", 3 * PLANES * 64)
    source, target = gpu_like_cache(32, 3), gpu_like_cache(32, 4)
    posted: list[int] = []
    with DiskKVStore.create(tmp_path / "store", source, 40, cache_key=key(), backend="posix") as store:
        real = store._agent.initialize_xfer

        def counting(op, memory, file, name):
            posted.append(store._posted)
            return real(op, memory, file, name)

        registered: list[int] = []
        real_register = store._agent.register_memory

        def registering(regions, memory):
            registered.append(sum(n for _, n, *_ in regions))
            return real_register(regions, memory)

        monkeypatch.setattr(store._agent, "initialize_xfer", counting)
        monkeypatch.setattr(store._agent, "register_memory", registering)
        ids = torch.randperm(32, generator=torch.Generator().manual_seed(5))[:20]
        slots = list(range(5, 25))
        put = store._transfer("WRITE", source, ids, slots, lambda: None)
        assert put.num_descriptors <= 20  # one per run of adjacent slots, at most one per block
        put.wait()
        assert len(posted) == 7
        back = torch.randperm(32, generator=torch.Generator().manual_seed(6))[:20]
        get = store._transfer("READ", target, back, slots, lambda: None)
        other = store._transfer("WRITE", source, ids[:4], [30, 31, 32, 33], lambda: None)  # needs the buffer
        other.wait()
        get.wait()
        assert max(posted) <= ROUND_REQUESTS and store._posted == 0 and store._rounds_in_flight == []
        assert registered == [3 * source.nbytes_per_block]  # the staging buffer once, never the cache
    assert torch.equal(paged_block_bytes(target, back), paged_block_bytes(source, ids))


def test_a_round_that_fails_while_another_put_waits_for_it_fails_its_own_put(tmp_path, monkeypatch):
    """A store keeps its requests in flight within GDS_REQUESTS (one here): a second put waits for the first
    put's round to end (settles it), and NIXL reports that round failed. The error is the first put's: its
    own ``done`` and ``wait`` raise it, and nothing of it is committed; the second put is committed."""
    monkeypatch.setattr(store_module, "GDS_REQUESTS", 1)
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, 4, cache_key=key()) as store:
        handles: list[object] = []
        failing, reported = [False], []
        real_initialize, real_state = store._agent.initialize_xfer, store._agent.check_xfer_state

        def initialize(*args):
            handles.append(real_initialize(*args))
            return handles[-1]

        def state(handle):  # the first put's: in flight until failing, then failed once NIXL has ended it
            real = real_state(handle)
            if handle is not handles[0]:
                return real
            if failing[0] and real != "PROC":
                reported.append("ERR")
                return "ERR"
            return "PROC"

        monkeypatch.setattr(store._agent, "initialize_xfer", initialize)
        monkeypatch.setattr(store._agent, "check_xfer_state", state)
        first = store.put(hashes(2), pool, [0, 1])  # one request, in flight
        failing[0] = True
        second = store.put(hashes(2, start=10), pool, [2, 3])  # its request waits for the first's to end
        assert reported == ["ERR"]  # found by the second put's wait, not by the first's own poll
        second.wait()
        with pytest.raises(RemoteTransferError, match="write failed"):
            first.done()
        with pytest.raises(RemoteTransferError, match="write failed"):
            first.wait()
        monkeypatch.undo()
        assert store.match(hashes(2)) == []  # never committed
        assert len(store.match(hashes(2, start=10))) == 2
        store.put(hashes(2, start=20), pool, [4, 5]).wait()  # the failed put's slots are free again
        assert len(store.match(hashes(2, start=20))) == 2 and len(store.match(hashes(2, start=10))) == 2


class _SlowEvent:
    """A stand-in for a CUDA event on the current stream: not passed for its first ``polls`` queries."""

    def __init__(self, log: list[str], polls: int) -> None:
        self._log, self._left = log, polls

    def query(self) -> bool:
        self._left -= 1
        self._log.append("query")
        return self._left < 0

    def synchronize(self) -> None:
        self._log.append("synchronize")
        self._left = -1


def test_a_staged_round_waits_for_its_copy_by_polling_never_blocking_the_host(tmp_path, monkeypatch):
    """A GPU's round is posted to NIXL only once the stream passed its gather (a put), and ends only once the
    stream passed its scatter (a get), both found by polling the event: ``done`` never blocks the host on the
    stream (here the events are stand-ins, on the CPU, each not passed for its first 3 polls)."""
    log: list[str] = []
    monkeypatch.setattr(rounds_module, "_stream_event", lambda device: _SlowEvent(log, 3))
    source, target = gpu_like_cache(8, 7), gpu_like_cache(8, 8)
    with DiskKVStore.create(tmp_path / "store", source, 8, cache_key=key(), backend="posix") as store:
        real = store._agent.initialize_xfer

        def posting(*args):
            log.append("posted")
            return real(*args)

        monkeypatch.setattr(store._agent, "initialize_xfer", posting)
        ids = torch.tensor([5, 1, 6])
        put = store._transfer("WRITE", source, ids, [0, 1, 2], lambda: None)
        while not put.done():
            pass
        assert log == ["query"] * 4 + ["posted"] and "synchronize" not in log
        log.clear()
        get = store._transfer("READ", target, torch.tensor([0, 2, 4]), [0, 1, 2], lambda: None)
        assert log == ["posted"]  # a get's round reads into the buffer at once
        polls = 0
        while not get.done():
            polls += 1
        assert log.count("query") == 4 and "synchronize" not in log and polls >= 3
    assert torch.equal(paged_block_bytes(target, torch.tensor([0, 2, 4])), paged_block_bytes(source, ids))
