"""Paged block copies, every kvcopy method beside the copies a user would write instead.

The benchmark lives in the package (kvcopy.tools.bench) so that ``kvcopy bench``
runs it anywhere kvcopy is installed; this script is the same command run from
a checkout:

    python benchmarks/bench_copy.py [--device cuda] [--quick] [--workload llama8b-16] [--csv out.csv] [--plot out.png]

See ``python benchmarks/bench_copy.py --help`` for every option.
"""

from __future__ import annotations

import sys

from kvcopy.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
