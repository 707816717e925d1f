"""The README's API example runs as written, on whatever this machine has (a CPU here)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_api_example_runs():
    namespace: dict = {}
    exec(compile(_block_after("## The API in one example"), "README.md", "exec"), namespace)  # noqa: S102
    kv, host = namespace["kv"], namespace["host"]
    assert host.num_free == host.num_blocks  # every host block it allocated went back
    assert kv.num_planes == 64
