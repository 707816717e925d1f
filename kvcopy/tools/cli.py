"""The ``kvcopy`` command line: ``calibrate``, ``plan``, ``bench`` and ``info``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .._ext import build_info

__all__ = ["main"]

# The model whose small-prefix threshold `kvcopy calibrate` prints.
DEFAULT_PLAN_MODEL = "llama-3.1-8b"


class CliError(Exception):
    """A user error: printed without a traceback, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvcopy <command>: argument --x: ...``, exit status 2 (see --help)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _load_model(name_or_path: str):  # noqa: ANN202 - a ModelSpec
    from ..policy.model import ModelSpec

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


def _load_profile(path: str | None):  # noqa: ANN202 - a Profile
    from ..profile import DEFAULT_PROFILE_PATH, Profile

    where = Path(path) if path else DEFAULT_PROFILE_PATH
    if not where.exists():
        raise CliError(f"--profile: no profile at {where}; run `kvcopy calibrate` first (or pass --profile)")
    try:
        return Profile.load(where)
    except (ValueError, KeyError, TypeError) as err:
        raise CliError(f"--profile: cannot read {where}: {err}") from None


def _check_plot(path: str | None) -> None:
    """Before any work: --plot needs matplotlib and a folder to write into."""
    if path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError("--plot: needs matplotlib (pip install 'kvcopy[plot]')") from None
        _check_folder("--plot", path)


def _check_folder(option: str, path: str, *, make: bool = False) -> None:
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


def _device(text: str | None) -> str | None:
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


