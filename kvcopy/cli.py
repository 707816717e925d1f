"""The ``kvcopy`` command line: ``kvcopy info``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ._ext import build_info

__all__ = ["main"]


def _info(args: argparse.Namespace) -> int:
    import torch

    info = build_info()
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    else:
        info["device"] = "cpu (no CUDA device visible)"
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcopy", description="Paged KV-cache block copies between GPU and host.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="what was built (CPU/CUDA kernels, archs, Triton) and the device")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=_info)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
