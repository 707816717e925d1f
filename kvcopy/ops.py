"""copy_blocks, gather and scatter: validation, method choice, dispatch.

Everything a user can get wrong is checked before any byte moves, without a
device synchronisation: see kvcopy._ids for what "fully validated" means for
host-resident versus device-resident ids.
"""

from __future__ import annotations

import contextlib
from typing import Union

import torch

from . import _ext
from . import methods as _methods
from ._block_order import check_caller
from ._ids import BlockIds, check_disjoint, prepare_ids
from ._torch_copy import copy_blocks_torch
from .host import HostKVPool
from .layout import PagedKV
from .profile import Profile, default_profile

__all__ = ["copy_blocks", "gather", "scatter", "available_methods", "HOST_LINK_CTA_BUDGET", "TRITON_PROGRAMS_PER_CTA"]

KVLike = Union[PagedKV, HostKVPool]

# CTAs the "cuda" SM kernel may use by default when host memory is on one side
# (mirrors kHostLinkCtaBudget in csrc/kernels/block_copy_cuda.h): a few CTAs
# saturate PCIe, every other SM stays with decode. `num_ctas` overrides it.
HOST_LINK_CTA_BUDGET = 4
# A CTA of the SM kernel is 1024 threads; a Triton program is 8 warps (256): a
# budget of n CTAs gives Triton n times this many programs.
TRITON_PROGRAMS_PER_CTA = 4


def _as_paged(kv: KVLike, name: str) -> PagedKV:
    if isinstance(kv, PagedKV):
        return kv
    if isinstance(kv, HostKVPool):
        return kv.paged
    raise TypeError(f"{name}: expected a PagedKV or HostKVPool, got {type(kv).__name__}")


def _check_pair(src: PagedKV, dst: PagedKV) -> None:
    if src.num_planes != dst.num_planes:
        raise ValueError(f"dst: expected {src.num_planes} planes like src, got {dst.num_planes}")
    if src.block_nbytes != dst.block_nbytes:
        p = next(i for i, (a, b) in enumerate(zip(src.block_nbytes, dst.block_nbytes)) if a != b)
        raise ValueError(
            f"dst: plane {p} blocks are {dst.block_nbytes[p]} bytes, expected {src.block_nbytes[p]} like src"
        )
    if src.dtypes != dst.dtypes:
        p = next(i for i, (a, b) in enumerate(zip(src.dtypes, dst.dtypes)) if a != b)
        raise ValueError(f"dst: plane {p} has dtype {dst.dtypes[p]}, expected {src.dtypes[p]} like src")
    if src.device.type == "cuda" and dst.device.type == "cuda" and src.device != dst.device:
        raise ValueError(f"dst: on {dst.device}, src on {src.device}; copies between two GPUs are not supported")


def available_methods(src: KVLike, dst: KVLike) -> list[str]:
    """The methods that can copy from ``src`` to ``dst`` here, "torch" first."""
    return list(_methods.available_methods(_as_paged(src, "src"), _as_paged(dst, "dst")))


def _uses_cuda(src: PagedKV, dst: PagedKV) -> bool:
    return src.device.type == "cuda" or dst.device.type == "cuda"


def _capturing(src: PagedKV, dst: PagedKV) -> bool:
    """Whether the current CUDA stream is being captured into a graph.

    Not asked while torch.compile traces: the query returns a Python bool, which Dynamo refuses
    inside a graph. A traced copy is chosen as outside a capture (pass ``method="cuda"`` to a
    copy you compile for CUDA graphs, e.g. ``mode="reduce-overhead"``).
    """
    return _uses_cuda(src, dst) and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing()


