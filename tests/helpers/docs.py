"""The ```python blocks of the README and docs/*.md, as the tests that run them read them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(name: str) -> list[tuple[str, str]]:
    """(the heading above it, the code) of every ```python block of ROOT / name, in order."""
    blocks, heading, fence, code = [], "", None, []
    for line in (ROOT / name).read_text().splitlines(keepends=True):
        if fence is None and line.startswith("```"):
            fence, code = line[3:].strip(), []
        elif fence is not None and line.startswith("```"):
            if fence == "python":
                blocks.append((heading, "".join(code)))
            fence = None
        elif fence is not None:
            code.append(line)
        elif re.match(r"#+ ", line):  # a heading, not a comment inside a block
            heading = line.strip()
    return blocks


def python_block(name: str, index: int, heading: str) -> str:
    """The code of ROOT / name's python block ``index``, checked to sit under ``heading``."""
    found_heading, code = python_blocks(name)[index]
    assert found_heading == heading, f"{name}'s python block {index} moved: it now sits under {found_heading!r}"
    return code
