"""The ``kvcopy`` command line: ``calibrate``, ``plan``, ``bench``, ``peer`` and ``info`` (their work is in
kvcopy.tools.cli.commands, kvcopy.tools.cli.remote and kvcopy.tools.cli.disk, their argument types in
kvcopy.tools.cli.args)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kvcopy.tools.cli.commands as cli_commands
import kvcopy.tools.cli.remote as cli_remote
from kvcopy.tools.cli.args import CliError, Parser, fraction, int_list, non_negative_int, positive_int
from kvcopy.tools.cli.commands import DEFAULT_PLAN_MODEL
from kvcopy.tools.cli.remote import LOOPBACK_ARG

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from kvcopy._version import __version__
    from kvcopy.model.spec import ModelSpec

    presets = ", ".join(ModelSpec.preset_names())
    parser = Parser(prog="kvcopy", description="Paged KV-cache block copies between GPU and host.")
    parser.add_argument("--version", action="version", version=f"kvcopy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    calibrate = commands.add_parser(
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
        "--model", default=DEFAULT_PLAN_MODEL, help="preset name or config.json for the prefill shape and threshold"
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
        const=LOOPBACK_ARG,
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
    calibrate.set_defaults(run=cli_commands.calibrate)

    plan = commands.add_parser(
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
    plan.set_defaults(run=cli_commands.plan)

    bench = commands.add_parser(
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
    bench.set_defaults(run=cli_commands.bench)

    peer = commands.add_parser(
        "peer",
        help="serve a calibration pool for another node's `kvcopy calibrate --remote`",
        description="Registers a calibration pool with a NIXL agent, writes its descriptor to a file and waits "
        "(until Ctrl-C or --seconds): copy the file to another node and run `kvcopy calibrate --remote FILE` "
        "there to measure the network link between the two. Needs kvcopy[nixl].",
    )
    peer.add_argument("--descriptor", required=True, help="write the peer's descriptor to this file")
    peer.add_argument("--name", help="the NIXL agent's name (default: kvcopy-peer-<host>-<pid>)")
    peer.add_argument("--seconds", type=positive_int, help="close after this many seconds (default: at Ctrl-C)")
    peer.set_defaults(run=cli_remote.peer)

    info = commands.add_parser(
        "info",
        help="what was built (CPU/CUDA kernels, archs, Triton) and the device",
        description="Prints what this install of kvcopy built and can use: the extension, "
        "CPU and CUDA kernels and their archs, Triton, torch, and the device.",
    )
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=cli_commands.info)
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
