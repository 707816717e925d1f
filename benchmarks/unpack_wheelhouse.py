"""Makes a wheelhouse's packages importable on a machine without network or pip: for every wheel in
WHEELHOUSE whose distribution this Python lacks, unpack it into TARGET (put TARGET on PYTHONPATH).

    python benchmarks/unpack_wheelhouse.py WHEELHOUSE TARGET

A wheel is a zip of what belongs in site-packages, so unpacking is installing
it, short of console scripts. Distributions already installed are left alone,
whatever their version: the lent GPU machine's own torch stack stays in charge.
"""

from __future__ import annotations

import importlib.metadata
import sys
import zipfile
from pathlib import Path


def missing_wheels(wheelhouse: Path) -> list[Path]:
    """The wheels of distributions not installed here (the file name starts with the distribution name)."""
    missing = []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        name = wheel.name.split("-")[0]
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(wheel)
    return missing


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wheelhouse, target = Path(argv[0]), Path(argv[1])
    if not wheelhouse.is_dir():
        print(f"unpack_wheelhouse: no wheelhouse at {wheelhouse}", file=sys.stderr)
        return 2
    target.mkdir(parents=True, exist_ok=True)
    for wheel in missing_wheels(wheelhouse):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
        print(f"unpacked {wheel.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
