"""Benchmark workloads: paged caches shaped like real models' KV caches, filled with random bytes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layout import PagedKV

__all__ = ["Workload", "WORKLOADS", "DEFAULT_WORKLOAD", "MIXED_PLANE_WORKLOADS", "TINY_PLANES",
           "llama8b_with_block_tokens", "random_tensor"]

HEAD_DIM = 128
LLAMA8B_LAYERS, LLAMA8B_KV_HEADS = 32, 8
LLAMA70B_LAYERS, LLAMA70B_KV_HEADS_PER_TP4_RANK = 80, 2  # 8 KV heads over 4 tensor-parallel ranks
DEEPSEEK_V3_LAYERS = 61
MLA_WIDTH = 512 + 64  # DeepSeek-V3: kv_lora_rank + qk_rope_head_dim, one latent row per token


@dataclass(frozen=True)
class Workload:
    """A named cache shape; ``build(num_blocks, device)`` makes one with random contents."""

    name: str
    description: str
    build: Callable[[int, torch.device], PagedKV]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uniformly random bytes (any dtype, fp8 included): a copy that drops or moves a byte shows."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    tensor.view(torch.uint8).random_()
    return tensor


def _vllm(layers: int, kv_heads: int, block_tokens: int) -> Callable[[int, torch.device], PagedKV]:
    def build(num_blocks: int, device: torch.device) -> PagedKV:
        shape = (2, num_blocks, block_tokens, kv_heads, HEAD_DIM)
        return PagedKV.from_vllm([random_tensor(shape, torch.bfloat16, device) for _ in range(layers)])

    return build


def llama8b_with_block_tokens(block_tokens: int) -> Callable[[int, torch.device], PagedKV]:
    """Llama-3.1-8B's cache (32 layers, K and V, 8 KV heads x 128 bf16) at ``block_tokens`` tokens per block:
    plane-blocks of ``block_tokens`` x 2 KiB."""
    return _vllm(LLAMA8B_LAYERS, LLAMA8B_KV_HEADS, block_tokens)


def _mla(num_blocks: int, device: torch.device) -> PagedKV:
    return PagedKV.from_mla([random_tensor((num_blocks, 64, MLA_WIDTH), torch.bfloat16, device)
                             for _ in range(DEEPSEEK_V3_LAYERS)])


def _fp8_with_scales(num_blocks: int, device: torch.device) -> PagedKV:
    """Per layer: K and V in fp8, then a float32 scale per (token, head) for each: 4 planes."""
    planes = []
    for _ in range(LLAMA8B_LAYERS):
        planes += [random_tensor((num_blocks, 16, LLAMA8B_KV_HEADS, HEAD_DIM), torch.float8_e4m3fn, device)
                   for _ in range(2)]
        planes += [random_tensor((num_blocks, 16, LLAMA8B_KV_HEADS), torch.float32, device) for _ in range(2)]
    return PagedKV.from_planes(planes, planes_per_layer=4)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("llama8b-16", "Llama-3.1-8B, 16-token blocks: 32 layers x K/V = 64 planes of 32 KiB plane-blocks "
             "(DESIGN.md §4)", llama8b_with_block_tokens(16)),
    Workload("llama70b-tp4-16", "Llama-3.1-70B on one of 4 tensor-parallel ranks, 16-token blocks: 80 layers x K/V, "
             "2 KV heads = 8 KiB plane-blocks", _vllm(LLAMA70B_LAYERS, LLAMA70B_KV_HEADS_PER_TP4_RANK, 16)),
    Workload("deepseek-v3-mla-64", "DeepSeek-V3 MLA, 64-token blocks: 61 layers of one 576-wide latent, "
             "72 KiB plane-blocks", _mla),
    Workload("llama8b-fp8-16", "Llama-3.1-8B in fp8 with per-token-head float32 scales: 128 planes, "
             "16 KiB K/V and 512 B scale plane-blocks", _fp8_with_scales),
)}
DEFAULT_WORKLOAD = "llama8b-16"
# Workloads whose planes differ in size (their tables give the mean plane-block).
MIXED_PLANE_WORKLOADS = frozenset({"llama8b-fp8-16"})

# Llama-3.1-8B's 64 planes with one 128-dim bf16 row per plane-block (256 B):
# a 1-block call moves 16 KiB, so its time is the fixed cost of a call
# (validation, dispatch, planning and launching 64 copies).
TINY_PLANES = Workload("llama8b-256B", "Llama-3.1-8B's 64 planes, one 128-dim bf16 row (256 B) per plane-block",
                       _vllm(LLAMA8B_LAYERS, 1, 1))
