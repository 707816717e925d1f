"""``python -m kvcopy``: the same as the ``kvcopy`` command."""

import sys

from kvcopy.tools.cli import main

sys.exit(main())
