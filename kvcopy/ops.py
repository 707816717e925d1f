"""copy_blocks, gather and scatter: the public copy API over kvcopy.dispatch's pipeline.

Everything a user can get wrong is checked before any byte moves, without a
device synchronisation: see kvcopy.ids for what "fully validated" means for
host-resident versus device-resident ids.
"""

from __future__ import annotations

import torch

from kvcopy import dispatch
from kvcopy.dispatch import KVLike
from kvcopy.host.pool import HostKVPool
from kvcopy.ids import BlockIds
from kvcopy.methods.choice import available_methods
from kvcopy.methods.cta_budget import check_num_ctas

__all__ = ["available_methods", "copy_blocks", "gather", "scatter"]

# copy_blocks's arguments as errors name them (the compiled id checks say src_ids and dst_ids).
_COPY_NAMES = ("src", "src_ids", "dst", "dst_ids")


def copy_blocks(
    src: KVLike,
    src_ids: BlockIds,
    dst: KVLike,
    dst_ids: BlockIds,
    *,
    method: str = "auto",
    stream: torch.cuda.Stream | None = None,
    num_ctas: int | None = None,
) -> None:
    """For every i and plane p: ``dst.planes[p][dst_ids[i]] = src.planes[p][src_ids[i]]``, bitwise.

    All planes and blocks go in one submission. ``src`` and ``dst`` are PagedKV
    or HostKVPool; ids are 1-D int32/int64 tensors or sequences of ints.
    Repeated source ids are allowed; repeated destination ids are not. ``src`` and ``dst`` may be one cache,
    or share memory in any way (two PagedKVs over the same tensors, a view shifted by a block): a block read
    that shares a byte with a block written is a ValueError naming ``src_ids``/``dst_ids`` (host ids; judged
    by the planes' addresses, kvcopy.layout.memory_overlap).

    ``method``: "auto" (default; see kvcopy.methods.choice.choose_method) or a
    registered method name (kvcopy.METHODS lists the built-in ones). GPU
    methods ("cuda", "triton", "copy_engine") are asynchronous on ``stream``
    (default: the current stream); keep both sides alive and unchanged until
    that stream has reached the copy. "cpu" and "torch" return when the copy
    is done. Host-resident ids are validated in full before anything is
    written; CUDA-resident ids only for dtype and shape (see kvcopy.ids).
    Raises IndexError, TypeError or ValueError for bad input.

    ``num_ctas``: the SM budget of the "cuda" kernel (Triton gets
    TRITON_PROGRAMS_PER_CTA programs per CTA). None: HOST_MEMORY_CTA_BUDGET (4)
    when host memory is on one side, which saturates PCIe and leaves every
    other SM to decode; one full wave of the GPU for device-to-device copies.
    More CTAs move small plane-blocks faster and take SMs from whatever runs
    beside the copy. The other methods use no SMs and ignore it.
    """
    _copy(src, src_ids, dst, dst_ids, method, stream, num_ctas)


def _copy(
    src: KVLike,
    src_ids: BlockIds,
    dst: KVLike,
    dst_ids: BlockIds,
    method: str,
    stream: torch.cuda.Stream | None,
    num_ctas: int | None,
    names: tuple[str, str, str, str] = _COPY_NAMES,
) -> None:
    """copy_blocks, gather and scatter: the host fast path when it takes the call, else the pipeline. The
    arguments' types first (TypeError naming each), then the caches, then the ids: nothing is written before.
    ``names``: the caller's names of src, src_ids, dst and dst_ids, which every error uses."""
    dispatch.check_method(method)
    if stream is None and num_ctas is None:
        try:
            if dispatch.host_fast_path(src, src_ids, dst, dst_ids, method):
                return
        except (IndexError, ValueError):
            if names == _COPY_NAMES:
                raise
            # The fast path's compiled check says src_ids/dst_ids: the pipeline's same check names the caller's
            # arguments (nothing was written).
    num_ctas = check_num_ctas(num_ctas)
    dispatch.check_stream(stream)
    src_name, src_ids_name, dst_name, dst_ids_name = names
    src_kv, dst_kv = dispatch.as_paged(src, src_name), dispatch.as_paged(dst, dst_name)
    dispatch.check_pair(src_kv, dst_kv, (src_name, dst_name))
    dispatch.copy(
        src_kv, src_ids, dst_kv, dst_ids, method, stream, num_ctas, (src_ids_name, dst_ids_name), (src_name, dst_name)
    )


def gather(
    kv: KVLike,
    block_ids: BlockIds,
    host: HostKVPool,
    host_ids: BlockIds,
    *,
    method: str = "auto",
    stream: torch.cuda.Stream | None = None,
    num_ctas: int | None = None,
) -> None:
    """Device pages -> host pool: ``copy_blocks(kv, block_ids, host, host_ids, ...)``."""
    if not isinstance(host, HostKVPool):
        raise TypeError(f"host: expected a HostKVPool, got {type(host).__name__}")
    _copy(kv, block_ids, host, host_ids, method, stream, num_ctas, ("kv", "block_ids", "host", "host_ids"))


def scatter(
    host: HostKVPool,
    host_ids: BlockIds,
    kv: KVLike,
    block_ids: BlockIds,
    *,
    method: str = "auto",
    stream: torch.cuda.Stream | None = None,
    num_ctas: int | None = None,
) -> None:
    """Host pool -> device pages: ``copy_blocks(host, host_ids, kv, block_ids, ...)``."""
    if not isinstance(host, HostKVPool):
        raise TypeError(f"host: expected a HostKVPool, got {type(host).__name__}")
    _copy(host, host_ids, kv, block_ids, method, stream, num_ctas, ("host", "host_ids", "kv", "block_ids"))
