"""kvcopy as vLLM's KV offloading: an ``OffloadingSpec`` whose copies run on kvcopy and whose loads its Planner judges.

Use it through vLLM's offloading connector (``pip install 'kvcopy[vllm]'``, see README)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KVCopyOffloadingSpec",
            "spec_module_path": "kvcopy.integrations.vllm", "cpu_bytes_to_use": 8000000000}}'

or through :class:`KVCopyOffloadingConnector` (``"kv_connector": "KVCopyOffloadingConnector",
"kv_connector_module_path": "kvcopy.integrations.vllm"``), which also feeds the engine's transfer times and
step timings to the Planner (``kvcopy_learn``). Importing this module never needs vLLM; building the spec
without it is an ImportError saying how to install it, and with a vLLM outside
:data:`~kvcopy.integrations.vllm._compat.SUPPORTED_RANGE` a RuntimeError.
"""

from __future__ import annotations

from kvcopy.integrations.vllm._compat import INSTALL, SUPPORTED_RANGE
from kvcopy.integrations.vllm._config import KEYS, POLICIES, ProfileNotFoundError

__all__ = [
    "INSTALL",
    "KEYS",
    "POLICIES",
    "SUPPORTED_RANGE",
    "KVCopyDiskTier",
    "KVCopyOffloadingConnector",
    "KVCopyOffloadingSpec",
    "ProfileNotFoundError",
]


def _stand_ins(error: Exception) -> tuple[type, type, type]:
    """The spec, connector and disk tier where vLLM cannot give them: building any raises ``error``."""

    class KVCopyOffloadingSpec:
        """Stands in for the spec: vLLM is missing or outside the tested range."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            raise error

    class KVCopyOffloadingConnector(KVCopyOffloadingSpec):
        """Stands in for the connector: vLLM is missing or outside the tested range."""

    class KVCopyDiskTier(KVCopyOffloadingSpec):
        """Stands in for the disk tier: vLLM is missing or outside the tested range."""

    return KVCopyOffloadingSpec, KVCopyOffloadingConnector, KVCopyDiskTier


try:
    import vllm  # noqa: F401 - only to know it is there
except ImportError:
    KVCopyOffloadingSpec, KVCopyOffloadingConnector, KVCopyDiskTier = _stand_ins(
        ImportError(f"kvcopy.integrations.vllm needs vLLM {SUPPORTED_RANGE}: {INSTALL}")
    )
else:
    try:  # the spec itself checks the version when it is built (a RuntimeError naming the range)
        from kvcopy.integrations.vllm.connector import KVCopyOffloadingConnector
        from kvcopy.integrations.vllm.spec import KVCopyOffloadingSpec
        from kvcopy.integrations.vllm.tiers.disk import KVCopyDiskTier
    except (ImportError, AttributeError) as err:  # a vLLM whose modules moved: another version
        KVCopyOffloadingSpec, KVCopyOffloadingConnector, KVCopyDiskTier = _stand_ins(
            RuntimeError(f"kvcopy.integrations.vllm was tested with vLLM {SUPPORTED_RANGE}; this one lacks {err}")
        )
