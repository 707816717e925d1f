"""DiskKVStore through GPUDirect Storage (NIXL's GDS backend) on a GPU: a GPU cache's blocks to the file and
back bitwise, across GPU and host pools, a corrupt block named, and a POSIX store refusing GPU blocks.
Skipped without a CUDA GPU, and (saying NIXL's reason) where its GDS backend will not start."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy.storage.gpu_blocks import paged_block_bytes, paged_checksums
from kvcopy.storage.store import CorruptBlockError, DiskKVStore

from helpers import gpu, requires_gpu
from helpers.storage import filled_pool, hashes, key, layout

pytestmark = [gpu, requires_gpu]

NUM_BLOCKS = 32


def gpu_cache(kind: str, seed: int) -> kvcopy.PagedKV:
    """``layout(kind)``'s planes on the GPU, every byte random."""
    host = layout(kind, NUM_BLOCKS)
    planes = []
    for number, plane in enumerate(host.planes):
        generator = torch.Generator().manual_seed(seed * 100 + number)
        raw = torch.randint(0, 256, (plane.numel() * plane.element_size(),), dtype=torch.uint8, generator=generator)
        plane.view(-1).view(torch.uint8).copy_(raw)
        planes.append(plane.cuda())
    return kvcopy.PagedKV.from_planes(planes, planes_per_layer=host.planes_per_layer)


def gds_store(path, like) -> DiskKVStore:
    try:
        return DiskKVStore.create(path, like, NUM_BLOCKS, cache_key=key(), backend="gds")
    except RuntimeError as err:  # a GPU without GPUDirect Storage (cuFile, its driver): NIXL says why
        pytest.skip(f"needs GPUDirect Storage: {err}")


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_a_gpu_caches_blocks_go_to_the_file_and_back_bitwise(tmp_path, kind):
    source, target = gpu_cache(kind, 1), gpu_cache(kind, 2)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randperm(NUM_BLOCKS, generator=generator)[:12]
    back = torch.randperm(NUM_BLOCKS, generator=generator)[:12]
    with gds_store(tmp_path / "store", source) as store:
        assert store.backend == "gds"
        store.put(hashes(12), source, ids).wait()
        slots = store.match(hashes(12))
        assert len(slots) == 12
        store.get(slots, target, back).wait()
    assert torch.equal(paged_block_bytes(target, back), paged_block_bytes(source, ids))
    with DiskKVStore.open(tmp_path / "store", source, cache_key=key()) as store:  # "auto" on a GPU: GDS
        assert store.backend == "gds"


def test_gds_moves_blocks_between_gpu_and_host_pools(tmp_path):
    cache = gpu_cache("bf16", 4)
    pool = filled_pool(layout("bf16", NUM_BLOCKS), 5)
    with gds_store(tmp_path / "store", cache) as store:
        store.put(hashes(4), cache, [3, 9, 10, 11]).wait()  # from the GPU
        store.put(hashes(4, start=4), pool, [0, 1, 2, 30]).wait()  # from host memory
        into_host = kvcopy.HostKVPool(layout("bf16", NUM_BLOCKS), NUM_BLOCKS, pin_memory=False)
        store.get(store.match(hashes(4)), into_host, [5, 6, 7, 8]).wait()
        into_gpu = gpu_cache("bf16", 6)
        store.get(store.match(hashes(4, start=4)), into_gpu, [20, 21, 22, 23]).wait()
    expected = paged_block_bytes(cache, torch.tensor([3, 9, 10, 11]))
    assert all(torch.equal(into_host.block_bytes(5 + i), expected[i]) for i in range(4))
    landed = paged_block_bytes(into_gpu, torch.tensor([20, 21, 22, 23]))
    assert all(torch.equal(landed[i], pool.block_bytes(b)) for i, b in enumerate([0, 1, 2, 30]))


def test_a_corrupt_block_read_into_a_gpu_is_named(tmp_path):
    cache = gpu_cache("bf16", 7)
    with gds_store(tmp_path / "store", cache) as store:
        store.put(hashes(3), cache, [0, 1, 2]).wait()
        slots = store.match(hashes(3))
        with open(os.path.join(store.path, "blocks.data"), "r+b") as f:
            f.seek(slots[1] * cache.nbytes_per_block + 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(CorruptBlockError, match=f"slots \\[{slots[1]}\\]") as caught:
            store.get(slots, gpu_cache("bf16", 8), [4, 5, 6]).wait()
        assert caught.value.slots == [slots[1]]


def test_a_posix_store_refuses_a_gpus_blocks(tmp_path):
    cache = gpu_cache("bf16", 9)
    with DiskKVStore.create(tmp_path / "store", cache, NUM_BLOCKS, cache_key=key(), backend="posix") as store:
        assert store.backend == "posix"
        with pytest.raises(ValueError, match="GPUDirect Storage"):
            store.put(hashes(1), cache, [0])
        assert store.match(hashes(1)) == []


@pytest.mark.parametrize("chunk_blocks", [1, 5, 64])
def test_a_gpu_caches_checksums_in_chunks_are_its_page_first_blocks(chunk_blocks):
    """Chunked through the staging buffer and the two pinned host buffers (one chunk, several, all at once)."""
    cache = gpu_cache("fp8", 11)
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(12))[:17]
    rows = paged_block_bytes(cache, ids)
    expected = [xxhash.xxh3_64_intdigest(row.numpy()) for row in rows]
    assert paged_checksums(cache, ids, chunk_bytes=chunk_blocks * cache.nbytes_per_block) == expected


def test_a_put_past_nixls_gds_batch_pool_goes_through_in_rounds(tmp_path):
    """96 blocks of a 64-plane cache: 6,144 plane-blocks, three times NIXL's GDS pool of 16 x 128 requests had
    each been one request. Through the staging buffer they are one request per run of slots, in rounds, and
    read back bitwise, in two gets at once."""
    blocks, planes = 96, 64
    generator = torch.Generator().manual_seed(13)
    tensors = [
        torch.randint(0, 256, (blocks, 16, 2, 64), dtype=torch.uint8, generator=generator) for _ in range(planes)
    ]
    cache = kvcopy.PagedKV.from_planes([t.view(torch.bfloat16).cuda() for t in tensors], planes_per_layer=2)
    target = kvcopy.PagedKV.from_planes([torch.zeros_like(p) for p in cache.planes], planes_per_layer=2)
    try:
        store = DiskKVStore.create(tmp_path / "store", cache, blocks, cache_key=key(), backend="gds")
    except RuntimeError as err:  # a GPU without GPUDirect Storage (cuFile, its driver): NIXL says why
        pytest.skip(f"needs GPUDirect Storage: {err}")
    with store:
        put = store.put(hashes(blocks), cache, list(range(blocks)))
        put.wait()
        assert put.num_descriptors <= blocks
        slots = store.match(hashes(blocks))
        first = store.get(slots[:48], target, list(range(48)))
        second = store.get(slots[48:], target, list(range(48, blocks)))
        first.wait()
        second.wait()
    everything = torch.arange(blocks)
    assert torch.equal(paged_block_bytes(target, everything), paged_block_bytes(cache, everything))
