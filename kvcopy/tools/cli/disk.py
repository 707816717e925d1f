"""`kvcopy calibrate --disk PATH`: the disk's writes and reads (kvcopy.calibration.disk), checked before any work."""

from __future__ import annotations

import os

from kvcopy.tools.cli.args import CliError
from kvcopy.tools.cli.remote import need_nixl

__all__ = ["add_disk_link", "check_disk_arg", "print_disk_link"]


def check_disk_arg(value: str | None) -> None:
    """Before any work: --disk names a directory (or one that can be made), and NIXL is importable."""
    if value is None:
        return
    if os.path.exists(value) and not os.path.isdir(value):
        raise CliError(f"--disk: {value} is not a directory (give a folder on the disk to measure)")
    need_nixl("--disk")


def add_disk_link(profile: object, directory: str, *, quick: bool, progress: bool) -> None:
    from kvcopy.calibration.disk import add_disk_link as measure

    try:
        measure(profile, directory, quick=quick, progress=progress)  # type: ignore[arg-type]
    except OSError as err:  # no room, no permission
        raise CliError(f"--disk: the disk under {directory} could not be measured: {err}") from None


def print_disk_link(profile: object) -> None:
    """The disk's writes and reads per range size (what a disk reload would use), below calibrate's table."""
    from kvcopy.calibration.disk import DISK_METHOD, DISK_READ, DISK_WRITE

    where = profile.hardware.get("disk")  # type: ignore[attr-defined]
    if where is None:
        return
    print(f"disk: {where}")
    for direction, what in ((DISK_WRITE, "write"), (DISK_READ, "read")):
        link = profile.links.get(direction, {}).get(DISK_METHOD)  # type: ignore[attr-defined]
        for size, fit in sorted(link.by_block_nbytes.items()) if link else ():
            print(
                f"  {what} ({direction}) {size // 1024:>6} KiB ranges: {fit.alpha_s * 1e6:8.1f} us + bytes at "
                f"{fit.beta_bytes_per_s / 1e9:6.2f} GB/s (R^2 {fit.r2:.3f}, max resid {fit.max_abs_residual:.0%})"
            )
