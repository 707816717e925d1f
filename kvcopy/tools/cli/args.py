"""The command line's argument types and checks: each bad value is a CliError naming the option,
raised before any work starts."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = [
    "CliError",
    "Parser",
    "check_folder",
    "check_plot",
    "device_arg",
    "fraction",
    "int_list",
    "load_model",
    "load_profile",
    "non_negative_int",
    "positive_int",
]


class CliError(Exception):
    """A user error: printed without a traceback, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvcopy <command>: argument --x: ...``, exit status 2 (see --help)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def load_model(name_or_path: str):  # noqa: ANN202 - a ModelSpec
    from kvcopy.model.spec import ModelSpec

    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists() or "/" in name_or_path:
        if not path.exists():
            raise CliError(f"--model: no such file: {name_or_path}")
        try:
            return ModelSpec.from_hf_config(path)
        except (ValueError, FileNotFoundError) as err:
            raise CliError(f"--model: {err}") from None
    try:
        return ModelSpec.preset(name_or_path)
    except ValueError as err:
        raise CliError(f"--model: {err}") from None


def load_profile(path: str | None):  # noqa: ANN202 - a Profile
    from kvcopy.profile import DEFAULT_PROFILE_PATH, Profile

    where = Path(path) if path else DEFAULT_PROFILE_PATH
    if not where.exists():
        raise CliError(f"--profile: no profile at {where}; run `kvcopy calibrate` first (or pass --profile)")
    try:
        return Profile.load(where)
    except (ValueError, KeyError, TypeError) as err:
        raise CliError(f"--profile: cannot read {where}: {err}") from None


def check_plot(path: str | None) -> None:
    """Before any work: --plot needs matplotlib and a folder to write into."""
    if path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError("--plot: needs matplotlib (pip install 'kvcopy[plot]')") from None
        check_folder("--plot", path)


def check_folder(option: str, path: str, *, make: bool = False) -> None:
    """Before any work: the folder an output goes into exists (with ``make``, made; an error if it cannot be)."""
    folder = Path(path).resolve().parent
    if make:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CliError(f"{option}: cannot make the folder {folder}: {err.strerror}") from None
    if not folder.is_dir():
        raise CliError(f"{option}: no such directory: {folder}")
    if Path(path).is_dir():
        raise CliError(f"{option}: {path} is a folder; expected a file path")


def device_arg(text: str | None) -> str | None:
    """--device as torch names it, or the option's error."""
    import torch

    if text is None:
        return None
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise CliError(f"--device: expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device: expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device: {text} asked for, but no CUDA device is visible")
    return text


def int_from(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {value}")
    return value


def non_negative_int(text: str) -> int:
    return int_from(text, 0)


def positive_int(text: str) -> int:
    return int_from(text, 1)


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {value}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


# BenchConfig fields and the `kvcopy bench` flags that set them, for error messages.
