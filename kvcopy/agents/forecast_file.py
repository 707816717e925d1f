"""The gap forecaster's file: its format, written atomically, and read back with every field checked.

A JSON object (format "kvcopy-gap-forecaster", version 1)::

    {"format": "kvcopy-gap-forecaster", "version": 1,
     "roots": {"tool": LEVEL, "untooled": LEVEL},
     "tools": [{"tool": "run_tests", ...LEVEL}, ...],
     "sessions": [{"session": "s-17", "tool": "run_tests" or null, ...LEVEL}, ...]}

where LEVEL is ``"log_gaps": [...], "log_ratios": [...]``: a level's remembered ln(gap seconds) and
ln(gap) - ln(resume_in_s), oldest first. Tools and sessions are listed least recently used first. Logs are
kept as they are, not as seconds, so that a forecaster loaded back answers exactly as the one saved.

A file that is not this is a :class:`~kvcopy.FileFormatError` naming the file and the field
(``sessions[3].log_gaps[7]``), what was expected and what was found.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kvcopy._checks import Described, FileFormatError
from kvcopy.agents.history import LOG_GAP_RANGE, LOG_RATIO_RANGE, MAX_SESSION_LEVELS, MAX_TOOLS, SESSION_WINDOW, WINDOW

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ROOT_NAMES",
    "ForecasterDocument",
    "LevelValues",
    "read_document",
    "read_file",
    "write_file",
]

FORMAT_NAME = "kvcopy-gap-forecaster"
FORMAT_VERSION = 1
# The two roots: pauses with a tool named, and pauses with none (kvcopy/agents/priors.py says why two).
ROOT_NAMES = ("tool", "untooled")
_TOP_FIELDS = ("format", "version", "roots", "tools", "sessions")
_LEVEL_FIELDS = ("log_gaps", "log_ratios")


@dataclass(frozen=True)
class LevelValues:
    """One level's remembered values, oldest first: ln(gap seconds), and ln(gap) - ln(resume_in_s)."""

    log_gaps: list[float]
    log_ratios: list[float]


@dataclass(frozen=True)
class ForecasterDocument:
    """A forecaster's file, read: its ``roots`` by name, ``tools`` as (tool, values) and ``sessions`` as
    (session, tool or None, values), both least recently used first."""

    roots: dict[str, LevelValues]
    tools: list[tuple[str, LevelValues]]
    sessions: list[tuple[str, str | None, LevelValues]]


