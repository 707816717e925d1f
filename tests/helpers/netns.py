"""A kvcopy peer process in each of two test hosts, for tests/remote/test_netns.py: the namespaces and their shaped
link are benchmarks/netns.py's (re-exported here for the tests); a peer is ``tests/helpers/netns_peer.py`` run in
one of them under UCX over TCP (:meth:`Link.argv`). The test talks to it over a socket pair handed down as a file
descriptor.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

# The one place the tests put benchmarks/ on sys.path: netns.py (the namespaces) lives there, beside
# bench_remote.py, its other user, and outside the installed package. Tests import it from this module.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from helpers import HANG_TIMEOUT_S
from netns import RATES_BIT_S, Link, NetnsUnavailable, netns_link

__all__ = ["RATES_BIT_S", "Link", "NetnsUnavailable", "NsPeer", "PeerError", "netns_link"]

# The peer runs as ``python -m helpers.netns_peer`` with tests/ on its path (as a script, its own folder would
# be first on the path, and helpers' modules would hide the packages they are named after).
_TESTS = Path(__file__).resolve().parents[1]


class PeerError(RuntimeError):
    """What a peer process raised: ``kind`` (its class name), ``side`` and ``block_ids`` where it had them."""

    def __init__(self, kind: str, message: str, side: str | None, block_ids: list[int] | None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.side, self.block_ids = kind, side, block_ids


class NsPeer:
    """A kvcopy peer process in namespace ``ns`` of ``link`` (side 0 or 1); :meth:`ask` runs one command there
    (tests/helpers/netns_peer.py lists them)."""

    def __init__(self, link: Link, side: int, name: str, *, extra_env: dict[str, str] | None = None) -> None:
        self.link, self.side, self.name = link, side, name
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "helpers.netns_peer", str(theirs.fileno()), name]
        argv = link.argv(side, command, extra_env, python_path=[str(_TESTS)])
        self.process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),))
        theirs.close()
        self.conn = Connection(ours.detach())

    def ask(self, *command: object, timeout: float = HANG_TIMEOUT_S) -> object:
        """Runs ``command`` in the peer; its answer, or PeerError with what it raised."""
        self.conn.send(command)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.name!r} did not answer {command[0]!r} within {timeout} s")
        status, value = self.conn.recv()
        if status == "error":
            raise PeerError(*value)
        return value

    def kill(self) -> None:
        """SIGKILL, and waits for it to be gone."""
        self.process.kill()
        self.process.wait(HANG_TIMEOUT_S)

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(EOFError, OSError, TimeoutError, PeerError):
                self.ask("exit", timeout=HANG_TIMEOUT_S)
            try:
                self.process.wait(HANG_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(HANG_TIMEOUT_S)
        self.conn.close()
