"""The one dispatch pipeline: prepare -> resolve -> run. The public ops (kvcopy.ops) and the
TransferEngine both go through the functions here.

1. ``as_paged`` / ``check_pair``: the two sides as PagedKV, with one layout.
2. ``prepare_pair``: both id lists validated (kvcopy.ids) before any byte moves.
3. ``resolve``: the method to run (a registered CopyMethod), "auto" through kvcopy.methods.choice.
4. ``run``: the method's eager entry point, or its traced one under torch.compile.

``host_fast_path`` is the same pipeline for the commonest small call, a host-to-host copy with
int64 id tensors: everything that depends only on the pair (layout checks, the method, the plane
tables) is resolved once per (src, dst, method) and cached, and the ids are checked in C++ by the
same code (and with the same messages) as the registered ops use (csrc/include/kvcopy/block_ids.h).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from kvcopy import _ext
from kvcopy.conflicts import any_watched, check_caller
from kvcopy.host.pool import HostKVPool, KVLike, as_paged
from kvcopy.ids import BlockIds, as_ids, check_host_pair, check_lengths, check_shared_memory, check_side
from kvcopy.layout import PagedKV, block_for_block, memory_overlap, shares_memory
from kvcopy.methods import registry
from kvcopy.methods.choice import available_methods, choose_method, unavailable_reason, usable
from kvcopy.methods.pairs import cuda_device, uses_cuda
from kvcopy.methods.registry import CopyMethod
from kvcopy.profile import Profile, default_profile, default_profile_generation

__all__ = [
    "KVLike",
    "as_paged",
    "capturing",
    "check_copyable",
    "check_method",
    "check_pair",
    "copy",
    "device_context",
    "host_fast_path",
    "prepare_pair",
    "resolve",
    "run",
]


def check_pair(src: PagedKV, dst: PagedKV, names: tuple[str, str] = ("src", "dst")) -> None:
    """ValueError unless ``dst`` has ``src``'s planes, plane-block sizes and dtypes, on a compatible device: the
    message says which plane differs and how, naming the two sides as ``names`` (the caller's arguments)."""
    a, b = names
    if src.num_planes != dst.num_planes:
        raise ValueError(f"{b}: expected {src.num_planes} planes like {a}, got {dst.num_planes}")
    if src.plane_block_nbytes != dst.plane_block_nbytes:
        p = next(
            i for i, (x, y) in enumerate(zip(src.plane_block_nbytes, dst.plane_block_nbytes, strict=True)) if x != y
        )
        got, expected = dst.plane_block_nbytes[p], src.plane_block_nbytes[p]
        raise ValueError(f"{b}: plane {p} blocks are {got} bytes, expected {expected} like {a}")
    if src.dtypes != dst.dtypes:
        p = next(i for i, (x, y) in enumerate(zip(src.dtypes, dst.dtypes, strict=True)) if x != y)
        raise ValueError(f"{b}: plane {p} has dtype {dst.dtypes[p]}, expected {src.dtypes[p]} like {a}")
    if src.device.type == "cuda" and dst.device.type == "cuda" and src.device != dst.device:
        raise ValueError(f"{b}: on {dst.device}, {a} on {src.device}; copies between two GPUs are not supported")


def check_copyable(src: PagedKV, dst: PagedKV, names: tuple[str, str] = ("src", "dst")) -> None:
    """ValueError unless both caches hold bytes a copy can move (a meta tensor has none). :func:`check_pair` leaves
    them to this: a plan of ranges (kvcopy.ranges.copy_ranges) may be made for caches on any device."""
    for name, kv in zip(names, (src, dst), strict=True):
        if kv.device.type == "meta":
            raise ValueError(f"{name}: expected a cache whose planes hold data, got planes on the meta device")


def check_method(method: object) -> str:
    """``method`` when it is a str (a name, checked by :func:`resolve`); TypeError naming it otherwise."""
    if not isinstance(method, str):
        raise TypeError(f"method: expected a method name (str), got {type(method).__name__} {method!r:.80}")
    return method


def check_stream(stream: object) -> None:
    """TypeError naming ``stream`` unless it is None or a torch.cuda.Stream (an ExternalStream too)."""
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream: expected a torch.cuda.Stream or None, got {type(stream).__name__} {stream!r:.80}")


def capturing(src: PagedKV, dst: PagedKV) -> bool:
    """Whether the current CUDA stream is being captured into a graph.

    Not asked while torch.compile traces: the query returns a Python bool, which Dynamo refuses
    inside a graph. A traced copy is chosen as outside a capture (pass ``method="cuda"`` to a
    copy you compile for CUDA graphs, e.g. ``mode="reduce-overhead"``).
    """
    return uses_cuda(src, dst) and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing()


def resolve(
    method: str,
    src: PagedKV,
    dst: PagedKV,
    *,
    host_ids: bool,
    capturing: bool = False,
    num_blocks: int = 1,
    profile: Profile | None = None,
) -> CopyMethod:
    """The registered method to run; "auto" consults ``profile``, else the default profile (kvcopy.profile).
    ValueError naming ``method`` when it is unknown, cannot run for this pair, cannot take the ids where they
    are, or cannot be captured while capturing; TypeError naming it when it is not a str."""
    check_method(method)
    if capturing and host_ids:
        raise ValueError(
            "src_ids/dst_ids: under CUDA graph capture pass ids as CUDA tensors (static buffers you update "
            "before each replay); host ids would be staged once and frozen into the graph"
        )
    available = available_methods(src, dst)
    if method == "auto":
        name = choose_method(
            src,
            dst,
            available,
            host_ids=host_ids,
            capturing=capturing,
            num_blocks=num_blocks,
            profile=profile if profile is not None else default_profile(),
        )
        auto = registry.get(name)
        assert auto is not None  # one of the available methods: registered
        return auto
    chosen = registry.get(method)
    if chosen is None:
        raise ValueError(
            f"method: unknown method {method!r}; known: 'auto', "
            f"{', '.join(repr(m) for m in registry.method_names())} (for this pair: {available})"
        )
    if method not in available:
        raise ValueError(
            f"method: {method!r} cannot run for this pair ({unavailable_reason(method, src, dst)}); "
            f"methods that can: {available}"
        )
    if not usable(chosen, host_ids=host_ids, capturing=False):
        raise ValueError(f"method: {method!r} reads ids on the host; pass CPU tensors or sequences as ids")
    if capturing and not chosen.capturable:
        capturable = [m.name for m in registry.methods() if m.capturable]
        raise ValueError(f"method: {method!r} cannot be captured in a CUDA graph; capturable: {capturable}")
    return chosen


def prepare_pair(
    src: PagedKV, src_ids: BlockIds, dst: PagedKV, dst_ids: BlockIds, names: tuple[str, str] = ("src_ids", "dst_ids")
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Both id lists validated (kvcopy.ids: the compiled check for host ids), of one length, on an allowed
    device; and whether both are on the host. Host ids that read a block sharing memory with a block they write
    are a ValueError too, whether ``src`` and ``dst`` are one object or two over the same memory
    (kvcopy.layout.memory_overlap): two PagedKVs over one cache, or a view shifted by a block."""
    src_t = as_ids(src_ids, names[0], src.num_blocks)
    dst_t = as_ids(dst_ids, names[1], dst.num_blocks)
    host_ids = src_t.device.type == "cpu" and dst_t.device.type == "cpu"
    if host_ids:
        # The compiled check covers memory shared block for block; any other sharing is checked after it.
        shared = shares_memory(src, dst)  # False for most pairs: no other question asked
        same_blocks = shared and block_for_block(src, dst)
        check_host_pair(src_t, dst_t, src.num_blocks, dst.num_blocks, same_cache=same_blocks, names=names)
        if shared and not same_blocks:
            if torch.compiler.is_compiling():  # the traced ids cannot be read here
                raise ValueError(
                    f"src/dst: they share memory other than block for block (one shifted or resized against the "
                    f"other); torch.compile cannot check {names[0]}/{names[1]} against that: copy outside it"
                )
            check_shared_memory(src_t, dst_t, memory_overlap(src, dst), names)
    else:  # the host side, if any, in full; device ids for their length only
        check_side(src_t, names[0], src.num_blocks, unique=False)
        check_side(dst_t, names[1], dst.num_blocks, unique=True)
        check_lengths(src_t, dst_t, names)
    allowed = {torch.device("cpu"), cuda_device(src, dst)} if uses_cuda(src, dst) else {torch.device("cpu")}
    for name, ids in zip(names, (src_t, dst_t), strict=True):
        if ids.device not in allowed:
            where = " or ".join(str(d) for d in sorted(allowed, key=str))
            raise ValueError(f"{name}: expected ids on {where}, got ids on {ids.device}")
    return src_t, dst_t, host_ids


def run(
    method: CopyMethod,
    src: PagedKV,
    src_ids: torch.Tensor,
    dst: PagedKV,
    dst_ids: torch.Tensor,
    num_ctas: int | None = None,
) -> None:
    """Runs ``method`` on validated ids: its eager entry point, or under torch.compile its traced one, after an
    op that checks host ids inside the graph (the Python checks cannot read traced values)."""
    if not torch.compiler.is_compiling():
        method.run(src, src_ids, dst, dst_ids, num_ctas)
        return
    if src_ids.device.type == "cpu" and dst_ids.device.type == "cpu" and _ext.has_cpu_kernels():
        torch.ops.kvcopy.check_block_ids(src_ids, dst_ids, src.num_blocks, dst.num_blocks, block_for_block(src, dst))
    (method.run_traced or method.run)(src, src_ids, dst, dst_ids, num_ctas)


def device_context(src: PagedKV, dst: PagedKV, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Makes the copy's GPU current, and ``stream`` its current stream when given (TypeError for anything but a
    torch.cuda.Stream or None, on any pair)."""
    check_stream(stream)
    if not uses_cuda(src, dst):
        return contextlib.nullcontext()  # host-only copies run on the calling thread; `stream` is moot
    device = cuda_device(src, dst)
    if stream is not None:
        if stream.device != device:
            raise ValueError(f"stream: expected a stream on {device} like the copy, got one on {stream.device}")
        return torch.cuda.stream(stream)  # also makes the stream's device current
    if torch.cuda.current_device() != device.index:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def copy(
    src: PagedKV,
    src_ids: BlockIds,
    dst: PagedKV,
    dst_ids: BlockIds,
    method: str,
    stream: torch.cuda.Stream | None,
    num_ctas: int | None,
    names: tuple[str, str] = ("src_ids", "dst_ids"),
    cache_names: tuple[str, str] = ("src", "dst"),
) -> None:
    """The whole pipeline for one copy_blocks call on a checked pair (:func:`check_pair`); ``names`` and
    ``cache_names``: the id and cache arguments' names, as errors say them."""
    # Device and stream first: ids converted on the GPU are made on the copy's stream.
    with device_context(src, dst, stream):
        src_t, dst_t, host_ids = prepare_pair(src, src_ids, dst, dst_ids, names)
        if host_ids:  # debug mode: the caller's copy against a TransferEngine's transfers in flight
            check_caller("copy_blocks", src, src_t, writes=False)
            check_caller("copy_blocks", dst, dst_t, writes=True)
        chosen = resolve(method, src, dst, host_ids=host_ids, capturing=capturing(src, dst), num_blocks=src_t.numel())
        check_copyable(src, dst, cache_names)  # after the method's own reason, which says more
        if src_t.numel():
            run(chosen, src, src_t, dst, dst_t, num_ctas)


# ----------------------------------------------------------------------------- the host fast path


class _HostPlan:
    """What a host-to-host (src, dst, method) needs per call, resolved once: weak references to the objects
    the caller passed (the plan is valid while they are the same objects), the compiled copy's view of the
    pair, and for "auto" the choice per size bucket (powers of two of the block count), dropped when the
    default profile or the method registry changes."""

    __slots__ = ("auto", "choices", "copier", "dst_ref", "generation", "src_ref")

    def __init__(self, src_obj: KVLike, dst_obj: KVLike, src: PagedKV, dst: PagedKV, method: str) -> None:
        # Raw plane addresses, valid while src_obj and dst_obj live: every use first checks the weak references.
        self.src_ref = weakref.ref(src_obj)
        self.dst_ref = weakref.ref(dst_obj)
        self.auto = method == "auto"  # no strong reference to either side: the plan must not keep a cache alive
        # The compiled side of the plan (csrc/python/module.cpp): the planes, read from the tables once.
        self.copier = _ext.loaded_extension().HostCopyPlan(
            src.plane_table.data_ptr(),
            dst.plane_table.data_ptr(),
            src.num_planes,
            src.num_blocks,
            dst.num_blocks,
            block_for_block(src, dst),
        )
        self.choices: dict[int, bool] = {}  # size bucket -> whether "auto" runs "cpu" for it
        self.generation = default_profile_generation()

    def auto_runs_cpu(self, num_ids: int, src_obj: object, dst_obj: object) -> bool:
        """Whether "auto" runs the compiled "cpu" copy for ``num_ids`` blocks between the plan's objects (else
        the general path runs)."""
        generation = default_profile_generation()
        if self.generation != generation:
            self.choices.clear()
            self.generation = generation
        bucket = num_ids.bit_length()
        found = self.choices.get(bucket)
        if found is None:
            src, dst = as_paged(src_obj, "src"), as_paged(dst_obj, "dst")
            chosen = resolve("auto", src, dst, host_ids=True, num_blocks=max(num_ids, 1))
            found = self.choices[bucket] = chosen.name == "cpu"
        return found


_host_plans: dict[tuple[int, int, str], _HostPlan] = {}
# Plans for this many (src, dst, method) triples at most: an engine uses a handful; the bound keeps a program
# that makes caches in a loop from growing the table (which holds no strong reference to them).
_MAX_HOST_PLANS = 256


def _forget_host_plans() -> None:
    _host_plans.clear()


registry.on_change(_forget_host_plans)


def _new_host_plan(src_obj: object, dst_obj: object, method: str) -> _HostPlan | None:
    """A plan for a host-to-host pair that "cpu" (or "auto") may copy, or None for every other call."""
    if method != "auto" and method != "cpu":
        return None
    if not (isinstance(src_obj, (PagedKV, HostKVPool)) and isinstance(dst_obj, (PagedKV, HostKVPool))):
        return None  # the general path raises the TypeError
    src, dst = as_paged(src_obj, "src"), as_paged(dst_obj, "dst")
    if src.device.type != "cpu" or dst.device.type != "cpu" or not _ext.has_cpu_kernels():
        return None
    check_pair(src, dst)
    if shares_memory(src, dst) and not block_for_block(src, dst):
        return None  # shared memory the compiled id check cannot see (a shifted view): the general path checks it
    if len(_host_plans) >= _MAX_HOST_PLANS:
        _host_plans.clear()
    plan = _host_plans[(id(src_obj), id(dst_obj), method)] = _HostPlan(src_obj, dst_obj, src, dst, method)
    return plan


# Bound once: the fast path reads them on every call.
_Tensor, _INT64, _is_compiling, _num_threads = (
    torch.Tensor,
    torch.int64,
    torch.compiler.is_compiling,
    torch.get_num_threads,
)


def host_fast_path(src_obj: object, src_ids: object, dst_obj: object, dst_ids: object, method: str) -> bool:
    """Runs the copy and returns True when it is a host-to-host copy of two contiguous 1-D int64 CPU id
    tensors that "cpu" copies, outside torch.compile and with no debug-mode engine watching; False (nothing
    done) when the general path must take it. Raises the general path's errors for bad ids or layouts."""
    if _is_compiling() or type(src_ids) is not _Tensor or type(dst_ids) is not _Tensor:
        return False  # torch.compile traces the general path, whose traced entry points are registered ops
    plan = _host_plans.get((id(src_obj), id(dst_obj), method))
    if plan is None or plan.src_ref() is not src_obj or plan.dst_ref() is not dst_obj:
        plan = _new_host_plan(src_obj, dst_obj, method)
        if plan is None:
            return False
    if (
        src_ids.dtype is not _INT64
        or dst_ids.dtype is not _INT64
        or not src_ids.is_cpu
        or not dst_ids.is_cpu
        or src_ids.dim() != 1
        or dst_ids.dim() != 1
        or not src_ids.is_contiguous()
        or not dst_ids.is_contiguous()
        or any_watched()
    ):
        return False
    n = src_ids.numel()
    if plan.auto and not plan.auto_runs_cpu(n, src_obj, dst_obj):
        return False
    plan.copier.copy(src_ids.data_ptr(), n, dst_ids.data_ptr(), dst_ids.numel(), _num_threads())
    return True
