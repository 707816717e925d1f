"""kvcopy's version, and how a renamed public name keeps its old spelling for one release.

A renamed name stays importable under its old spelling until :data:`DEPRECATED_UNTIL`; using it warns with a
:class:`DeprecationWarning` that names the new spelling. CHANGELOG.md lists every such rename.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

__all__ = ["DEPRECATED_UNTIL", "__version__", "deprecated_module", "warn_renamed"]

__version__ = "0.2.0"
# The release that drops the old spellings of names renamed in this one.
DEPRECATED_UNTIL = "0.3.0"


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """The DeprecationWarning for using ``old``, renamed ``new``."""
    warnings.warn(
        f"{old} is deprecated and will be removed in kvcopy {DEPRECATED_UNTIL}: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def deprecated_module(old: str, names: dict[str, str]) -> types.ModuleType:
    """A module ``old`` (registered in sys.modules) whose attributes are the moved ``names`` (name -> the
    module that now holds it); each access warns. For a package that was dissolved into others."""

    class _Moved(types.ModuleType):
        __all__: list[str]

        def __getattr__(self, name: str) -> Any:
            if name not in names:
                raise AttributeError(f"module {old!r} has no attribute {name!r}")
            warn_renamed(f"{old}.{name}", f"{names[name]}.{name}")
            return getattr(importlib.import_module(names[name]), name)

        def __dir__(self) -> list[str]:
            return sorted(names)

    module = _Moved(old, f"Deprecated: its names moved to {sorted(set(names.values()))}.")
    module.__all__ = sorted(names)
    sys.modules[old] = module
    return module
