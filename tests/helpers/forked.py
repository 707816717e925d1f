"""Child processes that a test kills, forked from one warm server instead of started as new interpreters.

A kill test starts a child, reads what it prints, and SIGKILLs it at a chosen point, many times over. Started as
``python -c``, each child spends 3-9 s of the 2-core CI machine importing torch, kvcopy and vLLM before its
first step. Here multiprocessing's forkserver imports them once (PRELOAD), and each child is forked from it:
a process of its own, with its own files, NIXL agent and threads, that SIGKILL ends as it ends an engine.

The child runs a script's text as ``python -c`` would (``__name__ == "__main__"``, ``sys.argv[1:]`` its
arguments); what it prints to ``sys.stdout`` comes back line by line. Only Python's prints come back: what a
C library writes to file descriptor 1 goes to the server's output.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection

from helpers import HANG_TIMEOUT_S

__all__ = ["Child"]

# What the children import: each one's import is paid once, by the server. A module that is not installed is
# skipped by the server (it imports each inside `except ImportError`). None of these makes a NIXL agent or a
# CUDA context at import; torch's import starts one idle thread, which a fork leaves behind as it does for
# torch's own DataLoader workers.
PRELOAD = [
    "numpy",
    "torch",
    "kvcopy",
    "kvcopy.storage",
    "vllm.config",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.kv_offload.tiering.factory",
    "vllm.v1.kv_offload.tiering.manager",
    "vllm.distributed.kv_transfer.kv_connector.factory",
]


def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


class _Lines(io.TextIOBase):
    """sys.stdout of a child: each whole line goes to the test as one message (a pipe write under PIPE_BUF,
    so a SIGKILL never leaves half a line)."""

    def __init__(self, connection: Connection) -> None:
        self._connection, self._pending = connection, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._connection.send_bytes(line.encode())
        return len(text)


def _run(code: str, argv: Sequence[str], connection: Connection) -> None:
    sys.stdout = _Lines(connection)
    sys.argv = ["-c", *argv]
    exec(compile(code, "<child>", "exec"), {"__name__": "__main__"})


class Child:
    """``code`` running in a child forked from the warm server, with ``argv`` as its arguments."""

    def __init__(self, code: str, argv: Sequence[str] = ()) -> None:
        context = _context()
        self._reader, writer = context.Pipe(duplex=False)
        self.process = context.Process(target=_run, args=(code, list(argv), writer), daemon=True)
        self.process.start()
        writer.close()  # the child holds the only write end: its death ends lines()
        self.pid = self.process.pid
        self.returncode: int | None = None

    def lines(self) -> Iterator[str]:
        """What the child prints, a line at a time, until it exits or is killed."""
        while True:
            try:
                yield self._reader.recv_bytes().decode()
            except (EOFError, OSError):
                return

    def readline(self) -> str:
        """The next line, or "" once the child has ended."""
        return next(self.lines(), "")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def communicate(self) -> list[str]:
        """The lines not read yet, once the child has ended; its exit status is then ``returncode``
        (``-signal.SIGKILL`` when killed)."""
        rest = list(self.lines())
        self.process.join(HANG_TIMEOUT_S)
        self.returncode = self.process.exitcode
        return rest

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.exitcode is None:
            self.kill()
            self.process.join(HANG_TIMEOUT_S)
        self._reader.close()