class _Reader:
    """Checks a forecaster's document field by field: the first that is not what to_dict writes is a
    FileFormatError naming ``file`` and the field's path."""

    def __init__(self, file: str | os.PathLike[str]) -> None:
        self.file = file

    def fail(self, at: str, expected: str, found: object) -> NoReturn:
        raise FileFormatError(self.file, at or "(top level)", expected, found)

    def fields(self, value: object, at: str, allowed: Sequence[str]) -> Mapping[str, Any]:
        """``value`` as an object with exactly the fields ``allowed``."""
        if not isinstance(value, Mapping):
            self.fail(at, "an object", value)
        for name in value:
            if name not in allowed:
                self.fail(_join(at, str(name)), f"only the fields {', '.join(allowed)}", Described("an unknown field"))
        for name in allowed:
            if name not in value:
                self.fail(_join(at, name), "a value", Described("nothing: the field is missing"))
        return value

    def sequence(self, value: object, at: str, expected: str, limit: int) -> Sequence[Any]:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            self.fail(at, expected, value)
        if len(value) > limit:
            self.fail(at, f"{expected}, at most {limit}", Described(f"{len(value)} of them"))
        return value

    def name(self, value: object, at: str, *, optional: bool = False) -> str | None:
        if optional and value is None:
            return None
        if not isinstance(value, str) or not value:
            self.fail(at, "a non-empty string" + (" or null" if optional else ""), value)
        return value

    def values(self, value: object, at: str, bounds: tuple[float, float], limit: int, what: str) -> list[float]:
        lo, hi = bounds
        expected = f"a list of at most {limit} {what}"
        found = []
        for i, x in enumerate(self.sequence(value, at, expected, limit)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (lo <= float(x) <= hi):
                self.fail(f"{at}[{i}]", f"a number in [{lo:.6g}, {hi:.6g}] ({what})", x)
            found.append(float(x))
        return found

    def level(self, value: object, at: str, limit: int, extra: Sequence[str] = ()) -> LevelValues:
        doc = self.fields(value, at, (*extra, *_LEVEL_FIELDS))
        return LevelValues(
            self.values(doc["log_gaps"], _join(at, "log_gaps"), LOG_GAP_RANGE, limit, "ln(gap seconds)"),
            self.values(doc["log_ratios"], _join(at, "log_ratios"), LOG_RATIO_RANGE, limit, "ln(gap / estimate)"),
        )

    def document(self, data: object) -> ForecasterDocument:
        if not isinstance(data, Mapping):
            self.fail("", f"a {FORMAT_NAME} document (a JSON object)", data)
        if data.get("format") != FORMAT_NAME:
            self.fail("format", repr(FORMAT_NAME), data.get("format", Described("nothing: the field is missing")))
        version = data.get("version")
        if isinstance(version, bool) or version != FORMAT_VERSION:
            found = Described("nothing: the field is missing") if "version" not in data else version
            self.fail("version", f"{FORMAT_VERSION} (the version this kvcopy reads)", found)
        doc = self.fields(data, "", _TOP_FIELDS)
        roots_doc = self.fields(doc["roots"], "roots", ROOT_NAMES)
        roots = {name: self.level(roots_doc[name], _join("roots", name), WINDOW) for name in ROOT_NAMES}
        tools: list[tuple[str, LevelValues]] = []
        seen_tools: set[str] = set()
        for i, entry in enumerate(self.sequence(doc["tools"], "tools", "a list of tool levels", MAX_TOOLS)):
            at = f"tools[{i}]"
            values = self.level(entry, at, WINDOW, extra=("tool",))
            tool = self.name(entry["tool"], _join(at, "tool"))
            assert tool is not None
            if tool in seen_tools:
                self.fail(_join(at, "tool"), "a tool listed once", tool)
            seen_tools.add(tool)
            tools.append((tool, values))
        sessions: list[tuple[str, str | None, LevelValues]] = []
        seen_sessions: set[tuple[str, str | None]] = set()
        listed = self.sequence(doc["sessions"], "sessions", "a list of session levels", MAX_SESSION_LEVELS)
        for i, entry in enumerate(listed):
            at = f"sessions[{i}]"
            values = self.level(entry, at, SESSION_WINDOW, extra=("session", "tool"))
            session = self.name(entry["session"], _join(at, "session"))
            assert session is not None
            tool_name = self.name(entry["tool"], _join(at, "tool"), optional=True)
            if (session, tool_name) in seen_sessions:
                self.fail(at, "a (session, tool) pair listed once", Described(f"{session!r} under {tool_name!r} again"))
            seen_sessions.add((session, tool_name))
            sessions.append((session, tool_name, values))
        return ForecasterDocument(roots, tools, sessions)


def _join(at: str, name: str) -> str:
    return f"{at}.{name}" if at else name


def read_document(data: object, *, file: str | os.PathLike[str]) -> ForecasterDocument:
    """``data`` (a forecaster's to_dict, or its JSON read back) checked field by field: FileFormatError (a
    ValueError) naming ``file`` and the first field that is not what to_dict writes: a missing or unknown
    field, another format or version, a wrong type, a value out of its range, more values than a window
    keeps, more levels than the forecaster keeps, or a level listed twice."""
    return _Reader(file).document(data)


def read_file(path: Path) -> object:
    """The JSON document at ``path``. FileNotFoundError when there is none; OSError naming the file when it
    cannot be read; FileFormatError when it is a directory or not JSON."""
    expected = f"a {FORMAT_NAME} file (JSON)"
    if path.is_dir():
        raise FileFormatError(path, "(the file)", expected, Described("a directory"))
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"gap forecaster: no file at {path}") from None
    except OSError as err:
        raise type(err)(err.errno, f"gap forecaster: cannot read {path}: {err.strerror}") from None
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise FileFormatError(
            path, "(the file)", expected, Described(f"{err.msg} at line {err.lineno} column {err.colno}")
        ) from None
    except (ValueError, RecursionError) as err:  # not UTF-8; NaN or Infinity; an int of too many digits
        raise FileFormatError(path, "(the file)", expected, Described(f"{type(err).__name__}: {err}")) from None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def write_file(path: Path, data: Mapping[str, Any]) -> None:
    """Writes ``data`` as JSON at ``path`` (its folders made) atomically: to a temporary file beside it, then
    renamed over it, so that a crash never leaves a torn file where a forecaster was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as out:
            json.dump(data, out, allow_nan=False)
            out.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
