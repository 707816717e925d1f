"""Copies checked byte for byte: random caches of every engine layout, and the reference a copy is held to.

The reference (``reference_copy``) is written independently of kvcopy: plain torch indexing on uint8 views of
each plane.
"""

from __future__ import annotations

import numpy as np
import torch

import kvcopy

from helpers import HAS_CUDA

# --------------------------------------------------------------------------- bytes


def byte_rows(plane: torch.Tensor) -> torch.Tensor:
    """``plane`` as ``[num_blocks, block_nbytes]`` uint8, a view (works for fp8 and strided planes).

    Built with as_strided from the block stride, so size-1 block dims of any
    stride (which PagedKV accepts) are handled too.
    """
    block_numel = 1
    for size in plane.shape[1:]:
        block_numel *= size
    rows = plane.as_strided((plane.shape[0], block_numel), (plane.stride(0), 1))
    return rows.view(torch.uint8)


def random_bytes(numel_bytes: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (numel_bytes,), dtype=torch.uint8, generator=gen)


def random_tensor(shape, dtype: torch.dtype, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """A contiguous tensor of random bytes viewed as ``dtype`` (NaN/Inf payloads included)."""
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    t = random_bytes(numel * itemsize, gen).view(dtype).view(*shape)
    return t.to(device) if str(device) != "cpu" else t


def fill_random_(kv, gen: torch.Generator) -> None:
    """Overwrites every block byte of a PagedKV / HostKVPool with random bytes."""
    if isinstance(kv, kvcopy.HostKVPool):
        kv.buffer.copy_(random_bytes(kv.buffer.numel(), gen))
        return
    for plane in kv.planes:
        rows = byte_rows(plane)
        rows.copy_(random_bytes(rows.numel(), gen).view(rows.shape).to(rows.device))


def paged(kv) -> kvcopy.PagedKV:
    return kv.paged if isinstance(kv, kvcopy.HostKVPool) else kv


def snapshot(kv) -> list[torch.Tensor]:
    """Clones of every plane's bytes (and of the whole buffer for a pool), on the CPU."""
    shots = [byte_rows(p).clone().cpu() for p in paged(kv).planes]
    if isinstance(kv, kvcopy.HostKVPool):
        shots.append(kv.buffer.clone())
    return shots


def assert_same_bytes(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for p, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.dtype == torch.uint8 and e.dtype == torch.uint8
        assert a.shape == e.shape, f"plane {p}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        if not torch.equal(a, e):
            diff = (a != e).nonzero()
            raise AssertionError(f"plane {p}: {diff.shape[0]} bytes differ, first at {diff[0].tolist()}")


def as_id_list(ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return [int(v) for v in ids.cpu().tolist()]
    if isinstance(ids, np.ndarray):
        return [int(v) for v in ids.tolist()]
    return [int(v) for v in ids]


def reference_copy(src, src_ids, dst, dst_ids) -> list[torch.Tensor]:
    """Expected dst plane bytes after the copy, with plain torch indexing on clones.

    Written independently of kvcopy: ``ref[p][dst_ids] = src[p][src_ids]`` on
    uint8 views of each plane.
    """
    src_planes = paged(src).planes
    dst_planes = paged(dst).planes
    s_ids = torch.tensor(as_id_list(src_ids), dtype=torch.int64)
    d_ids = torch.tensor(as_id_list(dst_ids), dtype=torch.int64)
    expected = []
    for sp, dp in zip(src_planes, dst_planes, strict=True):
        ref = byte_rows(dp).clone().cpu()
        if len(d_ids):
            ref[d_ids] = byte_rows(sp).cpu()[s_ids]
        expected.append(ref)
    return expected


def dst_bytes(dst) -> list[torch.Tensor]:
    return [byte_rows(p).clone().cpu() for p in paged(dst).planes]


def check_copy(src, src_ids, dst, dst_ids, *, method, **kw) -> None:
    """Runs kvcopy.copy_blocks and compares every byte of dst with the reference."""
    expected = reference_copy(src, src_ids, dst, dst_ids)
    src_before = snapshot(src)
    kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method, **kw)
    if HAS_CUDA:
        torch.cuda.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)
    if paged(src).planes[0].data_ptr() != paged(dst).planes[0].data_ptr():
        assert_same_bytes(snapshot(src), src_before)  # the source is never written


# --------------------------------------------------------------------------- layouts


def make_vllm(num_layers, num_blocks, block_size, heads, head_dim, dtype, gen, device="cpu"):
    layers = [
        random_tensor((2, num_blocks, block_size, heads, head_dim), dtype, gen, device) for _ in range(num_layers)
    ]
    return kvcopy.PagedKV.from_vllm(layers), layers


def make_flashinfer(num_layers, num_blocks, block_size, heads, head_dim, dtype, gen, device="cpu"):
    layers = [
        random_tensor((num_blocks, 2, block_size, heads, head_dim), dtype, gen, device) for _ in range(num_layers)
    ]
    return kvcopy.PagedKV.from_flashinfer(layers), layers


def make_mla(num_layers, num_blocks, block_size, head_size, dtype, gen, device="cpu"):
    layers = [random_tensor((num_blocks, block_size, head_size), dtype, gen, device) for _ in range(num_layers)]
    return kvcopy.PagedKV.from_mla(layers), layers


def make_planes(num_blocks, block_shapes, dtypes, gen, device="cpu"):
    planes = [
        random_tensor((num_blocks, *shape), dt, gen, device) for shape, dt in zip(block_shapes, dtypes, strict=True)
    ]
    return kvcopy.PagedKV.from_planes(planes), planes


LAYOUTS = ("vllm", "flashinfer", "mla", "planes")


def make_layout(kind, num_blocks, dtype, gen, device="cpu", *, block_size=3, heads=1, head_dim=5, num_layers=2):
    """A small cache of the given engine layout; default sizes give odd block byte counts."""
    if kind == "vllm":
        return make_vllm(num_layers, num_blocks, block_size, heads, head_dim, dtype, gen, device)[0]
    if kind == "flashinfer":
        return make_flashinfer(num_layers, num_blocks, block_size, heads, head_dim, dtype, gen, device)[0]
    if kind == "mla":
        return make_mla(num_layers, num_blocks, block_size, head_dim * 2 + 1, dtype, gen, device)[0]
    if kind == "planes":
        shapes = [(block_size, head_dim), (7,), (block_size, 2, head_dim), ()]
        return make_planes(num_blocks, shapes, [dtype] * len(shapes), gen, device)[0]
    raise ValueError(kind)


def empty_like_kv(kv: kvcopy.PagedKV, num_blocks: int, gen: torch.Generator, device=None) -> kvcopy.PagedKV:
    """A fresh PagedKV with contiguous planes shaped like ``kv``'s blocks, filled with random bytes."""
    device = kv.device if device is None else device
    planes = [random_tensor((num_blocks, *p.shape[1:]), p.dtype, gen, device) for p in kv.planes]
    return kvcopy.PagedKV.from_planes(planes, planes_per_layer=kv.planes_per_layer)
