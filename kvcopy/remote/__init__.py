"""KV blocks between processes and nodes over NVIDIA's NIXL (``pip install 'kvcopy[nixl]'``).

A :class:`KVPeer` registers a HostKVPool with one NIXL agent; its :meth:`~KVPeer.descriptor` (bytes,
sent any way the caller likes) lets another peer :meth:`~KVPeer.connect` and then
:meth:`~KVPeer.read` or :meth:`~KVPeer.write` blocks, one NIXL transfer per call, with runs of
adjacent blocks coalesced into one descriptor. A transfer given up on stays quarantined until NIXL reports
it ended (:meth:`~KVPeer.quarantined`); after a failure, :meth:`~KVPeer.reconnect`. Importing kvcopy never
needs NIXL; making a KVPeer without it is an ImportError naming the extra.
"""

from __future__ import annotations

from kvcopy.nixl.transfer import NixlTransfer as RemoteTransfer
from kvcopy.nixl.transfer import RemoteTransferError, RemoteTransferTimeout
from kvcopy.remote.peer import KVPeer, RemotePool

__all__ = ["KVPeer", "RemotePool", "RemoteTransfer", "RemoteTransferError", "RemoteTransferTimeout"]
