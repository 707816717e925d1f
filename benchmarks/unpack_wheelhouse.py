"""Makes a wheelhouse's packages importable on a machine without network or pip: for every wheel in
WHEELHOUSE that this Python can use and whose distribution it lacks, unpack it into TARGET (put TARGET
on PYTHONPATH).

    python benchmarks/unpack_wheelhouse.py WHEELHOUSE TARGET

A wheel is a zip of what belongs in site-packages, plus an optional
``<name>.data/`` folder whose ``purelib``/``platlib`` parts belong there too;
unpacking is installing it, short of console scripts. Distributions already
installed are left alone, whatever their version, so the lent GPU machine's
own torch stack stays in charge, except those older than MIN_VERSIONS or not
older than BELOW_VERSIONS, which the unpacked wheel shadows (TARGET comes first
on PYTHONPATH). Wheels for another Python are skipped: a
``cpXY`` wheel is for CPython X.Y only, except a ``cpXY-abi3`` one (the stable ABI: safetensors, tokenizers),
which is for X.Y and every later CPython 3. Of several usable wheels of one distribution, the first by name is
taken (fetch_wheelhouse.sh downloads one of each). A wheel's scripts (``<name>.data/scripts``: ninja's
binary) go to TARGET/bin, executable (put it on PATH).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path

# Parts of a wheel's .data folder that are importable code, and the part that holds executables.
_LIB_SCHEMES = ("purelib", "platlib")
_SCRIPTS_SCHEME = "scripts"
# The folder under TARGET that a wheel's scripts go to.
BIN_DIR = "bin"
# The ABI tag of wheels built against CPython's stable ABI: usable by their cpXY and every later CPython 3.
_STABLE_ABI = "abi3"
# The oldest installed versions that will do: pyproject.toml's SPDX `license`
# string needs setuptools 77; kvcopy.integrations.transformers supports
# transformers 5.23 only (its compat.py), and the GPU machine's image has 5.17;
# transformers 5.23 itself checks the floors of its own requirements when imported.
MIN_VERSIONS = {
    "setuptools": (77,),
    "transformers": (5, 23),
    "huggingface_hub": (1, 31),
    "tokenizers": (0, 23, 1),
    "safetensors": (0, 8),
    "regex": (2025, 10, 22),
}
# Installed versions from these on will not do either (the end of transformers' supported range).
BELOW_VERSIONS = {"transformers": (5, 24)}


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric parts of a version: "77.0.3" -> (77, 0, 3), "2.1rc1" -> (2, 1)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def usable(wheel: Path, version: tuple[int, int] | None = None) -> bool:
    """Whether the wheel fits CPython ``version`` (default: this interpreter's): a ``py3``/``pyXY`` tag, a
    ``cpXY`` tag of that version, or ``cpXY`` with the ``abi3`` ABI tag and X.Y no later than that version.
    A name is ``dist-version[-build]-python-abi-platform.whl``, each tag possibly several joined by dots."""
    major, minor = version or sys.version_info[:2]
    python_tags = wheel.stem.split("-")[-3].split(".")
    abi_tags = wheel.stem.split("-")[-2].split(".")
    if any(tag in ("py3", f"py{major}{minor}", f"cp{major}{minor}") for tag in python_tags):
        return True
    if _STABLE_ABI not in abi_tags:
        return False
    # cp38-abi3 on CPython 3.12: built for 3.8's stable ABI, which every later 3.x keeps.
    for tag in python_tags:
        found = re.fullmatch(rf"cp{major}(\d+)", tag)
        if found and int(found.group(1)) <= minor:
            return True
    return False


def missing_wheels(wheelhouse: Path) -> list[Path]:
    """One usable wheel per distribution not installed here, or installed outside MIN_VERSIONS and
    BELOW_VERSIONS (a file name starts with its distribution)."""
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
        release = _release(installed)
        if release < MIN_VERSIONS.get(name, ()) or (name in BELOW_VERSIONS and release >= BELOW_VERSIONS[name]):
            chosen[name] = wheel
    return list(chosen.values())


def unpack(wheel: Path, target: Path) -> None:
    """Extracts ``wheel`` into ``target``, moving its .data/purelib and platlib contents to the top and its
    .data/scripts to ``target/bin``, executable (a zip does not keep the mode bits)."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
        data_dirs = {Path(n).parts[0] for n in archive.namelist() if Path(n).parts[0].endswith(".data")}
    for data in data_dirs:
        for scheme in _LIB_SCHEMES:
            lib = target / data / scheme
            if lib.is_dir():
                shutil.copytree(lib, target, dirs_exist_ok=True)
        scripts = target / data / _SCRIPTS_SCHEME
        if scripts.is_dir():
            bin_dir = target / BIN_DIR
            shutil.copytree(scripts, bin_dir, dirs_exist_ok=True)
            for script in scripts.rglob("*"):
                if script.is_file():
                    executable = bin_dir / script.relative_to(scripts)
                    os.chmod(executable, executable.stat().st_mode | 0o755)
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
