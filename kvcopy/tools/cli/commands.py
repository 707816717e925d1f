"""What each ``kvcopy`` subcommand does once its arguments are parsed (kvcopy.tools.cli.parser parses them):
``calibrate`` (with ``--remote``, the network link to a peer, and ``--disk``, a disk store), ``plan``,
``bench``, ``peer`` (serve a calibration pool for another node's ``calibrate --remote``) and ``info``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvcopy._ext import build_info
from kvcopy.tools.cli.parser import (
    CliError,
    check_folder,
    check_output_file,
    check_plot,
    device_arg,
    load_model,
    load_profile,
)

if TYPE_CHECKING:
    from kvcopy.profile import Profile

__all__ = [
    "DEFAULT_PLAN_MODEL",
    "LOOPBACK_ARG",
    "add_disk_fits",
    "add_remote_link",
    "bench",
    "calibrate",
    "check_disk_arg",
    "info",
    "peer",
    "plan",
    "print_disk_fits",
    "print_remote_link",
    "remote_descriptor",
]


# The model whose small-prefix threshold `kvcopy calibrate` prints.
DEFAULT_PLAN_MODEL = "llama-3.1-8b"


def calibrate(args: argparse.Namespace) -> int:
    from kvcopy.calibration import local as calibrator
    from kvcopy.methods import method_names
    from kvcopy.planner.planner import Planner
    from kvcopy.profile import DEFAULT_PROFILE_PATH, fit_problems

    spec = load_model(args.model)
    if args.out:
        check_folder("--out", args.out, make=True)  # a profile's folder is made, as Profile.save does
    check_plot(args.plot)
    device = device_arg(args.device)
    descriptor = remote_descriptor(args.remote)
    check_disk_arg(args.disk, quick=args.quick)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    unknown = [m for m in methods or [] if m not in method_names()]
    if unknown:
        raise CliError(f"--methods: unknown method {unknown[0]!r}; known: {', '.join(method_names())}")

    def measure() -> Profile:
        try:
            profile = calibrator.calibrate(
                device, methods=methods, quick=args.quick, progress=not args.no_progress, model=spec
            )
        except ValueError as err:
            raise CliError(str(err)) from None
        if args.remote is not None:
            add_remote_link(profile, descriptor, quick=args.quick, progress=not args.no_progress)
        if args.disk is not None:
            try:
                add_disk_fits(profile, args.disk, quick=args.quick, progress=not args.no_progress)
            except ValueError as err:  # times that did not grow with the bytes, twice: a disk too busy to fit
                raise CliError(f"--disk: {err}") from None
        return profile

    profile = measure()
    problems = fit_problems(profile)
    if problems:  # once more: contention comes and goes
        print(f"kvcopy calibrate: poor fit ({'; '.join(problems)}); measuring again", file=sys.stderr)
        again = measure()
        if len(fit_problems(again)) <= len(problems):
            profile, problems = again, fit_problems(again)
    hw = profile.hardware
    print(f"kvcopy calibrate on {hw['device_name']} (torch {hw['torch']}, {hw['torch_threads']} threads), {hw['date']}")
    header = (
        f"{'direction':<9} {'method':<12} {'alpha us':>9} {'beta GB/s':>10} {'% of peak':>9} {'R^2':>7} "
        f"{'max resid':>9}"
    )
    print(header)
    print("-" * len(header))
    for direction in sorted(profile.directions):
        peak = profile.peaks.get(direction)
        for method, mp in sorted(profile.directions[direction].items()):
            fit = mp.fit
            share = f"{fit.beta_bytes_per_s / peak:9.0%}" if peak else f"{'':>9}"
            print(
                f"{direction:<9} {method:<12} {fit.alpha_s * 1e6:9.1f} {fit.beta_bytes_per_s / 1e9:10.2f} {share} "
                f"{fit.r2:7.3f} {fit.max_abs_residual:9.0%}"
            )
        if peak:
            print(f"{direction:<9} {'contiguous':<12} {'':>9} {peak / 1e9:10.2f} {'100%':>9}")
    print_remote_link(profile)
    print_disk_fits(profile)
    prefill = profile.prefill
    assert prefill is not None  # calibrate() always times the prefill
    floor = (
        f"{prefill.weight_bytes_per_s / 1e9:.1f} GB/s weight reads (few-token forwards)"
        if prefill.weight_bytes_per_s
        else "no weight-read floor measurable"
    )
    print(
        f"prefill ({prefill.model} layer shape): {prefill.flops_per_s / 1e12:.2f} TFLOP/s compute (R^2 "
        f"{prefill.r2:.3f}), {floor}, {prefill.alpha_s * 1e3:.2f} ms fit intercept per forward"
    )
    threshold = Planner.from_profile(profile, spec).threshold_tokens()
    reason = (
        "recompute wins at the longest prefix"
        if threshold is None
        else f"keep a cached prefix from {threshold} tokens on"
    )
    print(f"small-prefix threshold for {spec.name}: {reason}")
    out = Path(args.out) if args.out else DEFAULT_PROFILE_PATH
    if problems:
        print(
            f"warning: the fit stayed poor ({'; '.join(problems)}). The likely cause is another process using "
            f"the CPU or memory bandwidth while it measured; calibrate again on an idle machine."
        )
        if out.exists() and not args.force and not is_poor(out):
            print(f"kept the good profile at {out} (pass --force to replace it with this one)")
            return 1
    profile.save(out)
    print(f"profile saved to {out}")
    if args.plot:
        from kvcopy.tools.plots import plot_calibration

        plot_calibration(profile, args.plot)
        print(f"plot saved to {args.plot}")
    return 0


def is_poor(path: Path) -> bool:
    """Whether the profile at ``path`` is unreadable or poorly fitted."""
    from kvcopy.profile import Profile, fit_problems

    try:
        return bool(fit_problems(Profile.load(path)))
    except (ValueError, OSError):  # not a profile (FileFormatError), or unreadable
        return True


def plan(args: argparse.Namespace) -> int:
    from kvcopy.planner.decision import seconds_text
    from kvcopy.planner.planner import Planner, Source

    spec = load_model(args.model)
    profile = load_profile(args.profile)
    check_plot(args.plot)
    try:
        planner = Planner.from_profile(
            profile, spec, decode_share=args.decode_share, layerwise=args.layerwise, tp=args.tp
        )
    except ValueError as err:
        raise CliError(f"--tp: {err}" if str(err).startswith("tp:") else str(err)) from None
    if args.from_peer and args.from_disk:
        raise CliError("--from-disk: a prefix is on a peer (--from-peer) or on the disk, not both")
    if args.from_peer and planner.fetch is None:
        raise CliError(
            "--from-peer: the profile has no network link to a peer; measure one with `kvcopy calibrate --remote`"
        )
    if args.from_disk and planner.disk is None:
        raise CliError(
            "--from-disk: the profile has no disk measurements; measure them with `kvcopy calibrate --disk PATH`"
        )
    source: Source = "peer" if args.from_peer else "disk" if args.from_disk else "host"
    decision = planner.decide(args.prefix, args.new, source=source)
    threshold = planner.threshold_tokens(args.new, source=source)
    where = "cached tokens"
    if args.from_peer:
        where = f"tokens held by a peer ({profile.hardware.get('remote_link')})"
    elif args.from_disk:
        where = f"tokens in a disk store ({profile.hardware.get('disk')})"
    print(f"{planner.spec.name} on {profile.hardware.get('device_name')}: {args.prefix} {where}, {args.new} new")
    print(f"decision: {decision.action} ({decision.explanation})")
    elsewhere = args.from_peer or args.from_disk
    arrives = "is fetched" if elsewhere else "loads"
    options = [
        ("reload", decision.t_reload, "load the prefix, then compute the new tokens"),
        ("layer-wise reload", decision.t_layerwise, "each layer's blocks load while earlier layers compute"),
        (
            "fetch",
            decision.t_fetch,
            f"read it from the {'disk' if args.from_disk else 'peer'} and reload it ({decision.fetch_chunks} "
            "pipelined chunks), then compute",
        ),
        ("split", decision.t_split, f"compute the first {decision.split_tokens} tokens while the rest {arrives}"),
        ("recompute", decision.t_recompute, "prefill the prefix and the new tokens"),
    ]
    for name, seconds, what in options:
        if seconds is not None:
            mark = "*" if name.startswith(decision.action.replace("layerwise", "layer-wise")) else " "
            print(f"  {mark} {name:<18} {seconds_text(seconds):>10}  {what}")
    kept = "fetch" if elsewhere else "keep"
    keep = "recompute wins at the longest prefix" if threshold is None else f"{kept} from {threshold} tokens"
    print(f"threshold: {keep}")
    if args.plot:
        from kvcopy.tools.plots import plot_plan

        plot_plan(
            planner,
            args.plot,
            max_tokens=max(4 * args.prefix, 4 * (threshold or 1), 1024),
            new_tokens=args.new,
            prefix=args.prefix,
            source=source,
        )
        print(f"plot saved to {args.plot}")
    return 0


_BENCH_FLAGS = {
    "device": "--device",
    "workloads": "--workload",
    "ids": "--ids",
    "blocks": "--blocks",
    "counts": "--counts",
    "block_tokens": "--block-tokens",
    "sweep_blocks": "--sweep-blocks",
    "repeats": "--repeats",
}


def bench(args: argparse.Namespace) -> int:
    from kvcopy.calibration.machine import machine_identity
    from kvcopy.calibration.progress import progress_bar
    from kvcopy.tools.bench import (
        BenchConfig,
        CsvWriter,
        format_tables,
        num_points,
        point_specs,
        run_benchmarks,
        with_ratios,
    )

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
        print(
            f"kvcopy bench on {config.device}: {config.ids} ids, {config.repeats} repeats after "
            f"{config.warmup} warm-up calls"
        )
        for suite, workload, blocks in point_specs(config):
            print(f"  {suite:<12} {workload:<20} {blocks:>6} blocks per call")
        return 0
    if args.plot and not (config.counts or config.block_tokens):
        raise CliError("--plot: draws the sweeps; drop --no-sweeps")
    check_plot(args.plot)
    profile = load_profile(args.profile) if args.profile else None
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
        from kvcopy.tools.plots import plot_bench

        plot_bench(with_ratios(rows), args.plot, title=f"kvcopy bench: {identity['device_name']} ({identity['date']})")
        print(f"plot saved to {args.plot}")
    return 0


def info(args: argparse.Namespace) -> int:
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


# --------------------------------------------------------------------------- --remote and peer

# What --remote holds when given without a descriptor: measure the loopback path to a peer process here.
LOOPBACK_ARG = ""
# NIXL logs every agent's start at INFO on standard output; the command line keeps its output to its own lines.
_NIXL_LOG_LEVEL = "WARN"


def need_nixl(option: str) -> None:
    """CliError for ``option`` unless NIXL imports (its log level set to the CLI's first, and UCX's modules
    chosen as every kvcopy agent has them: ``kvcopy.nixl.agent.nixl_module``)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", _NIXL_LOG_LEVEL)
    from kvcopy.nixl.agent import nixl_module

    try:
        nixl_module()
    except ImportError:
        raise CliError(f"{option}: needs NIXL: pip install 'kvcopy[nixl]'") from None


