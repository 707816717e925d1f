"""Which registered methods can run for a (source, destination) pair, and what ``method="auto"`` picks."""

from __future__ import annotations

from kvcopy.host.pool import KVLike, as_paged
from kvcopy.layout import PagedKV
from kvcopy.methods import registry
from kvcopy.methods.registry import CopyMethod
from kvcopy.profile import Profile, direction_of

__all__ = ["available_methods", "choose_method", "unavailable_reason", "usable"]


def available_methods(src: KVLike, dst: KVLike) -> list[str]:
    """The registered methods that can copy from ``src`` to ``dst`` (PagedKV or HostKVPool) in this process,
    "torch" first."""
    src, dst = as_paged(src, "src"), as_paged(dst, "dst")
    return [m.name for m in registry.methods() if m.can_run(src, dst)]


def unavailable_reason(method: str, src: PagedKV, dst: PagedKV) -> str:
    """A sentence on why the registered ``method`` cannot run for this pair."""
    found = registry.get(method)
    reason = found.unavailable(src, dst) if found is not None else None
    return reason or "it can run"


def usable(method: CopyMethod, *, host_ids: bool, capturing: bool) -> bool:
    """Whether ``method`` can take ids where they are, and (while capturing) be captured in a CUDA graph."""
    return (host_ids or not method.host_ids_only) and (not capturing or method.capturable)


def choose_method(
    src: PagedKV,
    dst: PagedKV,
    available: list[str],
    *,
    host_ids: bool,
    capturing: bool = False,
    num_blocks: int = 1,
    profile: Profile | None = None,
) -> str:
    """What ``method="auto"`` runs, among the ``available`` methods.

    With a calibrated ``profile`` that measured this direction: the measured
    method predicted fastest for ``num_blocks`` blocks at this cache's
    plane-block size (among those that can run here, take the ids where they
    are, and are capturable while capturing). Without one, the documented
    defaults (each method's ``auto_rank``, kvcopy/methods/builtin.py): host to
    host "cpu" when compiled, else "torch"; with a GPU "copy_engine" for
    plane-blocks of at least DMA_MIN_BLOCK_BYTES (host ids only), else the SM
    kernel "cuda", else "triton", else "copy_engine" (host ids; where the SM
    kernels cannot read host memory), else "torch". While the current stream
    is being captured into a CUDA graph: "cuda", else "triton" (ValueError if
    neither can run).
    """
    candidates = [
        m
        for m in (registry.get(name) for name in available)
        if m is not None and usable(m, host_ids=host_ids, capturing=capturing)
    ]
    if profile is not None:
        direction = direction_of(src.device.type, dst.device.type)
        if direction in profile.directions:
            measured = profile.best_method(
                direction,
                src.nbytes_per_block,
                max(num_blocks, 1),
                planes=src.num_planes,
                candidates=[m.name for m in candidates],
            )
            if measured is not None:
                return measured
    ranked = [(rank, m.name) for m in candidates if (rank := m.auto_rank(src, dst)) is not None]
    if ranked:
        return min(ranked)[1]
    if capturing:
        raise ValueError(f"method: 'auto' found no method that can be captured in a CUDA graph among {available}")
    return "torch"
