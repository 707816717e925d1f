"""Makes a wheelhouse's packages importable on a machine without network or pip: for every wheel in
WHEELHOUSE that this Python can use and whose distribution it lacks, unpack it into TARGET (put TARGET
on PYTHONPATH).

    python benchmarks/unpack_wheelhouse.py WHEELHOUSE TARGET

A wheel is a zip of what belongs in site-packages, plus an optional
``<name>.data/`` folder whose ``purelib``/``platlib`` parts belong there too;
unpacking is installing it, short of console scripts. Distributions already
installed are left alone, whatever their version, so the lent GPU machine's
own torch stack stays in charge, except those older than MIN_VERSIONS, which
the unpacked wheel shadows (TARGET comes first on PYTHONPATH). Wheels for another Python (by their ``cpXY``
tag) are skipped; of several usable wheels of one distribution, the first by
name is taken (fetch_wheelhouse.sh downloads one of each).
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import sys
import zipfile
from pathlib import Path

# Parts of a wheel's .data folder that are importable code.
_LIB_SCHEMES = ("purelib", "platlib")
# The oldest installed versions that will do: pyproject.toml's SPDX `license`
# string needs setuptools 77.
MIN_VERSIONS = {"setuptools": (77,)}


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric parts of a version: "77.0.3" -> (77, 0, 3), "2.1rc1" -> (2, 1)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def usable(wheel: Path) -> bool:
    """Whether the wheel's Python tag fits this interpreter: ``py3``, or ``cpXY`` of this version."""
    python_tags = wheel.stem.split("-")[-3].split(".")
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return any(tag in ("py3", f"py{sys.version_info.major}{sys.version_info.minor}", here) for tag in python_tags)


def missing_wheels(wheelhouse: Path) -> list[Path]:
    """One usable wheel per distribution not installed here, or installed older than MIN_VERSIONS
    (a file name starts with its distribution)."""
    chosen: dict[str, Path] = {}
    for wheel in sorted(wheelhouse.glob("*.whl")):
        name = wheel.name.split("-")[0].lower()
        if name in chosen or not usable(wheel):
            continue
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            chosen[name] = wheel
            continue
        if _release(installed) < MIN_VERSIONS.get(name, ()):
            chosen[name] = wheel
    return list(chosen.values())


def unpack(wheel: Path, target: Path) -> None:
    """Extracts ``wheel`` into ``target``, moving its .data/purelib and platlib contents to the top."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
        data_dirs = {Path(n).parts[0] for n in archive.namelist() if Path(n).parts[0].endswith(".data")}
    for data in data_dirs:
        for scheme in _LIB_SCHEMES:
            lib = target / data / scheme
            if lib.is_dir():
                shutil.copytree(lib, target, dirs_exist_ok=True)
        shutil.rmtree(target / data)


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
        unpack(wheel, target)
        print(f"unpacked {wheel.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
