"""The Python blocks of the README and of docs/*.md run as written, on whatever this machine has (a CPU here),
from the repository root (where a clone's commands run). Each block has its own test of what it shows; a block
that is not meant to run is fenced as ```text, ```bash or ```console, never ```python."""

from __future__ import annotations

import shutil

import pytest
import torch

import kvcopy

from helpers.docs import ROOT, python_block, python_blocks

# The README is read in five minutes: at most this many lines, its first code within the first few.
README_MAX_LINES, FIRST_CODE_WITHIN = 250, 60

# How many ```python blocks each file holds: a new block needs its own test below.
PYTHON_BLOCKS = {
    "README.md": 3,
    "docs/engines.md": 3,
    "docs/guide.md": 2,
    "docs/remote.md": 1,
    "docs/storage.md": 1,
}


def _run(name: str, code: str, monkeypatch) -> dict:
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "readme"}
    exec(compile(code, name, "exec"), namespace)
    return namespace


def test_every_python_block_is_tested_here():
    files = ["README.md", *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))]
    found = {name: len(python_blocks(name)) for name in files}
    assert {name: n for name, n in found.items() if n} == PYTHON_BLOCKS


# README.md


@pytest.mark.slow
def test_the_readme_example_runs(monkeypatch, capsys):
    code = python_block("README.md", 0, "## One example")
    namespace = _run("README.md", code, monkeypatch)
    kv, host = namespace["kv"], namespace["host"]
    assert kv.num_planes == 64
    assert host.num_free == host.num_blocks  # every host block it allocated went back
    for plane in kv.planes:  # the engine's reload too put blocks 3 and 4 in their new places
        assert plane[60:62].equal(plane[[3, 4]])
    decision = namespace["decision"]
    assert decision.action == "reload"  # what its comment says of the CPU VM's profile
    assert capsys.readouterr().out.strip() == decision.explanation
    assert decision.explanation.startswith("reload: 4.30 s vs recompute 95.87 s")


def test_the_errors_example_runs(monkeypatch):
    code = python_block("README.md", 1, "## Errors")
    namespace = _run("README.md", code, monkeypatch)
    a, b = namespace["a"], namespace["b"]
    assert a is not b and a.planes[0].data_ptr() == b.planes[0].data_ptr()  # refused by memory, not identity
    assert namespace["planes"][0][1].equal(torch.arange(8, 16, dtype=torch.float32))  # block 1 never lost


def test_the_agents_example_runs(monkeypatch, capsys):
    code = python_block("README.md", 2, "## Agents: pause and resume")
    namespace = _run("README.md", code, monkeypatch)
    plan, forecast = namespace["plan"], namespace["forecast"]
    # what its comment says: demoted, and read back ahead of the forecast resume, landing before its median
    assert plan.choice == "demote" and plan.prefetch_at_s is not None
    assert plan.prefetch_at_s + namespace["costs"].read_s < forecast.quantile(0.5)
    assert capsys.readouterr().out.strip() == plan.explanation
    assert plan.explanation.startswith("demote, read back from ")


# docs/guide.md


def test_the_api_example_runs(monkeypatch):
    code = python_block("docs/guide.md", 0, "## The API in one example")
    namespace = _run("docs/guide.md", code, monkeypatch)
    kv, host = namespace["kv"], namespace["host"]
    assert host.num_free == host.num_blocks  # every host block it allocated went back
    assert kv.num_planes == 64


@pytest.mark.slow
def test_the_planner_and_cache_key_example_runs(monkeypatch, capsys):
    code = python_block("docs/guide.md", 1, "## The API in one example")
    namespace = _run("docs/guide.md", code, monkeypatch)
    assert namespace["hits"] == [10, 11, 12, 13]  # the 4 full blocks the two prompts share
    assert namespace["decision"].prefix_tokens == 64
    assert "keep a cached prefix from" in capsys.readouterr().out


