"""The requests a disk store posts to NIXL, checked on the CPU: O_DIRECT only where every request's file offset
and size is aligned (a GPU cache's through GDS are per plane-block), over the layouts kvcopy stores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy.ranges import plan_table_ranges
from kvcopy.storage import store as store_module
from kvcopy.storage.files import DIRECT_ALIGNMENT, direct_io_fits, file_agent, file_table
from kvcopy.storage.store import DiskKVStore

from helpers.storage import key, layout

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
