"""``python -m kvcopy``: the same as the ``kvcopy`` command."""

import sys

from .cli import main

sys.exit(main())