def _resolve(
    method: str,
    src: PagedKV,
    dst: PagedKV,
    *,
    host_ids: bool,
    capturing: bool = False,
    num_blocks: int = 1,
    profile: Profile | None = None,
) -> str:
    """The method to run; "auto" consults ``profile``, else the default profile (kvcopy.profile)."""
    available = _methods.available_methods(src, dst)
    if capturing and host_ids:
        raise ValueError(
            "src_ids/dst_ids: under CUDA graph capture pass ids as CUDA tensors (static buffers you update "
            "before each replay); host ids would be staged once and frozen into the graph"
        )
    if method == "auto":
        return _methods.choose_method(
            src, dst, available, host_ids=host_ids, capturing=capturing, num_blocks=num_blocks,
            profile=profile if profile is not None else default_profile(),
        )
    if method not in _methods.METHODS:
        raise ValueError(f"method: unknown method {method!r}; known: 'auto', "
                         f"{', '.join(repr(m) for m in _methods.METHODS)} (for this pair: {available})")
    if method not in available:
        reason = _methods.unavailable_reason(method, src, dst)
        raise ValueError(f"method: {method!r} cannot run for this pair ({reason}); methods that can: {available}")
    if method in _methods.HOST_ID_METHODS and not host_ids:
        raise ValueError(f"method: {method!r} reads ids on the host; pass CPU tensors or sequences as ids")
    if capturing and method not in _methods.CAPTURABLE_METHODS:
        raise ValueError(
            f"method: {method!r} cannot be captured in a CUDA graph; capturable: {list(_methods.CAPTURABLE_METHODS)}"
        )
    return method


def _cuda_device(src: PagedKV, dst: PagedKV) -> torch.device:
    return src.device if src.device.type == "cuda" else dst.device


def _staged(ids: torch.Tensor) -> torch.Tensor:
    """Host ids in a pinned buffer of kvcopy's own, ready for an asynchronous copy to a GPU.

    Always a new buffer: ``pin_memory()`` of a tensor already pinned returns the tensor itself,
    which the caller may change before the asynchronous copy reads it. While torch.compile
    traces (fake tensors cannot be pinned) the ids are copied as they are.
    """
    if torch.compiler.is_compiling():
        return ids
    if ids.is_pinned():
        ids = ids.clone()  # a pageable copy: pin_memory() below copies it again into pinned memory
    return ids.pin_memory()


