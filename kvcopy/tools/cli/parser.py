"""What the ``kvcopy`` command line accepts: the parser of its subcommands (``calibrate``, ``plan``, ``bench``,
``peer``, ``info``) and its argument types and checks, each bad value a CliError naming the option, raised
before any work starts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from kvcopy.model.spec import ModelSpec
    from kvcopy.profile import Profile

__all__ = [
    "CliError",
    "Parser",
    "build_parser",
    "check_folder",
    "check_output_file",
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

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def load_model(name_or_path: str) -> ModelSpec:
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


def load_profile(path: str | None) -> Profile:
    from kvcopy._checks import FileFormatError
    from kvcopy.profile import DEFAULT_PROFILE_PATH, Profile

    where = Path(path) if path else DEFAULT_PROFILE_PATH
    if not where.exists():
        raise CliError(f"--profile: no profile at {where}; run `kvcopy calibrate` first (or pass --profile)")
    try:
        return Profile.load(where)
    except FileFormatError as err:  # names the file, the field, what was expected and found
        raise CliError(f"--profile: not a profile: {err}") from None
    except OSError as err:  # a folder, no permission
        raise CliError(f"--profile: cannot read {where}: {err.strerror or err}") from None


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


def check_output_file(option: str, path: str) -> None:
    """Before any work: ``path`` is a file this process can write, tried rather than guessed
    (kvcopy._checks.writable_file_path: not a folder, under no file, with permission), its folders then made."""
    from kvcopy._checks import writable_file_path

    try:
        writable_file_path(option, path)
    except ValueError as err:
        raise CliError(str(err)) from None
    check_folder(option, path, make=True)


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


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand; each sets ``run``, the function that does its work."""
    from kvcopy._version import __version__
    from kvcopy.model.spec import ModelSpec
    from kvcopy.tools.cli import commands

    presets = ", ".join(ModelSpec.preset_names())
    parser = Parser(prog="kvcopy", description="Paged KV-cache block copies between GPU and host.")
    parser.add_argument("--version", action="version", version=f"kvcopy {__version__}")
    subcommands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    calibrate = subcommands.add_parser(
        "calibrate",
        help="measure copy costs and prefill throughput; save a profile",
        description="Measures this machine: the fixed cost and bandwidth of each copy method in each direction "
        "(host to device and back on a GPU, host to host on a CPU), the contiguous-copy peak, and "
        "prefill throughput on one layer of a model's shape. Saves the profile that method='auto' and "
        "the planner use. A poor fit (R^2 < 0.8, or a point 150% off its line: a busy machine) is "
        "measured again; if it stays poor it is reported and does not replace a good profile unless "
        f"--force. Model presets: {presets}.",
    )
    calibrate.add_argument("--device", help="cuda, cuda:N or cpu (default: the GPU if any, else the CPU)")
    calibrate.add_argument("--quick", action="store_true", help="fewer shapes and repeats (about 10 s on a CPU)")
    calibrate.add_argument("--out", help="profile path (default: ~/.cache/kvcopy/profile.json)")
    calibrate.add_argument("--plot", help="also draw time against bytes with the fitted lines to this PNG")
    calibrate.add_argument(
        "--model",
        default=commands.DEFAULT_PLAN_MODEL,
        help="preset name or config.json for the prefill shape and threshold",
    )
    calibrate.add_argument("--methods", help="comma-separated methods to time (default: all that can run)")
    calibrate.add_argument("--no-progress", action="store_true", help="no progress bar")
    calibrate.add_argument(
        "--force",
        action="store_true",
        help="save even a poorly fitted profile over a good one (default: keep the good one)",
    )
    calibrate.add_argument(
        "--remote",
        nargs="?",
        const=commands.LOOPBACK_ARG,
        metavar="DESCRIPTOR",
        help="also measure the network link to a peer over NIXL: the descriptor file `kvcopy peer` wrote on the "
        "other node; without one, the loopback path to a peer process on this machine (labelled as such)",
    )
    calibrate.add_argument(
        "--disk",
        metavar="PATH",
        help="also measure writes and reads of a disk store (kvcopy.storage) in a folder on the disk at PATH, "
        "cold (O_DIRECT where the filesystem takes it): directions h2f and f2h, per range size",
    )
    calibrate.set_defaults(run=commands.calibrate)

    plan = subcommands.add_parser(
        "plan",
        help="reload, recompute, split, or fetch from a peer, for a model and prefix, from a profile",
        description="Decides, for a model and a cached prefix, between reloading it, reloading layer by layer, "
        "splitting (compute the front while the back loads) and recomputing it, or with --from-peer between "
        "fetching it from another node and recomputing it, from a calibrated "
        f"profile; prints each option's time and the small-prefix threshold. Model presets: {presets}.",
    )
    plan.add_argument("--model", required=True, help="preset name or path to a Hugging Face config.json")
    plan.add_argument("--profile", help="profile path (default: ~/.cache/kvcopy/profile.json)")
    plan.add_argument("--prefix", type=non_negative_int, default=1024, help="cached prefix tokens (default 1024)")
    plan.add_argument(
        "--new",
        type=positive_int,
        default=1,
        help="new tokens after the prefix, at least 1: the token a resumed request continues from (default 1)",
    )
    plan.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks: plan for one rank (default 1)")
    plan.add_argument(
        "--no-layerwise",
        dest="layerwise",
        action="store_false",
        help="the engine cannot reload layer by layer: leave that option out",
    )
    plan.add_argument(
        "--from-peer",
        action="store_true",
        help="the prefix is held by another node: fetch it over the network link the profile measured "
        "(kvcopy calibrate --remote), or recompute",
    )
    plan.add_argument(
        "--from-disk",
        action="store_true",
        help="the prefix is in a disk store (kvcopy.storage): read it into the host pool and reload it, "
        "pipelined, at the disk reads the profile measured (kvcopy calibrate --disk), or recompute",
    )
    plan.add_argument("--decode-share", type=fraction, default=0.0, help="fraction of the link decode needs")
    plan.add_argument("--plot", help="draw reload / recompute / split time against prefix length to this PNG")
    plan.set_defaults(run=commands.plan)

    bench = subcommands.add_parser(
        "bench",
        help="time every method beside the copies you would write yourself, as ratios to a contiguous copy",
        description="Times every kvcopy method that can run here beside the copies a user would otherwise write "
        "(a per-layer index loop, a per-block copy loop, on a GPU per-block and unmerged batched DMA) "
        "and one contiguous copy of the same bytes, for named workloads and sweeps of block counts "
        "and plane-block sizes; every row is checked against plain indexing before it is timed.",
    )
    bench.add_argument("--device", help="cuda, cuda:N or cpu (default: the GPU if any, else the CPU)")
    bench.add_argument("--quick", action="store_true", help="a smoke-test size (seconds)")
    bench.add_argument(
        "--workload",
        action="append",
        help="a named workload (repeatable; default: all of kvcopy.tools.bench.WORKLOADS)",
    )
    bench.add_argument(
        "--ids",
        choices=("random", "sequential"),
        default="random",
        help="random block ids, or one run of adjacent ids on each side",
    )
    bench.add_argument("--blocks", type=int, help="blocks per call for the workloads (default 256)")
    bench.add_argument("--counts", type=int_list, help="block counts of the count sweep, e.g. 1,16,256")
    bench.add_argument("--block-tokens", type=int_list, help="tokens per block of the size sweep, e.g. 1,16,64")
    bench.add_argument("--sweep-blocks", type=int, help="blocks per call in the size sweep")
    bench.add_argument("--no-sweeps", action="store_true", help="only the workloads (no sweeps, no fixed cost)")
    bench.add_argument("--repeats", type=int, help="timed calls per row")
    bench.add_argument("--profile", help="also show this calibration profile's predictions for kvcopy's rows")
    bench.add_argument("--csv", help="write every row, its ratios and the machine identity to this CSV")
    bench.add_argument("--plot", help="draw GB/s against plane-block size and block count to this PNG")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--list", action="store_true", help="print the points it would time, and exit")
    bench.set_defaults(run=commands.bench)

    peer = subcommands.add_parser(
        "peer",
        help="serve a calibration pool for another node's `kvcopy calibrate --remote`",
        description="Registers a calibration pool with a NIXL agent, writes its descriptor to a file and waits "
        "(until Ctrl-C or --seconds): copy the file to another node and run `kvcopy calibrate --remote FILE` "
        "there to measure the network link between the two. Needs kvcopy[nixl].",
    )
    peer.add_argument("--descriptor", required=True, help="write the peer's descriptor to this file")
    peer.add_argument("--name", help="the NIXL agent's name (default: kvcopy-peer-<host>-<pid>)")
    peer.add_argument("--seconds", type=positive_int, help="close after this many seconds (default: at Ctrl-C)")
    peer.set_defaults(run=commands.peer)

    info = subcommands.add_parser(
        "info",
        help="what was built (CPU/CUDA kernels, archs, Triton) and the device",
        description="Prints what this install of kvcopy built and can use: the extension, "
        "CPU and CUDA kernels and their archs, Triton, torch, and the device.",
    )
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=commands.info)
    return parser
