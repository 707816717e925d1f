"""Disk-store fixtures as plain functions, for the storage tests and the writer processes they start: a
CacheKey, the layouts stored (multi-plane bf16, or fp8 with scale planes), a pool of random bytes, and block
hashes."""

from __future__ import annotations

import hashlib

import torch

import kvcopy


def key(weights: str = "w") -> kvcopy.CacheKey:
    return kvcopy.CacheKey(kvcopy.ModelSpec.preset("llama-3.1-8b"), weights_id=weights, block_tokens=16)


def layout(kind: str = "bf16", num_blocks: int = 32) -> kvcopy.PagedKV:
    """Multi-plane bf16 K/V (2 layers), or fp8 data planes with float32 scale planes."""
    if kind == "bf16":
        planes = [torch.empty(num_blocks, 16, 2, 64, dtype=torch.bfloat16) for _ in range(4)]
        return kvcopy.PagedKV.from_planes(planes, planes_per_layer=2)
    data = [torch.empty(num_blocks, 16, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(2)]
    scales = [torch.empty(num_blocks, 16, 2, dtype=torch.float32) for _ in range(2)]
    return kvcopy.PagedKV.from_planes(data + scales, planes_per_layer=2)


def filled_pool(paged: kvcopy.PagedKV, seed: int) -> kvcopy.HostKVPool:
    pool = kvcopy.HostKVPool(paged, paged.num_blocks, pin_memory=False)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), generator=gen, dtype=torch.uint8))
    return pool


def hashes(n: int, start: int = 0) -> list[str]:
    return [hashlib.sha256(f"block {i}".encode()).hexdigest() for i in range(start, start + n)]


def store_files(path) -> dict[str, bytes]:
    """Every file of the store at ``path`` (a directory), name to bytes: to compare before and after a call."""
    from pathlib import Path

    return {f.name: f.read_bytes() for f in sorted(Path(path).iterdir())}