def _ids_on(src_ids: torch.Tensor, dst_ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Both id tensors on ``device``; host ids travel together in one asynchronous copy from a pinned
    buffer of kvcopy's own. Ids already on the GPU are recorded on the current stream, which reads them."""
    if src_ids.device == device and dst_ids.device == device:
        for ids in (src_ids, dst_ids):
            _record_on_current_stream(ids)
        return src_ids, dst_ids
    if src_ids.device.type == "cpu" and dst_ids.device.type == "cpu":
        both = _staged(torch.cat((src_ids, dst_ids))).to(device, non_blocking=True)
        return both[: src_ids.numel()], both[src_ids.numel() :]

    def moved(ids: torch.Tensor) -> torch.Tensor:
        if ids.device == device:
            _record_on_current_stream(ids)
            return ids
        return _staged(ids).to(device, non_blocking=True)

    return moved(src_ids), moved(dst_ids)


def _record_on_current_stream(ids: torch.Tensor) -> None:
    """The caller's GPU ids, made on another stream, stay allocated until the current stream (which
    reads them) is past the copy, even if the caller drops them as soon as copy_blocks returns."""
    if ids.is_cuda and not torch.compiler.is_compiling():
        ids.record_stream(torch.cuda.current_stream(ids.device))


def _run(method: str, src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor,
         num_ctas: int | None = None) -> None:
    if method == "torch":
        copy_blocks_torch(src, src_ids, dst, dst_ids)
        return
    device = _cuda_device(src, dst) if _uses_cuda(src, dst) else src.device
    if method == "triton":
        from .triton_copy import copy_blocks_triton

        if torch.compiler.is_compiling():
            _check_ids_in_graph(src, src_ids, dst, dst_ids)
        src_on_device, dst_on_device = _ids_on(src_ids, dst_ids, device)
        programs = None if num_ctas is None else num_ctas * TRITON_PROGRAMS_PER_CTA
        copy_blocks_triton(src, src_on_device, dst, dst_on_device, num_programs=programs)
        return
    if torch.compiler.is_compiling():
        _run_op(method, src, src_ids, dst, dst_ids, device, num_ctas)
        return
    # Eager: the same kernels, entered with cached plane tables (csrc/fast_path.cpp).
    fast = _ext.extension()
    n = src_ids.numel()
    tables = (src.plane_table.data_ptr(), dst.plane_table.data_ptr(), src.num_planes)
    if method == "cpu":
        fast.copy_blocks_cpu(*tables, src_ids.data_ptr(), dst_ids.data_ptr(), n, torch.get_num_threads())
    elif method == "copy_engine":
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        fast.copy_blocks_dma(*tables, src_ids.data_ptr(), dst_ids.data_ptr(), n, stream, device.index)
    else:
        src_ids, dst_ids = _ids_on(src_ids, dst_ids, device)
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        fast.copy_blocks_cuda(
            *tables, src_ids.data_ptr(), dst_ids.data_ptr(), n, src.num_blocks, dst.num_blocks,
            _cta_budget(src, dst, num_ctas), stream, device.index,
        )


def _cta_budget(src: PagedKV, dst: PagedKV, num_ctas: int | None) -> int:
    """CTAs for the SM kernel: the caller's budget, else the host-link default, else 0 (one full wave)."""
    if num_ctas is not None:
        return num_ctas
    return HOST_LINK_CTA_BUDGET if src.device.type != dst.device.type else 0


def check_num_ctas(num_ctas: object, name: str = "num_ctas") -> int | None:
    """``num_ctas`` as given, or TypeError / ValueError naming it."""
    if num_ctas is None:
        return None
    if isinstance(num_ctas, bool) or not isinstance(num_ctas, int):
        raise TypeError(f"{name}: expected a number of CTAs (int) or None, got {type(num_ctas).__name__}")
    if num_ctas < 1:
        raise ValueError(f"{name}: expected at least 1 CTA or None for the default, got {num_ctas}")
    return num_ctas


def _run_op(
    method: str, src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, device: torch.device,
    num_ctas: int | None = None,
) -> None:
    """The registered torch.ops (traceable by torch.compile).

    Host ids are checked by an op first: the copy ops check ranges and repeats
    themselves, but under functionalization they see a clone of ``dst`` and
    cannot tell that it is the same cache as ``src``.
    """
    _check_ids_in_graph(src, src_ids, dst, dst_ids)
    if method == "cpu":
        torch.ops.kvcopy.copy_blocks(src.planes, src_ids, dst.planes, dst_ids, 0)
    elif method == "copy_engine":
        torch.ops.kvcopy.copy_blocks_dma(src.planes, src_ids, dst.planes, dst_ids)
    else:
        src_ids, dst_ids = _ids_on(src_ids, dst_ids, device)
        torch.ops.kvcopy.copy_blocks(src.planes, src_ids, dst.planes, dst_ids, _cta_budget(src, dst, num_ctas))


def _check_ids_in_graph(src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor) -> None:
    """Under torch.compile the Python id checks cannot read values: an op checks host ids at run time."""
    if src_ids.device.type == "cpu" and dst_ids.device.type == "cpu" and _ext.has_cpu_kernels():
        torch.ops.kvcopy.check_block_ids(src_ids, dst_ids, src.num_blocks, dst.num_blocks, src is dst)


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
    Repeated source ids are allowed; repeated destination ids are not.

    GPU methods ("cuda", "triton", "copy_engine") are asynchronous on
    ``stream`` (default: the current stream); keep both sides alive and
    unchanged until that stream has reached the copy. "cpu" and "torch" return
    when the copy is done. Host-resident ids are validated in full before
    anything is written; CUDA-resident ids only for dtype and shape (see
    kvcopy._ids). Raises IndexError, TypeError or ValueError for bad input.

    ``num_ctas``: the SM budget of the "cuda" kernel (Triton gets
    TRITON_PROGRAMS_PER_CTA programs per CTA). None: HOST_LINK_CTA_BUDGET (4)
    when host memory is on one side, which saturates PCIe and leaves every
    other SM to decode; one full wave of the GPU for device-to-device copies.
    More CTAs move small plane-blocks faster and take SMs from whatever runs
    beside the copy. The other methods use no SMs and ignore it.
    """
    src_kv, dst_kv = _as_paged(src, "src"), _as_paged(dst, "dst")
    _check_pair(src_kv, dst_kv)
    num_ctas = check_num_ctas(num_ctas)
    # Device and stream first: ids converted on the GPU are made on the copy's stream.
    with _device_context(src_kv, dst_kv, stream):
        _copy(src_kv, src_ids, dst_kv, dst_ids, method, num_ctas)


def _device_context(src: PagedKV, dst: PagedKV, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Makes the copy's GPU current, and ``stream`` its current stream when given."""
    if not _uses_cuda(src, dst):
        return contextlib.nullcontext()  # host-only copies run on the calling thread; `stream` is moot
    device = _cuda_device(src, dst)
    if stream is not None:
        if stream.device != device:
            raise ValueError(f"stream: expected a stream on {device} like the copy, got one on {stream.device}")
        return torch.cuda.stream(stream)  # also makes the stream's device current
    if torch.cuda.current_device() != device.index:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _prepare_pair(
    src: PagedKV, src_ids: BlockIds, dst: PagedKV, dst_ids: BlockIds, names: tuple[str, str] = ("src_ids", "dst_ids")
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Both id lists validated (kvcopy._ids), of one length, on an allowed device; and whether both are on the host."""
    src_name, dst_name = names
    src_t = prepare_ids(src_ids, src_name, src.num_blocks, unique=False)
    dst_t = prepare_ids(dst_ids, dst_name, dst.num_blocks, unique=True)
    if src_t.numel() != dst_t.numel():
        raise ValueError(f"{dst_name}: expected as many ids as {src_name} ({src_t.numel()}), got {dst_t.numel()}")
    _check_id_devices(src, src_t, dst, dst_t, names)
    return src_t, dst_t, src_t.device.type == "cpu" and dst_t.device.type == "cpu"


def _copy(src: PagedKV, src_ids: BlockIds, dst: PagedKV, dst_ids: BlockIds, method: str,
          num_ctas: int | None = None) -> None:
    src_t, dst_t, host_ids = _prepare_pair(src, src_ids, dst, dst_ids)
    if src is dst and host_ids:
        check_disjoint(src_t, dst_t)
    if host_ids:  # debug mode: the caller's copy against a TransferEngine's transfers in flight
        check_caller("copy_blocks", src, src_t, writes=False)
        check_caller("copy_blocks", dst, dst_t, writes=True)
    chosen = _resolve(method, src, dst, host_ids=host_ids, capturing=_capturing(src, dst), num_blocks=src_t.numel())
    if src_t.numel() == 0:
        return
    _run(chosen, src, src_t, dst, dst_t, num_ctas)


def _check_id_devices(
    src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, names: tuple[str, str]
) -> None:
    allowed = {torch.device("cpu"), _cuda_device(src, dst)} if _uses_cuda(src, dst) else {torch.device("cpu")}
    for name, ids in zip(names, (src_ids, dst_ids)):
        if ids.device not in allowed:
            where = " or ".join(str(d) for d in sorted(allowed, key=str))
            raise ValueError(f"{name}: expected ids on {where}, got ids on {ids.device}")


def gather(kv: KVLike, block_ids: BlockIds, host: HostKVPool, host_ids: BlockIds, **kw: object) -> None:
    """Device pages -> host: ``copy_blocks(kv, block_ids, host, host_ids, **kw)``."""
    if not isinstance(host, HostKVPool):
        raise TypeError(f"host: expected a HostKVPool, got {type(host).__name__}")
    copy_blocks(kv, block_ids, host, host_ids, **kw)  # type: ignore[arg-type]


def scatter(host: HostKVPool, host_ids: BlockIds, kv: KVLike, block_ids: BlockIds, **kw: object) -> None:
    """Host -> device pages: ``copy_blocks(host, host_ids, kv, block_ids, **kw)``."""
    if not isinstance(host, HostKVPool):
        raise TypeError(f"host: expected a HostKVPool, got {type(host).__name__}")
    copy_blocks(host, host_ids, kv, block_ids, **kw)  # type: ignore[arg-type]
