"""A tqdm progress bar when asked for and installed; otherwise a silent stand-in."""

from __future__ import annotations

from typing import Protocol

__all__ = ["ProgressBar", "progress_bar"]


class ProgressBar(Protocol):
    """What :func:`progress_bar` returns: tqdm's bar or the silent stand-in."""

    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, desc: str, unit: str) -> ProgressBar:
    """An object with ``update(n=1)`` and ``close()``: tqdm's bar, or a no-op where tqdm is missing or not wanted
    (a checkout run without its dependencies installed, as benchmarks/device_check.sh runs one)."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc=desc, unit=unit, leave=False)
        except ImportError:
            pass
    return _Silent()
