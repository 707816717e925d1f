"""Benchmark workloads: paged caches shaped like real models' KV caches, filled with random bytes.

The shapes come from kvcopy's model presets (kvcopy.model.presets), so a model's numbers are written once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcopy.layout import PagedKV
from kvcopy.model.spec import ModelSpec

__all__ = [
    "BIG_CACHE_BYTES",
    "DEFAULT_WORKLOAD",
    "MIXED_PLANE_WORKLOADS",
    "ONE_PLANE_32K",
    "TINY_PLANES",
    "WORKLOADS",
    "Workload",
    "llama8b_with_block_tokens",
    "random_tensor",
]

LLAMA8B = ModelSpec.preset("llama-3.1-8b")
LLAMA70B_TP4 = ModelSpec.preset("llama-3.1-70b").shard(4)  # one of 4 tensor-parallel ranks: 2 of its 8 KV heads
DEEPSEEK_V3 = ModelSpec.preset("deepseek-v3")  # MLA: one latent row (kv_lora_rank + qk_rope_head_dim) per token


@dataclass(frozen=True)
class Workload:
    """A named cache shape; ``build(num_blocks, device)`` makes one with random contents.

    ``cache_bytes``: the benchmark's cache holds at least this many bytes (by default, its runner sizes the
    cache by the blocks a call moves)."""

    name: str
    description: str
    build: Callable[[int, torch.device], PagedKV]
    cache_bytes: int | None = None


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uniformly random bytes (any dtype, fp8 included): a copy that drops or moves a byte shows."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    tensor.view(torch.uint8).random_()
    return tensor


def _vllm(layers: int, kv_heads: int, head_dim: int, block_tokens: int) -> Callable[[int, torch.device], PagedKV]:
    def build(num_blocks: int, device: torch.device) -> PagedKV:
        shape = (2, num_blocks, block_tokens, kv_heads, head_dim)
        return PagedKV.from_vllm([random_tensor(shape, torch.bfloat16, device) for _ in range(layers)])

    return build


def llama8b_with_block_tokens(block_tokens: int) -> Callable[[int, torch.device], PagedKV]:
    """Llama-3.1-8B's cache (32 layers, K and V, 8 KV heads x 128 bf16) at ``block_tokens`` tokens per block:
    plane-blocks of ``block_tokens`` x 2 KiB."""
    return _vllm(LLAMA8B.num_layers, LLAMA8B.num_kv_heads, LLAMA8B.head_dim, block_tokens)


def _mla(num_blocks: int, device: torch.device) -> PagedKV:
    return PagedKV.from_mla(
        [
            random_tensor((num_blocks, 64, DEEPSEEK_V3.head_dim), torch.bfloat16, device)
            for _ in range(DEEPSEEK_V3.num_layers)
        ]
    )


def _fp8_with_scales(num_blocks: int, device: torch.device) -> PagedKV:
    """Per layer: K and V in fp8, then a float32 scale per (token, head) for each: 4 planes."""
    planes = []
    for _ in range(LLAMA8B.num_layers):
        planes += [
            random_tensor((num_blocks, 16, LLAMA8B.num_kv_heads, LLAMA8B.head_dim), torch.float8_e4m3fn, device)
            for _ in range(2)
        ]
        planes += [random_tensor((num_blocks, 16, LLAMA8B.num_kv_heads), torch.float32, device) for _ in range(2)]
    return PagedKV.from_planes(planes, planes_per_layer=4)


# A cache of an engine's size, 4 GiB: random blocks' page-table entries no longer stay in the CPU's caches,
# so a gather's page walks cost what they cost an engine. Gathering 8 KiB plane-blocks on one core of the
# 2-core AMD EPYC VM ran at 0.87x memcpy from planes of 4 MiB (the runner's own size for 256 blocks), 0.77x
# from 16 MiB, 0.71x from 64 MiB (docs/measurements.md).
BIG_CACHE_BYTES = 4 << 30

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "llama8b-16",
            "Llama-3.1-8B, 16-token blocks: 32 layers x K/V = 64 planes of 32 KiB plane-blocks (docs/measurements.md)",
            llama8b_with_block_tokens(16),
        ),
        Workload(
            "llama70b-tp4-16",
            "Llama-3.1-70B on one of 4 tensor-parallel ranks, 16-token blocks: 80 layers x K/V, "
            "2 KV heads = 8 KiB plane-blocks",
            _vllm(LLAMA70B_TP4.num_layers, LLAMA70B_TP4.num_kv_heads, LLAMA70B_TP4.head_dim, 16),
        ),
        Workload(
            "llama8b-big-4",
            "Llama-3.1-8B, 4-token blocks in a 4 GiB cache: 64 planes of 64 MiB, 8 KiB plane-blocks",
            llama8b_with_block_tokens(4),
            cache_bytes=BIG_CACHE_BYTES,
        ),
        Workload(
            "deepseek-v3-mla-64",
            "DeepSeek-V3 MLA, 64-token blocks: 61 layers of one 576-wide latent, 72 KiB plane-blocks",
            _mla,
        ),
        Workload(
            "llama8b-fp8-16",
            "Llama-3.1-8B in fp8 with per-token-head float32 scales: 128 planes, "
            "16 KiB K/V and 512 B scale plane-blocks",
            _fp8_with_scales,
        ),
    )
}
DEFAULT_WORKLOAD = "llama8b-16"
# Workloads whose planes differ in size (their tables give the mean plane-block).
MIXED_PLANE_WORKLOADS = frozenset({"llama8b-fp8-16"})

# Llama-3.1-8B's 64 planes with one 128-dim bf16 row per plane-block (256 B):
# a 1-block call moves 16 KiB, so its time is the fixed cost of a call
# (validation, dispatch, planning and launching 64 copies).
TINY_PLANES = Workload(
    "llama8b-256B",
    "Llama-3.1-8B's 64 planes, one 128-dim bf16 row (256 B) per plane-block",
    _vllm(LLAMA8B.num_layers, 1, LLAMA8B.head_dim, 1),
)

# One plane of 32 KiB plane-blocks: a 1-block call moves what a single copy_ of 32 KiB moves (the row's
# "contiguous copy (limit)"), so the call's time over that copy_'s is kvcopy's call overhead.
ONE_PLANE_32K = Workload(
    "one-plane-32K",
    "one plane of 32 KiB plane-blocks (a bare copy_ of 32 KiB is the limit)",
    lambda num_blocks, device: PagedKV([random_tensor((num_blocks, 32 * 1024), torch.uint8, device)]),
)
