"""Which transformers kvcopy's continuous-batching adapter runs on, checked before anything is patched.

The adapter replaces transformers' ``OffloadingManager`` and relies on the
internals listed in :data:`REQUIRED_INTERNALS`. An installed transformers
outside :data:`SUPPORTED_RANGE`, or one whose internals moved, is refused with
a RuntimeError at ``offloading(...)``, never a failure in the middle of
generation.
"""

from __future__ import annotations

import importlib
import inspect
import re
from types import ModuleType
from typing import Any

__all__ = ["EXTRA", "SUPPORTED_RANGE", "check_internals", "import_transformers"]

# The versions the adapter was written against and tested with (pyproject's
# "transformers" extra pins the same range): continuous batching's internals
# change between minor releases.
SUPPORTED_MIN = "5.23.0"
SUPPORTED_BELOW = "5.24"
SUPPORTED_RANGE = f">={SUPPORTED_MIN},<{SUPPORTED_BELOW}"
EXTRA = "pip install 'kvcopy[transformers]'"

_CB = "transformers.generation.continuous_batching"
# (module, attribute path) pairs the adapter reads or overrides.
REQUIRED_INTERNALS: tuple[tuple[str, str], ...] = (
    (f"{_CB}.continuous_api", "OffloadingManager"),
    (f"{_CB}.offloading_manager", "OffloadingManager.offload_requests"),
    (f"{_CB}.offloading_manager", "OffloadingManager._offload_to_cpu"),
    (f"{_CB}.offloading_manager", "OffloadingManager.restore_scheduled_requests"),
    (f"{_CB}.offloading_manager", "OffloadingManager.free_request_cpu_cache"),
    (f"{_CB}.offloading_manager", "OffloadingManager.free_all_waiting_cpu_caches"),
    (f"{_CB}.offloading_manager", "OffloadingManager.reset"),
    (f"{_CB}.cache", "PagedAttentionCache.free_blocks"),
    (f"{_CB}.cache", "PagedAttentionCache.perform_cache_copy"),
    (f"{_CB}.requests", "RequestState.create_equivalent_initial_request"),
    (f"{_CB}.requests", "RequestStatus.DECODING"),
    (f"{_CB}.requests", "FutureRequestState"),
    (f"{_CB}.utils", "stream_context"),
)
# The OffloadingManager constructor transformers calls (continuous_api.ContinuousBatchProcessor).
MANAGER_INIT_PARAMETERS = (
    "self",
    "cache",
    "scheduler",
    "cpu_offload_space_gib",
    "safety_threshold",
    "compute_stream",
    "distributed_helper",
)
# Per-request and per-allocator fields read from instances: class annotations, or attributes the class's
# own code assigns (``self.block_table: ... =``).
REQUEST_FIELDS = (
    "request_id",
    "initial_tokens",
    "generated_tokens",
    "position_offset",
    "is_cpu_offloaded",
    "remaining_prefill_tokens",
)
ALLOCATOR_FIELDS = ("_copy_view", "block_table", "bytes_per_block", "index")


def _version_tuple(text: str) -> tuple[int, ...]:
    from packaging.version import Version  # a dependency of transformers itself

    return Version(text).release


def import_transformers() -> ModuleType:
    """transformers, if installed and in the supported range; ImportError naming the extra, else RuntimeError."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as err:
        raise ImportError(
            f"kvcopy.integrations.transformers needs transformers {SUPPORTED_RANGE}: {EXTRA} ({err})"
        ) from None
    version = transformers.__version__
    if not _version_tuple(SUPPORTED_MIN) <= _version_tuple(version) < _version_tuple(SUPPORTED_BELOW):
        raise RuntimeError(
            f"kvcopy.integrations.transformers supports transformers {SUPPORTED_RANGE}; "
            f"{version} is installed ({EXTRA})"
        )
    return transformers


def _resolve(module_name: str, path: str) -> Any:
    """The object at ``path`` in ``module_name`` (transformers' internals: whatever they are)."""
    obj: Any = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_internals() -> None:
    """RuntimeError naming the first continuous-batching internal the adapter needs that is missing or changed."""
    for module_name, path in REQUIRED_INTERNALS:
        try:
            _resolve(module_name, path)
        except (ImportError, AttributeError) as err:
            raise RuntimeError(
                f"transformers' continuous batching has no {module_name}.{path} ({err}); "
                f"kvcopy.integrations.transformers supports transformers {SUPPORTED_RANGE}"
            ) from None
    manager = _resolve(f"{_CB}.offloading_manager", "OffloadingManager")
    parameters = tuple(inspect.signature(manager.__init__).parameters)
    if parameters != MANAGER_INIT_PARAMETERS:
        raise RuntimeError(
            f"transformers' OffloadingManager takes {parameters}, expected {MANAGER_INIT_PARAMETERS}; "
            f"kvcopy.integrations.transformers supports transformers {SUPPORTED_RANGE}"
        )
    for (module_name, cls_name), fields in (
        ((f"{_CB}.requests", "RequestState"), REQUEST_FIELDS),
        ((f"{_CB}.cache_allocators", "CacheAllocator"), ALLOCATOR_FIELDS),
    ):
        cls = _resolve(module_name, cls_name)
        annotations: dict[str, object] = {}
        for klass in reversed(inspect.getmro(cls)):
            annotations.update(getattr(klass, "__annotations__", {}))
        source = inspect.getsource(cls)
        missing = [
            name
            for name in fields
            if name not in annotations and not hasattr(cls, name) and not re.search(rf"self\.{name}\s*[:=]", source)
        ]
        if missing:
            raise RuntimeError(
                f"transformers' {cls_name} has no {missing[0]!r}; kvcopy.integrations.transformers "
                f"supports transformers {SUPPORTED_RANGE}"
            )