def remote_descriptor(value: str | None) -> bytes | None:
    """Before any work: --remote's descriptor file read (None for the loopback path), and NIXL importable."""
    if value is None:
        return None
    need_nixl("--remote")
    if value == LOOPBACK_ARG:
        return None
    from kvcopy.calibration.network import check_calibration_descriptor

    try:
        data = Path(value).read_bytes()
    except OSError as err:
        raise CliError(f"--remote: cannot read the peer's descriptor {value}: {err.strerror}") from None
    try:
        check_calibration_descriptor(data)
    except (TypeError, ValueError) as err:
        raise CliError(f"--remote: {value}: {err}") from None
    return data


def add_remote_link(profile: Profile, descriptor: bytes | None, *, quick: bool, progress: bool) -> None:
    from kvcopy.calibration.network import add_remote_link as measure

    try:
        measure(profile, descriptor, quick=quick, progress=progress)
    except ValueError as err:  # a descriptor that is not one, or of another calibration pool
        raise CliError(f"--remote: {err}") from None
    except (RuntimeError, TimeoutError) as err:  # the peer vanished, or never started (a loopback peer)
        raise CliError(f"--remote: the link could not be measured: {err}") from None


def print_remote_link(profile: Profile) -> None:
    """The link to the peer, per range size (what the planner's fetch uses), below calibrate's table."""
    from kvcopy.calibration.network import REMOTE_METHOD
    from kvcopy.profile import REMOTE_DIRECTION

    link = profile.directions.get(REMOTE_DIRECTION, {}).get(REMOTE_METHOD)
    if link is None:
        return
    print(f"remote link ({REMOTE_DIRECTION}): {profile.hardware.get('remote_link')}")
    print(f"  carried by {profile.hardware.get('remote_transport', 'not recorded')}")
    for size, fit in sorted(link.by_block_nbytes.items()):
        print(
            f"  {size // 1024:>6} KiB ranges: {fit.alpha_s * 1e6:7.1f} us + bytes at {fit.beta_bytes_per_s / 1e9:6.2f} "
            f"GB/s (R^2 {fit.r2:.3f}, max resid {fit.max_abs_residual:.0%})"
        )


