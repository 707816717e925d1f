"""The ``kvcopy`` command line: ``calibrate``, ``plan``, ``bench``, ``peer`` and ``info``. What it accepts is
kvcopy.tools.cli.parser, what each subcommand does kvcopy.tools.cli.commands."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvcopy.tools.cli.parser import CliError, build_parser

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except CliError as err:
        print(f"kvcopy {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
