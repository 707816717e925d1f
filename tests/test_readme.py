"""The README's Python blocks run as written, on whatever this machine has (a CPU here), from the
repository root (where a clone's commands run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvcopy

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _python_blocks() -> list[tuple[str, str]]:
    """(the heading above it, the code) of every ```python block, in order."""
    text = README.read_text()
    blocks = []
    for match in re.finditer(r"```python\n(.*?)```", text, re.S):
        heading = re.findall(r"^#+ .*$", text[: match.start()], re.M)[-1]
        blocks.append((heading, match.group(1)))
    return blocks


def _run(code: str, monkeypatch) -> dict:
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    return namespace


def test_every_python_block_is_tested_here():
    assert len(_python_blocks()) == 6  # a new block needs its own test below


def test_the_api_example_runs(monkeypatch):
    heading, code = _python_blocks()[0]
    assert heading == "## The API in one example"
    namespace = _run(code, monkeypatch)
    kv, host = namespace["kv"], namespace["host"]
    assert host.num_free == host.num_blocks  # every host block it allocated went back
    assert kv.num_planes == 64


def test_the_planner_and_cache_key_example_runs(monkeypatch, capsys):
    namespace = _run(_python_blocks()[1][1], monkeypatch)
    assert namespace["hits"] == [10, 11, 12, 13]  # the 4 full blocks the two prompts share
    assert namespace["decision"].prefix_tokens == 64
    assert "keep a cached prefix from" in capsys.readouterr().out


def test_the_transformers_example_runs(monkeypatch):
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    namespace = _run(_python_blocks()[2][1], monkeypatch)
    stats = namespace["stats"]
    assert stats.decisions, "the example's cache is meant to be too small: transformers should preempt"
    assert stats.host_blocks_in_use == 0
    assert len(namespace["out"]) == len(namespace["prompts"])
    learned = kvcopy.Profile.load(ROOT / "out" / "learned.json")
    assert learned.hardware["online"]["observations"]["prefill"] > 0


def test_the_engine_example_runs(monkeypatch):
    namespace = _run(_python_blocks()[3][1], monkeypatch)
    kv, host = namespace["kv"], namespace["host"]
    assert host.num_free == host.num_blocks
    copies = 0
    if namespace["decision"].action != "recompute":  # the reload put the offloaded blocks in their new places
        for plane in kv.planes:
            assert plane[20:23].equal(plane[[3, 7, 9]])
        copies = 2  # the offload and the reload, each observed once
    observed = namespace["online"].num_observations
    assert sum(n for link, n in observed.items() if link != "prefill") == copies and observed["prefill"] == 1


def test_the_remote_example_runs(monkeypatch, capsys):
    pytest.importorskip("nixl_cu13", reason="kvcopy.remote needs the nixl extra (pip install 'kvcopy[nixl]')")
    heading, code = _python_blocks()[4]
    assert heading == "## Beyond one machine"
    namespace = _run(code, monkeypatch)
    assert namespace["fetch"].num_descriptors == 1
    printed = capsys.readouterr().out.splitlines()
    assert f"1 {32 << 20}" in printed  # (NIXL logs to stdout too)
    decision = namespace["decision"]
    assert decision.t_fetch is not None and decision.t_reload is None
    assert f"{decision.action} {decision.explanation}" in printed


def test_the_disk_store_example_runs(monkeypatch, capsys):
    pytest.importorskip("nixl_cu13", reason="kvcopy.storage needs the nixl extra (pip install 'kvcopy[nixl]')")
    heading, code = _python_blocks()[5]
    assert heading == "## Below host RAM"
    import shutil

    shutil.rmtree(ROOT / "out" / "disk_store", ignore_errors=True)
    namespace = _run(code, monkeypatch)
    assert namespace["put"].num_descriptors == 1
    assert len(namespace["slots"]) == 4
    assert capsys.readouterr().out.strip().endswith("True")
    shutil.rmtree(ROOT / "out" / "disk_store", ignore_errors=True)