def peer(args: argparse.Namespace) -> int:
    """Serves a calibration pool: writes its descriptor to --descriptor, then waits (Ctrl-C, or --seconds)."""
    check_output_file("--descriptor", args.descriptor)  # before the agent starts, not in a traceback after it
    need_nixl("kvcopy peer")
    from kvcopy.calibration.network import serve_calibration_peer
    from kvcopy.host.pool import HostKVPool

    name = args.name or f"kvcopy-peer-{os.uname().nodename}-{os.getpid()}"
    with serve_calibration_peer(name) as served:
        Path(args.descriptor).write_bytes(served.descriptor())
        pool = served.pool
        assert isinstance(pool, HostKVPool)  # serve_calibration_peer's pool is in host memory
        print(f"peer {name!r} serving {pool.nbytes >> 20} MiB; its descriptor is in {args.descriptor}")
        print("copy that file to the other node and run there: kvcopy calibrate --remote <the file>")
        until = None if args.seconds is None else time.monotonic() + args.seconds
        try:
            while until is None or time.monotonic() < until:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    print("peer closed")
    return 0


# --------------------------------------------------------------------------- --disk


def check_disk_arg(value: str | None, *, quick: bool = True) -> None:
    """Before any work: --disk names a directory (or one that can be made) where a store can be made, with room
    for the calibration's, and NIXL is importable: not after the whole calibration, which would be lost."""
    if value is None:
        return
    if os.path.exists(value) and not os.path.isdir(value):
        raise CliError(f"--disk: {value} is not a directory (give a folder on the disk to measure)")
    need_nixl("--disk")
    from kvcopy.calibration.disk import FULL_SWEEP, QUICK_SWEEP, check_disk_directory

    try:
        check_disk_directory(value, QUICK_SWEEP if quick else FULL_SWEEP)
    except OSError as err:  # under a file, no permission, read-only, full
        raise CliError(f"--disk: {(err.strerror or str(err)).removeprefix('directory: ')}") from None


def add_disk_fits(profile: Profile, directory: str, *, quick: bool, progress: bool) -> None:
    from kvcopy.calibration.disk import add_disk_fits as measure

    try:
        measure(profile, directory, quick=quick, progress=progress)
    except OSError as err:  # no room, no permission
        raise CliError(f"--disk: the disk under {directory} could not be measured: {err}") from None


def print_disk_fits(profile: Profile) -> None:
    """The disk's writes and reads per range size (what a disk reload would use), below calibrate's table."""
    from kvcopy.calibration.disk import DISK_METHOD, DISK_READ, DISK_WRITE

    where = profile.hardware.get("disk")
    if where is None:
        return
    print(f"disk: {where}")
    for direction, what in ((DISK_WRITE, "write"), (DISK_READ, "read")):
        link = profile.directions.get(direction, {}).get(DISK_METHOD)
        for size, fit in sorted(link.by_block_nbytes.items()) if link else ():
            print(
                f"  {what} ({direction}) {size // 1024:>6} KiB ranges: {fit.alpha_s * 1e6:8.1f} us + bytes at "
                f"{fit.beta_bytes_per_s / 1e9:6.2f} GB/s (R^2 {fit.r2:.3f}, max resid {fit.max_abs_residual:.0%})"
            )
