"""KVCopyOffloadingConnector: vLLM's OffloadingConnector with kvcopy's spec, learning and failure handling.

(Filled in below.)
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

__all__ = ["KVCopyOffloadingConnector"]


class KVCopyOffloadingConnector(OffloadingConnector):
    pass
