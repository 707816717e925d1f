"""Argument checks shared by every room, one per kind of mistake: TypeError for a wrong type, ValueError for
a wrong value, each naming the argument, what was expected and what was given. And the one error for a file
kvcopy reads that is not what it should be (:class:`FileFormatError`), with the reader of its fields."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Described",
    "FileFormatError",
    "boolean",
    "file_field",
    "nearest_existing",
    "non_negative_int",
    "non_negative_number",
    "path_argument",
    "positive_int",
    "positive_number",
    "sequence_argument",
    "timeout_argument",
]


class Described(str):
    """What was found, said in words ("a directory", "nothing: the field is missing") rather than a value read
    from the file: FileFormatError shows it as it is, not quoted."""


class FileFormatError(ValueError):
    """A file kvcopy reads (a profile, a disk store's header or log, a peer's descriptor) is not what kvcopy
    wrote: it names the file, the field, what was expected and what was found. Nothing was changed by the
    read that raised it."""

    def __init__(self, file: str | os.PathLike[str], field: str, expected: str, found: object) -> None:
        self.file, self.field, self.expected, self.found = os.fspath(file), field, expected, found
        shown = str(found) if isinstance(found, Described) else repr(found)
        if len(shown) > 80 and not isinstance(found, Described):
            shown = shown[:77] + "..."
        super().__init__(f"{self.file}: {field}: expected {expected}, found {shown}")


def file_field(
    doc: object, key: str, kind: type | tuple[type, ...], expected: str, *, file: str | os.PathLike[str], at: str = ""
) -> Any:
    """``doc[key]`` when ``doc`` is a mapping holding ``key`` as an instance of ``kind``; else a
    FileFormatError naming ``file`` and the field (``at`` + ``key``). bool never passes for a number."""
    where = f"{at}{key}"
    if not isinstance(doc, Mapping):
        raise FileFormatError(file, at.rstrip(".") or "(top level)", "an object", doc)
    if key not in doc:
        raise FileFormatError(file, where, expected, Described("nothing: the field is missing"))
    value = doc[key]
    numeric = kind in (int, float) or (isinstance(kind, tuple) and set(kind) <= {int, float})
    if not isinstance(value, kind) or (numeric and isinstance(value, bool)):
        raise FileFormatError(file, where, expected, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise FileFormatError(file, where, expected, value)
    return value


def _integral(name: str, value: object, expected: str) -> int:
    # bool is an int to Python, never a count to a caller; numpy's integers are counts
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    return int(value)


def positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1: TypeError unless it is an integer (not a bool), ValueError below 1."""
    number = _integral(name, value, "a positive int")
    if number < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return number


def non_negative_int(name: str, value: object) -> int:
    """``value`` as an int >= 0: TypeError unless it is an integer (not a bool), ValueError below 0."""
    number = _integral(name, value, "a non-negative int")
    if number < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return number


def _real(name: str, value: object, expected: str) -> float:
    # a real number, not a bool; huge ints become inf and are refused as values, never an OverflowError
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name}: expected {expected}, got {value!r:.80}")
    return number


def positive_number(name: str, value: object) -> float:
    """``value`` as a finite float > 0: TypeError unless it is a real number (not a bool), ValueError when it
    is not finite or not above 0."""
    number = _real(name, value, "a finite number > 0")
    if number <= 0:
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
    return number


def non_negative_number(name: str, value: object) -> float:
    """``value`` as a finite float >= 0: TypeError unless it is a real number (not a bool), ValueError when it
    is not finite or below 0."""
    number = _real(name, value, "a finite number >= 0")
    if number < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return number


def timeout_argument(name: str, value: object) -> float | None:
    """A wait's timeout: None (wait for ever) or seconds as a finite float >= 0."""
    return None if value is None else non_negative_number(name, value)


def boolean(name: str, value: object) -> bool:
    """``value`` when it is a bool (numpy's too): TypeError for anything else, "no" and 1 included."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def sequence_argument(name: str, value: object, of: str) -> Sequence[Any]:
    """``value`` as a sequence (a list, tuple, range ...): TypeError for a str or bytes (whose items are
    characters, never ``of``), a mapping, or anything that is not a sequence."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a sequence of {of}, got {type(value).__name__} {value!r:.80}")
    return value


def path_argument(name: str, value: object) -> Path:
    """``value`` as a Path: TypeError naming ``name`` unless it is a str or an os.PathLike of str."""
    if isinstance(value, str) or (isinstance(value, os.PathLike) and isinstance(os.fspath(value), str)):
        return Path(value)
    raise TypeError(f"{name}: expected a path (str or os.PathLike), got {type(value).__name__} {value!r:.80}")


def nearest_existing(path: Path) -> Path:
    """``path`` where it exists, else the nearest folder above it that does (the root at worst): where a path
    that cannot be made is stopped, a file standing where a directory must be."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable_file_path(name: str, value: object) -> Path:
    """``value`` as the Path of a file kvcopy will write later (its missing directories made then): TypeError
    unless it is a path; ValueError naming ``name`` when it is a directory, when a file stands where one of its
    directories must be, or when it cannot be written there (permissions, a read-only or virtual file system).
    Writability is tried, not guessed (root passes every permission test): a probe file is made and removed in
    the nearest directory that exists, or an existing file is opened for appending; nothing is left behind."""
    import tempfile  # only this check needs it

    path = path_argument(name, value)
    if path.is_dir():
        raise ValueError(f"{name}: {path} is a directory; expected the path of a file to write")
    if path.exists():
        try:  # O_NONBLOCK: a FIFO without a reader is an error, never a hang; a regular file is not changed
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NONBLOCK", 0)))
        except OSError as err:
            raise ValueError(f"{name}: cannot write {path} ({err.strerror})") from err
        return path
    ancestor = nearest_existing(path.parent)
    if not ancestor.is_dir():
        raise ValueError(f"{name}: {path} lies under {ancestor}, which is a file, not a directory")
    try:
        descriptor, probe = tempfile.mkstemp(dir=ancestor, prefix=".kvcopy-write-probe-")
    except OSError as err:
        raise ValueError(f"{name}: cannot write {path}: cannot create files in {ancestor} ({err.strerror})") from err
    os.close(descriptor)
    os.unlink(probe)
    return path