def _int_from(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    return _int_from(text, 0)


def _positive_int(text: str) -> int:
    return _int_from(text, 1)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {value}")
    return value


def _calibrate(args: argparse.Namespace) -> int:
    from ..policy import calibrator
    from ..methods import METHODS
    from ..policy.planner import Planner
    from ..profile import DEFAULT_PROFILE_PATH, Profile, fit_problems

    spec = _load_model(args.model)
    if args.out:
        _check_folder("--out", args.out, make=True)  # a profile's folder is made, as Profile.save does
    _check_plot(args.plot)
    device = _device(args.device)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    unknown = [m for m in methods or [] if m not in METHODS]
    if unknown:
        raise CliError(f"--methods: unknown method {unknown[0]!r}; known: {', '.join(METHODS)}")
    def measure() -> Profile:
        try:
            return calibrator.calibrate(device, methods=methods, quick=args.quick, progress=not args.no_progress,
                                        model=spec)
        except ValueError as err:
            raise CliError(str(err)) from None

    profile = measure()
    problems = fit_problems(profile)
    if problems:  # once more: contention comes and goes
        print(f"kvcopy calibrate: poor fit ({'; '.join(problems)}); measuring again", file=sys.stderr)
        again = measure()
        if len(fit_problems(again)) <= len(problems):
            profile, problems = again, fit_problems(again)
    hw = profile.hardware
    print(f"kvcopy calibrate on {hw['device_name']} (torch {hw['torch']}, {hw['torch_threads']} threads), {hw['date']}")
    header = f"{'direction':<9} {'method':<12} {'alpha us':>9} {'beta GB/s':>10} {'% of peak':>9} {'R^2':>7} {'max resid':>9}"
    print(header)
    print("-" * len(header))
    for direction in sorted(profile.links):
        peak = profile.peaks.get(direction)
        for method, mp in sorted(profile.links[direction].items()):
            fit = mp.fit
            share = f"{fit.beta_bytes_per_s / peak:9.0%}" if peak else f"{'':>9}"
            print(f"{direction:<9} {method:<12} {fit.alpha_s * 1e6:9.1f} {fit.beta_bytes_per_s / 1e9:10.2f} {share} "
                  f"{fit.r2:7.3f} {fit.max_abs_residual:9.0%}")
        if peak:
            print(f"{direction:<9} {'contiguous':<12} {'':>9} {peak / 1e9:10.2f} {'100%':>9}")
    prefill = profile.prefill
    floor = (f"{prefill.weight_bytes_per_s / 1e9:.1f} GB/s weight reads (few-token forwards)"
             if prefill.weight_bytes_per_s else "no weight-read floor measurable")
    print(f"prefill ({prefill.model} layer shape): {prefill.flops_per_s / 1e12:.2f} TFLOP/s compute (R^2 "
          f"{prefill.r2:.3f}), {floor}, {prefill.alpha_s * 1e3:.2f} ms fit intercept per forward")
    threshold = Planner.from_profile(profile, spec).threshold_tokens()
    reason = ("recompute wins at the longest prefix" if threshold is None
              else f"keep a cached prefix from {threshold} tokens on")
    print(f"small-prefix threshold for {spec.name}: {reason}")
    out = Path(args.out) if args.out else DEFAULT_PROFILE_PATH
    if problems:
        print(f"warning: the fit stayed poor ({'; '.join(problems)}). The likely cause is another process using "
              f"the CPU or memory bandwidth while it measured; calibrate again on an idle machine.")
        if out.exists() and not args.force and not _poor(out):
            print(f"kept the good profile at {out} (pass --force to replace it with this one)")
            return 1
    profile.save(out)
    print(f"profile saved to {out}")
    if args.plot:
        from .plots import plot_calibration

        plot_calibration(profile, args.plot)
        print(f"plot saved to {args.plot}")
    return 0


def _poor(path: Path) -> bool:
    """Whether the profile at ``path`` is unreadable or poorly fitted."""
    from ..profile import Profile, fit_problems

    try:
        return bool(fit_problems(Profile.load(path)))
    except (ValueError, KeyError, TypeError):
        return True


def _plan(args: argparse.Namespace) -> int:
    from ..policy.planner import Planner
    from ..policy.timing import seconds_text

    spec = _load_model(args.model)
    profile = _load_profile(args.profile)
    _check_plot(args.plot)
    try:
        planner = Planner.from_profile(profile, spec, decode_share=args.decode_share, layerwise=args.layerwise,
                                       tp=args.tp)
    except ValueError as err:
        raise CliError(f"--tp: {err}" if str(err).startswith("tp:") else str(err)) from None
    decision = planner.decide(args.prefix, args.new)
    threshold = planner.threshold_tokens(args.new)
    print(f"{planner.spec.name} on {profile.hardware.get('device_name')}: {args.prefix} cached tokens, "
          f"{args.new} new")
    print(f"decision: {decision.action} ({decision.explanation})")
    options = [("reload", decision.t_reload, "load the prefix, then compute the new tokens"),
               ("layer-wise reload", decision.t_layerwise, "each layer's blocks load while earlier layers compute"),
               ("split", decision.t_split, f"compute the first {decision.split_tokens} tokens while the rest loads"),
               ("recompute", decision.t_recompute, "prefill the prefix and the new tokens")]
    for name, seconds, what in options:
        if seconds is not None:
            mark = "*" if name.startswith(decision.action.replace("layerwise", "layer-wise")) else " "
            print(f"  {mark} {name:<18} {seconds_text(seconds):>10}  {what}")
    keep = "recompute wins at the longest prefix" if threshold is None else f"keep from {threshold} tokens"
    print(f"threshold: {keep}")
    if args.plot:
        from .plots import plot_plan

        plot_plan(planner, args.plot, max_tokens=max(4 * args.prefix, 4 * (threshold or 1), 1024),
                  new_tokens=args.new)
        print(f"plot saved to {args.plot}")
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


# BenchConfig fields and the `kvcopy bench` flags that set them, for error messages.
_BENCH_FLAGS = {"device": "--device", "workloads": "--workload", "ids": "--ids", "blocks": "--blocks",
                "counts": "--counts", "block_tokens": "--block-tokens", "sweep_blocks": "--sweep-blocks",
                "repeats": "--repeats"}


def _bench(args: argparse.Namespace) -> int:
    from ._progress import progress_bar
    from .bench import BenchConfig, CsvWriter, format_tables, num_points, point_specs, run_benchmarks, with_ratios
    from ..policy.machine import machine_identity

    overrides: dict[str, object] = {"ids": args.ids}
    for name in ("blocks", "counts", "block_tokens", "sweep_blocks", "repeats"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.workload:
        overrides["workloads"] = tuple(args.workload)
    if args.no_sweeps:
        overrides.update(counts=(), block_tokens=(), fixed_cost=False)
    try:
        config = BenchConfig.default(args.device, quick=args.quick, **overrides)
    except ValueError as err:  # "field: ..." -> "--flag: ..."
        field, _, rest = str(err).partition(":")
        raise CliError(f"{_BENCH_FLAGS.get(field, field)}:{rest}") from None
    if args.list:
        print(f"kvcopy bench on {config.device}: {config.ids} ids, {config.repeats} repeats after "
              f"{config.warmup} warm-up calls")
        for suite, workload, blocks in point_specs(config):
            print(f"  {suite:<12} {workload:<20} {blocks:>6} blocks per call")
        return 0
    if args.plot and not (config.counts or config.block_tokens):
        raise CliError("--plot: draws the sweeps; drop --no-sweeps")
    _check_plot(args.plot)
    profile = _load_profile(args.profile) if args.profile else None
    identity = machine_identity(config.device)
    try:  # opened first: a bad path fails before minutes of measuring, and each point is saved as it ends
        csv_out = CsvWriter(args.csv, identity) if args.csv else None
    except OSError as err:
        raise CliError(f"--csv: cannot write {args.csv}: {err.strerror}") from None
    bar = progress_bar(num_points(config), not args.no_progress, "benchmarking", "point")

    def point_done(rows: list) -> None:
        bar.update()
        if csv_out is not None:
            csv_out.write(rows)

    try:
        rows = run_benchmarks(config, profile=profile, on_point=point_done)
    finally:
        bar.close()
        if csv_out is not None:
            csv_out.close()
    print(format_tables(rows, identity))
    if args.csv:
        print(f"\ncsv saved to {args.csv}")
    if args.plot:
        from .plots import plot_bench

        plot_bench(with_ratios(rows), args.plot,
                   title=f"kvcopy bench: {identity['device_name']} ({identity['date']})")
        print(f"plot saved to {args.plot}")
    return 0


def _info(args: argparse.Namespace) -> int:
    import torch

    info = build_info()
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA device visible)"
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0


def _parser() -> argparse.ArgumentParser:
    from .._version import __version__
    from ..policy.model import ModelSpec

    presets = ", ".join(ModelSpec.preset_names())
    parser = _Parser(prog="kvcopy", description="Paged KV-cache block copies between GPU and host.")
    parser.add_argument("--version", action="version", version=f"kvcopy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    calibrate = commands.add_parser(
        "calibrate", help="measure copy costs and prefill throughput; save a profile",
        description="Measures this machine: the fixed cost and bandwidth of each copy method in each direction "
                    "(host to device and back on a GPU, host to host on a CPU), the contiguous-copy peak, and "
                    "prefill throughput on one layer of a model's shape. Saves the profile that method='auto' and "
                    "the planner use. A poor fit (R^2 < 0.8, or a point 150% off its line: a busy machine) is "
                    "measured again; if it stays poor it is reported and does not replace a good profile unless "
                    f"--force. Model presets: {presets}.")
    calibrate.add_argument("--device", help="cuda, cuda:N or cpu (default: the GPU if any, else the CPU)")
    calibrate.add_argument("--quick", action="store_true", help="fewer shapes and repeats (about 10 s on a CPU)")
    calibrate.add_argument("--out", help="profile path (default: ~/.cache/kvcopy/profile.json)")
    calibrate.add_argument("--plot", help="also draw time against bytes with the fitted lines to this PNG")
    calibrate.add_argument("--model", default=DEFAULT_PLAN_MODEL, help="preset name or config.json for the "
                                                                       "prefill shape and threshold")
    calibrate.add_argument("--methods", help="comma-separated methods to time (default: all that can run)")
    calibrate.add_argument("--no-progress", action="store_true", help="no progress bar")
    calibrate.add_argument("--force", action="store_true",
                           help="save even a poorly fitted profile over a good one (default: keep the good one)")
    calibrate.set_defaults(run=_calibrate)

    plan = commands.add_parser(
        "plan", help="reload, recompute or split for a model and prefix, from a profile",
        description="Decides, for a model and a cached prefix, between reloading it, reloading layer by layer, "
                    "splitting (compute the front while the back loads) and recomputing it, from a calibrated "
                    f"profile; prints each option's time and the small-prefix threshold. Model presets: {presets}.")
    plan.add_argument("--model", required=True, help="preset name or path to a Hugging Face config.json")
    plan.add_argument("--profile", help="profile path (default: ~/.cache/kvcopy/profile.json)")
    plan.add_argument("--prefix", type=_non_negative_int, default=1024, help="cached prefix tokens (default 1024)")
    plan.add_argument("--new", type=_positive_int, default=1,
                      help="new tokens after the prefix, at least 1: the token a resumed request continues from "
                           "(default 1)")
    plan.add_argument("--tp", type=_positive_int, default=1,
                      help="tensor-parallel ranks: plan for one rank (default 1)")
    plan.add_argument("--no-layerwise", dest="layerwise", action="store_false",
                      help="the engine cannot reload layer by layer: leave that option out")
    plan.add_argument("--decode-share", type=_fraction, default=0.0, help="fraction of the link decode needs")
    plan.add_argument("--plot", help="draw reload / recompute / split time against prefix length to this PNG")
    plan.set_defaults(run=_plan)

    bench = commands.add_parser(
        "bench", help="time every method beside the copies you would write yourself, as ratios to a contiguous copy",
        description="Times every kvcopy method that can run here beside the copies a user would otherwise write "
                    "(a per-layer index loop, a per-block copy loop, on a GPU per-block and unmerged batched DMA) "
                    "and one contiguous copy of the same bytes, for named workloads and sweeps of block counts "
                    "and plane-block sizes; every row is checked against plain indexing before it is timed.")
    bench.add_argument("--device", help="cuda, cuda:N or cpu (default: the GPU if any, else the CPU)")
    bench.add_argument("--quick", action="store_true", help="a smoke-test size (seconds)")
    bench.add_argument("--workload", action="append", help="a named workload (repeatable; default: all of "
                                                           "kvcopy.tools.bench.WORKLOADS)")
    bench.add_argument("--ids", choices=("random", "sequential"), default="random",
                       help="random block ids, or one run of adjacent ids on each side")
    bench.add_argument("--blocks", type=int, help="blocks per call for the workloads (default 256)")
    bench.add_argument("--counts", type=_int_list, help="block counts of the count sweep, e.g. 1,16,256")
    bench.add_argument("--block-tokens", type=_int_list, help="tokens per block of the size sweep, e.g. 1,16,64")
    bench.add_argument("--sweep-blocks", type=int, help="blocks per call in the size sweep")
    bench.add_argument("--no-sweeps", action="store_true", help="only the workloads (no sweeps, no fixed cost)")
    bench.add_argument("--repeats", type=int, help="timed calls per row")
    bench.add_argument("--profile", help="also show this calibration profile's predictions for kvcopy's rows")
    bench.add_argument("--csv", help="write every row, its ratios and the machine identity to this CSV")
    bench.add_argument("--plot", help="draw GB/s against plane-block size and block count to this PNG")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--list", action="store_true", help="print the points it would time, and exit")
    bench.set_defaults(run=_bench)

    info = commands.add_parser("info", help="what was built (CPU/CUDA kernels, archs, Triton) and the device",
                               description="Prints what this install of kvcopy built and can use: the extension, "
                                           "CPU and CUDA kernels and their archs, Triton, torch, and the device.")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except CliError as err:
        print(f"kvcopy {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
