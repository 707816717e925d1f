"""kvcopy as the KV offload path and judge of Hugging Face transformers' continuous batching.

::

    from kvcopy.integrations import transformers as kvt

    with kvt.offloading(model, host_gib=1.0, policy="auto") as stats:
        out = model.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg)
    stats.reloaded_requests, stats.recomputed_requests, stats.decisions

When transformers' paged cache is full it preempts requests. Inside the
context, what happens to a preempted request's KV is kvcopy's business: it is
kept in a :class:`~kvcopy.HostKVPool` and reloaded when the request is
scheduled again, or dropped and re-prefilled, as the ``policy`` says:

- ``"auto"``: the :class:`~kvcopy.Planner` (the one ``kvcopy plan`` uses, from
  the model's live config and a calibrated profile) compares reloading the
  request's blocks with re-prefilling its tokens, per request. Without a
  profile it behaves as ``"offload"`` (until it has learned one, with
  ``learn=True``) and logs that once;
- ``"offload"``: always keep the KV while the host pool has room;
- ``"recompute"``: always drop it.

A full host pool falls back to recompute for that request (counted). Copies
run on a :class:`~kvcopy.TransferEngine`'s copy streams (worker threads on a
CPU): an offload overlaps the next forward and is waited for only by work
that would overwrite the blocks it reads; a reload is complete before the
forward that reads it. Nothing in transformers is edited: its continuous
batching builds kvcopy's manager instead of its own while the context is
open, and leaving the context (also on an exception) puts everything back,
finishes every copy and frees every host block.

With ``learn=True`` (the default) the calibration is only where the
judgment starts: every forward the engine runs (its requests' new and cached
tokens, and its seconds) and every offload and reload (from submission to
done) feed a :class:`~kvcopy.OnlineProfile`, and the Planner is rebuilt from
it when its predictions move (kvcopy.integrations.common.online_planner).
``stats.profile`` is the learned profile; ``save_profile`` writes it when the
context closes, for the next start (``profile=``) or ``kvcopy plan --profile``.

transformers is an optional extra (``pip install 'kvcopy[transformers]'``);
this module imports without it, and :func:`offloading` then raises an
ImportError naming the extra. A transformers outside
:data:`SUPPORTED_RANGE`, or one whose continuous-batching internals moved, is
a RuntimeError at :func:`offloading`, before anything is patched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from kvcopy._checks import boolean, path_argument, positive_number, writable_file_path
from kvcopy.integrations.common.offload_session import POLICIES, OffloadSession, Policy
from kvcopy.integrations.common.offload_stats import OffloadDecision, OffloadStats
from kvcopy.integrations.common.online_planner import OnlinePlanner
from kvcopy.integrations.transformers.compat import SUPPORTED_RANGE, check_internals, import_transformers
from kvcopy.methods import method_names
from kvcopy.model.spec import ModelSpec
from kvcopy.profile import Profile, default_profile

__all__ = ["POLICIES", "SUPPORTED_RANGE", "OffloadDecision", "OffloadStats", "model_spec", "offloading"]

logger = logging.getLogger(__name__)

# One context at a time in the process: it swaps a class in transformers' module for its duration.
_ACTIVE = threading.Lock()


def model_spec(model: Any) -> ModelSpec:
    """The :class:`~kvcopy.ModelSpec` of a live transformers model, from ``model.config`` (not a path),
    with the KV dtype the paged cache stores (the model's dtype)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"model: expected a transformers model with a .config, got {type(model).__name__}")
    data = config.to_dict()
    name = data.get("_name_or_path") or data.get("model_type") or type(model).__name__
    return ModelSpec.from_hf_config(data, name=name, kv_dtype=getattr(model, "dtype", None))


def _physical_memory_bytes() -> int | None:
    """The machine's physical memory in bytes (None where the OS does not say): no host pool can be larger."""
    try:
        pages, page_bytes = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None
    return pages * page_bytes if pages > 0 and page_bytes > 0 else None


def _check_arguments(
    model: object, host_gib: object, policy: object, profile: object, method: object, learn: object, save: object
) -> None:
    if not callable(getattr(model, "generate_batch", None)) or not hasattr(getattr(model, "config", None), "to_dict"):
        raise TypeError(
            f"model: expected a transformers model with continuous batching (generate_batch) and a "
            f".config, got {type(model).__name__}"
        )
    gib = positive_number("host_gib", host_gib)
    physical = _physical_memory_bytes()
    if physical is not None and gib * 2**30 > physical:
        raise ValueError(
            f"host_gib: expected at most this machine's physical memory ({physical / 2**30:.1f} GiB) for the "
            f"host pool, got {host_gib!r}"
        )
    if not isinstance(policy, str):
        raise TypeError(f"policy: expected one of {POLICIES}, got {type(policy).__name__} {policy!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if not (profile is None or isinstance(profile, (Profile, str, os.PathLike))):
        raise TypeError(f"profile: expected a Profile, a path or None, got {type(profile).__name__}")
    if not isinstance(method, str):
        raise TypeError(f"method: expected 'auto' or one of {method_names()}, got {type(method).__name__} {method!r}")
    if method != "auto" and method not in method_names():
        raise ValueError(f"method: expected 'auto' or one of {method_names()}, got {method!r}")
    boolean("learn", learn)
    if save is not None:
        path_argument("save_profile", save)
        if not learn:
            raise ValueError("save_profile: with learn=False nothing is learned to save; pass learn=True")
        writable_file_path("save_profile", save)  # now, not when the context closes: the run's learning is at stake


def _live_planner(model: Any, policy: Policy, profile: Profile | None, learn: bool) -> OnlinePlanner:
    """The Planner for this model and profile, learning with ``learn``; logs where there is none yet."""
    try:
        spec = model_spec(model)
    except ValueError as err:
        if policy == "auto" and (profile is not None or learn):
            raise ValueError(
                f"model: policy 'auto' needs the model's shape, and its config cannot be read: {err}"
            ) from None
        logger.warning("kvcopy offloading: no predictions (the model's config cannot be read: %s)", err)
        spec = None
    if profile is None and policy == "auto":
        logger.warning(
            "kvcopy offloading: no calibrated profile (run `kvcopy calibrate`), so policy 'auto' keeps every "
            "preempted request's KV while the host pool has room, as 'offload' does%s",
            ", until it has learned this engine's costs (learn=True)" if learn else "",
        )
    return OnlinePlanner(spec, profile, learn=learn)


@contextlib.contextmanager
def offloading(
    model: Any,
    host_gib: float = 1.0,
    policy: Policy = "auto",
    profile: Profile | str | os.PathLike[str] | None = None,
    method: str = "auto",
    learn: bool = True,
    save_profile: str | os.PathLike[str] | None = None,
) -> Iterator[OffloadStats]:
    """Makes kvcopy the offload path and judge of ``model``'s continuous batching while the context is open.

    ``host_gib``: size of the host pool (pinned when CUDA is available, plain
    memory otherwise), split between the cache's allocators. ``policy``:
    ``"auto"``, ``"offload"`` or ``"recompute"`` (module docstring).
    ``profile``: a :class:`~kvcopy.Profile`, a path to one, or None for the
    default profile (``kvcopy calibrate``'s). ``method``: the copy method
    (see :func:`kvcopy.copy_blocks`). ``learn``: learn the engine's own costs
    while it serves and decide from them (module docstring; False: decide from
    the calibration alone). ``save_profile``: write the learned profile there
    when the context closes (also on an exception). Yields the live
    :class:`OffloadStats`.

    Errors, all before anything is patched or allocated: TypeError / ValueError
    for bad arguments, each naming it (a ``host_gib`` above the machine's
    physical memory, and a ``save_profile`` that cannot be written: a
    directory, a path under a file, a read-only place, are ValueErrors here,
    not after the run); a profile path's error as :meth:`Profile.load
    <kvcopy.Profile.load>` raises it (FileNotFoundError for a missing file);
    ImportError (naming the extra) without transformers; RuntimeError for an
    unsupported transformers or a context already open (nested, or in
    another thread).
    """
    _check_arguments(model, host_gib, policy, profile, method, learn, save_profile)
    if isinstance(profile, (str, os.PathLike)):
        profile = Profile.load(profile)
    import_transformers()
    check_internals()
    live = _live_planner(model, policy, profile if profile is not None else default_profile(), learn)
    if not _ACTIVE.acquire(blocking=False):
        raise RuntimeError(
            "offloading: a kvcopy offloading context is already open in this process "
            "(contexts do not nest and are not shared between threads)"
        )
    try:
        from transformers.generation.continuous_batching import continuous_api

        from kvcopy.integrations.transformers.manager import KvcopyOffloadingManager

        session = OffloadSession(
            host_bytes=int(host_gib * 2**30), policy=policy, live=live, method=method, profile=profile
        )
        # Weak: a finished generate_batch's cache (and its device memory) must not outlive its run.
        managers: weakref.WeakSet[KvcopyOffloadingManager] = weakref.WeakSet()

        def make_manager(*args: Any, **kwargs: Any) -> KvcopyOffloadingManager:
            manager = KvcopyOffloadingManager(*args, session=session, **kwargs)
            managers.add(manager)
            return manager

        api: Any = continuous_api  # its OffloadingManager class gives way to a factory for the context
        original = api.OffloadingManager
        api.OffloadingManager = make_manager
        try:
            yield session.stats
        finally:
            api.OffloadingManager = original
            for manager in list(managers):
                manager.detach()
            session.close()
            if save_profile is not None:
                learned = session.stats.profile
                if learned is not None:
                    try:
                        learned.save(save_profile)
                    # checked at entry, so the file system changed since (Profile.save refuses a path that became a
                    # directory or lost its permission with a ValueError, before writing): say what is kept
                    except (OSError, ValueError) as err:
                        raise OSError(
                            f"save_profile: the learned profile could not be written to {save_profile} ({err}); "
                            f"it is still stats.profile (save it with stats.profile.save(path))"
                        ) from err
    finally:
        _ACTIVE.release()
