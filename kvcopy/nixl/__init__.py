"""The NIXL layer that kvcopy.remote (blocks between peers) and kvcopy.storage (blocks to and from files)
both stand on: importing NIXL (``agent.py``), what a cache registers with an agent (``registration.py``) and one
NIXL transfer in flight with the errors that name the blocks it leaves invalid (``transfer.py``). NIXL is
imported only when an agent is made (``pip install 'kvcopy[nixl]'``), UCX's InfiniBand modules left out first
on a machine with no RDMA device (``ucx_modules_chosen``)."""

from __future__ import annotations

from kvcopy.nixl.agent import nixl_module, ucx_modules_chosen
from kvcopy.nixl.registration import Registration, registration_of
from kvcopy.nixl.transfer import NixlTransfer, RemoteTransferError, RemoteTransferTimeout, WrittenBlocks

__all__ = [
    "NixlTransfer",
    "Registration",
    "RemoteTransferError",
    "RemoteTransferTimeout",
    "WrittenBlocks",
    "nixl_module",
    "registration_of",
    "ucx_modules_chosen",
]
