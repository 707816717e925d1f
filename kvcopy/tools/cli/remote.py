"""The command line's remote side: ``kvcopy peer`` (serve a calibration pool for another node's ``kvcopy
calibrate --remote DESCRIPTOR``) and what ``calibrate --remote`` checks before it measures and prints after."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from kvcopy.tools.cli.args import CliError, check_folder

__all__ = ["LOOPBACK_ARG", "add_remote_link", "peer", "print_remote_link", "remote_descriptor"]

# What --remote holds when given without a descriptor: measure the loopback path to a peer process here.
LOOPBACK_ARG = ""
# NIXL logs every agent's start at INFO on standard output; the command line keeps its output to its own lines.
_NIXL_LOG_LEVEL = "WARN"


def need_nixl(option: str) -> None:
    """CliError for ``option`` unless NIXL imports (its log level set to the CLI's first)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", _NIXL_LOG_LEVEL)
    try:
        import nixl_cu13  # noqa: F401
    except ImportError:
        raise CliError(f"{option}: needs NIXL: pip install 'kvcopy[nixl]'") from None


def remote_descriptor(value: str | None) -> bytes | None:
    """Before any work: --remote's descriptor file read (None for the loopback path), and NIXL importable."""
    if value is None:
        return None
    need_nixl("--remote")
    if value == LOOPBACK_ARG:
        return None
    from kvcopy.calibration.network import check_calibration_descriptor

    try:
        data = Path(value).read_bytes()
    except OSError as err:
        raise CliError(f"--remote: cannot read the peer's descriptor {value}: {err.strerror}") from None
    try:
        check_calibration_descriptor(data)
    except (TypeError, ValueError) as err:
        raise CliError(f"--remote: {value}: {err}") from None
    return data


def add_remote_link(profile: object, descriptor: bytes | None, *, quick: bool, progress: bool) -> None:
    from kvcopy.calibration.network import add_remote_link as measure

    try:
        measure(profile, descriptor, quick=quick, progress=progress)  # type: ignore[arg-type]
    except ValueError as err:  # a descriptor that is not one, or of another calibration pool
        raise CliError(f"--remote: {err}") from None
    except (RuntimeError, TimeoutError) as err:  # the peer vanished, or never started (a loopback peer)
        raise CliError(f"--remote: the link could not be measured: {err}") from None


def print_remote_link(profile: object) -> None:
    """The link to the peer, per range size (what the planner's fetch uses), below calibrate's table."""
    from kvcopy.calibration.network import REMOTE_METHOD
    from kvcopy.profile import REMOTE_DIRECTION

    link = profile.links.get(REMOTE_DIRECTION, {}).get(REMOTE_METHOD)  # type: ignore[attr-defined]
    if link is None:
        return
    print(f"remote link ({REMOTE_DIRECTION}): {profile.hardware.get('remote_link')}")  # type: ignore[attr-defined]
    print(f"  carried by {profile.hardware.get('remote_transport', 'not recorded')}")  # type: ignore[attr-defined]
    for size, fit in sorted(link.by_block_nbytes.items()):
        print(
            f"  {size // 1024:>6} KiB ranges: {fit.alpha_s * 1e6:7.1f} us + bytes at {fit.beta_bytes_per_s / 1e9:6.2f} "
            f"GB/s (R^2 {fit.r2:.3f}, max resid {fit.max_abs_residual:.0%})"
        )


def peer(args: argparse.Namespace) -> int:
    """Serves a calibration pool: writes its descriptor to --descriptor, then waits (Ctrl-C, or --seconds)."""
    check_folder("--descriptor", args.descriptor, make=True)
    need_nixl("kvcopy peer")
    from kvcopy.calibration.network import serve_calibration_peer

    name = args.name or f"kvcopy-peer-{os.uname().nodename}-{os.getpid()}"
    with serve_calibration_peer(name) as served:
        Path(args.descriptor).write_bytes(served.descriptor())
        print(f"peer {name!r} serving {served.pool.nbytes >> 20} MiB; its descriptor is in {args.descriptor}")
        print("copy that file to the other node and run there: kvcopy calibrate --remote <the file>")
        until = None if args.seconds is None else time.monotonic() + args.seconds
        try:
            while until is None or time.monotonic() < until:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    print("peer closed")
    return 0
