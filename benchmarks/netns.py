"""Two test hosts on one machine: network namespaces joined by a veth pair whose both ends are shaped with
tbf, so that kvcopy.remote runs over a real network stack at a known rate (tests/remote/test_netns.py and
``benchmarks/bench_remote.py --netns``). Test and benchmark infrastructure, not part of the installed package:
the benchmark scripts import it as ``netns`` (their folder is on sys.path), the tests through
tests/helpers/netns.py.

Only the namespaces, veth pair and addresses made here are used (10.231.0.1/30 and .2 inside them), and they
are deleted on every exit path (deleting a namespace deletes its veth end and qdisc). A process is run in a
namespace with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` naming its veth (:meth:`Link.argv`): by default UCX
sees one node and uses cross-memory attach, and nothing would cross the link. Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["ADDRESSES", "RATES_BIT_S", "Link", "NetnsUnavailable", "netns_link"]

# The link's shaping: tbf (netem is not in every kernel). The burst is a few 1500-byte packets at 1 Gbit/s;
# the queue holds 10 ms of them.
TBF_BURST, TBF_LATENCY = "64kb", "10ms"
RATES_BIT_S = {"1gbit": 1e9, "250mbit": 250e6}
ADDRESSES = ("10.231.0.1", "10.231.0.2")
# Seconds for a namespace command (about 0.01 s idle): only a hang reaches it.
_IP_TIMEOUT_S = 60.0
# Seconds a namespace's deletion is retried: a process killed inside it may take a moment to leave.
_DELETE_RETRY_S = 10.0


class NetnsUnavailable(RuntimeError):
    """This sandbox cannot make the namespaces (not root, no iproute2, or namespaces forbidden)."""


def _run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=True).stdout


class Link:
    """The two namespaces (``ns[0]``, ``ns[1]``) and their veth ends (``dev[0]``, ``dev[1]``)."""

    def __init__(self, tag: str) -> None:
        self.ns = (f"kvcopy-{tag}-a", f"kvcopy-{tag}-b")
        self.dev = (f"kvc{tag}a", f"kvc{tag}b")  # interface names: at most 15 characters

    def make(self) -> None:
        for ns in self.ns:
            _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", self.dev[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.dev[1],
             "netns", self.ns[1])  # fmt: skip
        for ns, dev, address in zip(self.ns, self.dev, ADDRESSES, strict=True):
            _run("ip", "-n", ns, "addr", "add", f"{address}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", "dev", dev, "up")
            _run("ip", "-n", ns, "link", "set", "dev", "lo", "up")

    def shape(self, rate: str) -> None:
        """Both directions shaped to ``rate`` (a key of RATES_BIT_S)."""
        if rate not in RATES_BIT_S:
            raise ValueError(f"rate: expected one of {sorted(RATES_BIT_S)}, got {rate!r}")
        for ns, dev in zip(self.ns, self.dev, strict=True):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", TBF_BURST,
                 "latency", TBF_LATENCY)  # fmt: skip

    def set_up(self, up: bool) -> None:
        """Brings the link down (both ends) or back up."""
        for ns, dev in zip(self.ns, self.dev, strict=True):
            _run("ip", "-n", ns, "link", "set", "dev", dev, "up" if up else "down")

    def rx_bytes(self, side: int) -> int:
        """Bytes received on ``side``'s veth end since it was made."""
        stats = json.loads(_run("ip", "-n", self.ns[side], "-s", "-j", "link", "show", "dev", self.dev[side]))
        return int(stats[0]["stats64"]["rx"]["bytes"])

    def argv(
        self,
        side: int,
        command: list[str],
        extra_env: dict[str, str] | None = None,
        *,
        python_path: Sequence[str] = (),
    ) -> list[str]:
        """``command`` run in ``side``'s namespace, with UCX told to use TCP over that side's veth end, and
        Python finding ``python_path`` and then this interpreter's own path."""
        env = {
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": self.dev[side],
            "NIXL_LOG_LEVEL": "WARN",
            "PYTHONPATH": os.pathsep.join([*python_path, *sys.path]),
            **(extra_env or {}),
        }
        return ["ip", "netns", "exec", self.ns[side], "env", *(f"{k}={v}" for k, v in env.items()), *command]

    def delete(self) -> None:
        """Deletes both namespaces (and so the veth pair), retrying while a process leaving one holds it; a
        namespace that still will not go is said on stderr, never silently left behind."""
        for ns in self.ns:
            deadline = time.monotonic() + _DELETE_RETRY_S
            while True:
                done = subprocess.run(("ip", "netns", "del", ns), capture_output=True, text=True,
                                      timeout=_IP_TIMEOUT_S, check=False)  # fmt: skip
                gone = done.returncode == 0 or ns not in _run("ip", "netns", "list")
                if gone or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            if not gone:
                print(f"netns: could not delete namespace {ns}: {done.stderr.strip()}", file=sys.stderr)


@contextmanager
def netns_link(rate: str = "1gbit") -> Iterator[Link]:
    """A shaped link between two new namespaces; NetnsUnavailable when this sandbox cannot make one."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetnsUnavailable("iproute2 (ip, tc) is not installed")
    link = Link(f"{os.getpid() % 100000}")
    try:
        try:
            link.make()
            link.shape(rate)
        except subprocess.CalledProcessError as err:
            raise NetnsUnavailable(f"`{' '.join(err.cmd)}` failed: {err.stderr.strip()}") from None
        yield link
    finally:
        link.delete()
