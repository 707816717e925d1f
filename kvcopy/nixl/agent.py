"""NIXL itself, imported only when an agent is made: importing kvcopy never needs it. Before it loads, UCX is
told to leave its InfiniBand modules out on a machine with no RDMA device (and only where the user has not
chosen UCX's modules): loaded there for nothing, wherever the system's RDMA providers are installed they pull
in a second libnl-route, and the process crashes at exit (docs/limits.md, "kvcopy.remote")."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

__all__ = ["RDMA_DEVICES", "UCX_MODULES_WITHOUT_RDMA", "nixl_module", "ucx_modules_chosen"]

logger = logging.getLogger("kvcopy.nixl")

# Where Linux lists every RDMA device libibverbs can open (InfiniBand, RoCE, iWARP): empty or missing, UCX's
# InfiniBand transports have nothing to carry bytes over.
RDMA_DEVICES = Path("/sys/class/infiniband")
# UCX's modules that reach RDMA through libibverbs: "ib" (with the mlx5 and efa modules it loads) and
# "rdmacm", the RDMA connection manager; "^" makes UCX_MODULES the list of modules UCX leaves out. Loaded,
# libibverbs opens the system's RDMA providers, which bring the system's libnl-route beside the copy NIXL's
# wheel bundles, and the process ends in SIGSEGV at exit (in rtnl_tc_unregister, run from _dl_fini).
UCX_MODULES_WITHOUT_RDMA = "^ib,rdmacm"


def ucx_modules_chosen(
    environ: MutableMapping[str, str] | None = None, rdma_devices: Path = RDMA_DEVICES
) -> str | None:
    """Sets ``UCX_MODULES`` to leave UCX's RDMA modules out where ``rdma_devices`` lists no device and the user
    has not set ``UCX_MODULES`` (``environ``: os.environ by default; UCX reads it when it starts, so this must
    run before NIXL makes its first UCX backend). Returns what it set, None where it left the environment as
    it was: a machine with RDMA keeps its InfiniBand transports, and a user's own choice is kept."""
    environ = os.environ if environ is None else environ
    if "UCX_MODULES" in environ:
        return None
    try:
        has_rdma = any(rdma_devices.iterdir())
    except OSError:  # missing (no RDMA driver loaded) or unreadable: no device UCX could open either
        has_rdma = False
    if has_rdma:
        return None
    environ["UCX_MODULES"] = UCX_MODULES_WITHOUT_RDMA
    logger.info(
        "kvcopy: no RDMA device in %s, so UCX_MODULES=%s: UCX's InfiniBand modules, with nothing to use here, "
        "can crash the process at exit (docs/limits.md); set UCX_MODULES yourself to choose otherwise",
        rdma_devices,
        UCX_MODULES_WITHOUT_RDMA,
    )
    return UCX_MODULES_WITHOUT_RDMA


def nixl_module() -> tuple[Any, Any]:
    """NIXL's agent and config classes (nixl_agent, nixl_agent_config), UCX's modules chosen first
    (``ucx_modules_chosen``); ImportError saying how to install NIXL without it."""
    ucx_modules_chosen()
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError as err:
        raise ImportError("kvcopy.remote and kvcopy.storage need NIXL: pip install 'kvcopy[nixl]' (nixl-cu13)") from err
    return nixl_agent, nixl_agent_config
