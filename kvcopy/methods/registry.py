"""The registry of copy methods: one record per method, which dispatch, the engine, the
calibrator and the bench iterate. Adding a method is one module that builds a
:class:`CopyMethod` and passes it to :func:`register` (kvcopy/methods/builtin.py registers the built-in
ones; tests/core/test_method_registry.py a toy one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcopy.layout import PagedKV

__all__ = ["CopyMethod", "RunFn", "get", "method_names", "methods", "register", "unregister"]

# run(src, src_ids, dst, dst_ids, num_ctas): ids are validated int64 tensors of one length (on the host, or on
# the copy's GPU); the copy's device and stream are current. num_ctas is None or >= 1 (SM methods only).
RunFn = Callable[[PagedKV, torch.Tensor, PagedKV, torch.Tensor, "int | None"], None]


@dataclass(frozen=True)
class CopyMethod:
    """What kvcopy needs to know about one copy method.

    - ``name``: what users pass as ``method=``.
    - ``host_ids_only``: it reads block ids on the host (device-resident ids cannot be used).
    - ``stages_ids``: it reads ids on the GPU, so host ids are staged there first (the engine stages them
      once for every layer of a transfer).
    - ``capturable``: its submission can be captured in a CUDA graph (one kernel launch).
    - ``uses_sms``: it copies with SM kernels, so ``num_ctas`` bounds it.
    - ``unavailable(src, dst)``: why it cannot run for this pair in this process, or None when it can.
    - ``auto_rank(src, dst)``: its place in ``method="auto"``'s documented defaults (lower first), or None
      when the defaults never pick it for this pair; a calibrated profile overrides the ranks.
    - ``run``: the eager entry point; ``run_traced``: the one torch.compile traces (registered ops with fake
      implementations), None when ``run`` is traceable as it is.
    """

    name: str
    run: RunFn
    unavailable: Callable[[PagedKV, PagedKV], str | None]
    auto_rank: Callable[[PagedKV, PagedKV], int | None]
    host_ids_only: bool = False
    stages_ids: bool = False
    capturable: bool = False
    uses_sms: bool = False
    run_traced: RunFn | None = None

    def can_run(self, src: PagedKV, dst: PagedKV) -> bool:
        return self.unavailable(src, dst) is None


_REGISTRY: dict[str, CopyMethod] = {}


def register(method: CopyMethod) -> CopyMethod:
    """Adds ``method``; ValueError if its name is taken or is "auto". Returns it."""
    if not isinstance(method, CopyMethod):
        raise TypeError(f"method: expected a CopyMethod, got {type(method).__name__}")
    if method.name == "auto" or method.name in _REGISTRY:
        raise ValueError(f"method: the name {method.name!r} is taken")
    _REGISTRY[method.name] = method
    _changed()
    return method


def unregister(name: str) -> None:
    """Removes a registered method (KeyError if there is none of that name)."""
    del _REGISTRY[name]
    _changed()


def get(name: str) -> CopyMethod | None:
    """The method called ``name``, or None."""
    return _REGISTRY.get(name)


def methods() -> tuple[CopyMethod, ...]:
    """Every registered method, in registration order ("torch" first)."""
    return tuple(_REGISTRY.values())


def method_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


_listeners: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Calls ``listener`` whenever a method is registered or removed (dispatch drops its cached choices)."""
    _listeners.append(listener)


def _changed() -> None:
    for listener in _listeners:
        listener()