# docs/engines.md


@pytest.mark.slow
def test_the_transformers_example_runs(monkeypatch):
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    code = python_block("docs/engines.md", 0, "## Hugging Face transformers (continuous batching)")
    namespace = _run("docs/engines.md", code, monkeypatch)
    stats = namespace["stats"]
    assert stats.decisions, "the example's cache is meant to be too small: transformers should preempt"
    assert stats.host_blocks_in_use == 0
    assert len(namespace["out"]) == len(namespace["prompts"])
    learned = kvcopy.Profile.load(ROOT / "out" / "learned.json")
    assert learned.hardware["online"]["observations"]["prefill"] > 0


def test_the_engine_example_runs(monkeypatch):
    code = python_block("docs/engines.md", 1, "## Any other engine")
    namespace = _run("docs/engines.md", code, monkeypatch)
    kv, host = namespace["kv"], namespace["host"]
    assert host.num_free == host.num_blocks
    copies = 0
    if namespace["decision"].action != "recompute":  # the reload put the offloaded blocks in their new places
        for plane in kv.planes:
            assert plane[20:23].equal(plane[[3, 7, 9]])
        copies = 2  # the offload and the reload, each observed once
    observed = namespace["online"].num_observations
    assert sum(n for link, n in observed.items() if link != "prefill") == copies and observed["prefill"] == 1


def test_the_between_nodes_example_runs(monkeypatch):
    pytest.importorskip("nixl_cu13", reason="kvcopy.remote needs the nixl extra (pip install 'kvcopy[nixl]')")
    code = python_block("docs/engines.md", 2, "## Between nodes (NIXL)")
    namespace = _run("docs/engines.md", code, monkeypatch)
    kv, host, prefill_host = namespace["kv"], namespace["host"], namespace["prefill_host"]
    assert namespace["decision"].action == "fetch"  # the CPU VM's loopback profile: fetching wins
    assert host.num_free == host.num_blocks
    check = kvcopy.HostKVPool(kv, 4, pin_memory=False)  # the reloaded pages hold the peer's blocks 4-7
    kvcopy.gather(kv, namespace["new_blocks"], check, [0, 1, 2, 3])
    for i, remote_id in enumerate(namespace["remote_blocks"]):
        assert check.block_bytes(i).equal(prefill_host.block_bytes(remote_id))


# docs/remote.md


def test_the_remote_example_runs(monkeypatch, capsys):
    pytest.importorskip("nixl_cu13", reason="kvcopy.remote needs the nixl extra (pip install 'kvcopy[nixl]')")
    code = python_block("docs/remote.md", 0, "## Peers")
    namespace = _run("docs/remote.md", code, monkeypatch)
    assert namespace["fetch"].num_descriptors == 1
    printed = capsys.readouterr().out.splitlines()
    assert f"1 {32 << 20}" in printed  # (NIXL logs to stdout too)
    decision = namespace["decision"]
    assert decision.t_fetch is not None and decision.t_reload is None
    assert f"{decision.action} {decision.explanation}" in printed


# docs/storage.md


def test_the_disk_store_example_runs(monkeypatch, capsys):
    pytest.importorskip("nixl_cu13", reason="kvcopy.storage needs the nixl extra (pip install 'kvcopy[nixl]')")
    code = python_block("docs/storage.md", 0, "## An example")
    shutil.rmtree(ROOT / "out" / "disk_store", ignore_errors=True)
    namespace = _run("docs/storage.md", code, monkeypatch)
    assert namespace["put"].num_descriptors == 1
    assert len(namespace["slots"]) == 4
    assert capsys.readouterr().out.strip().endswith("True")
    shutil.rmtree(ROOT / "out" / "disk_store", ignore_errors=True)


def test_the_readme_is_short_and_shows_code_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("```"))
    assert first <= FIRST_CODE_WITHIN, f"README.md's first code block starts at line {first}"
