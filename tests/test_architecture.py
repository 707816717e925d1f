"""The architecture docs/architecture.md describes, checked on the source: which room may import which (an
explicit graph, with no cycle), how large a file and a folder may grow, and that the page names every room
and only modules that exist; that tests/ has a folder per room, each keeping tests in the quick loop, and
no test module imports another; in csrc/, which folder may include which (torch headers in ops/ only) and
that setup.py builds every source."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helpers import COLLECTED_TESTS, SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvcopy"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
TESTS = ROOT / "tests"

# The package root holds two rooms: the base every room stands on, and the copy core (with its methods).
BASE = {"_checks", "_ext", "_version", "conflicts", "ids", "layout", "profile"}
CORE = {"dispatch", "ops", "ranges", "methods"}
# room -> the rooms it may import (its own modules always). The facade (kvcopy/__init__.py, __main__.py)
# re-exports every room's public names and may import anything.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "host": {"base"},
    "core": {"base", "host"},
    "engine": {"base", "host", "core"},
    "model": {"base"},
    "cachekey": {"base", "model"},
    "planner": {"base", "model"},
    "agents": {"base", "planner"},
    "online": {"base", "model", "calibration"},
    "nixl": {"base", "host", "engine"},
    "remote": {"base", "host", "core", "model", "cachekey", "nixl"},
    "storage": {"base", "host", "core", "engine", "model", "cachekey", "nixl"},
    "calibration": {"base", "host", "core", "model", "nixl", "remote", "storage"},
    "tools": {
        "base",
        "host",
        "core",
        "engine",
        "model",
        "cachekey",
        "planner",
        "agents",
        "online",
        "calibration",
        "nixl",
        "remote",
        "storage",
    },
    "integrations": {"base", "host", "core", "engine", "model", "cachekey", "planner", "agents", "online", "storage"},
}
# A file holds one concept: past WARN_LINES it is worth a look, past MAX_LINES it must be cut by concept.
WARN_LINES, MAX_LINES = 600, 800
# A folder past this many modules holds more than one concern.
MAX_MODULES_PER_FOLDER = 12


def _modules() -> dict[str, Path]:
    """kvcopy module name -> its file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def room_of(module: str) -> str:
    """ "kvcopy.planner.decision" -> "planner"; "kvcopy.layout" -> "base"; "kvcopy" -> "facade"."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "facade"
    if parts[1] in BASE:
        return "base"
    if parts[1] in CORE:
        return "core"
    return parts[1]


def _imports(path: Path) -> set[str]:
    """Every kvcopy module the file imports, at top level or inside functions (kvcopy's imports are absolute:
    ruff's TID252 refuses relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcopy"):
            for alias in node.names:  # `from kvcopy import ids` imports kvcopy.ids, not the facade
                name = f"{node.module}.{alias.name}"
                found.add(name if name in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvcopy"))
    return found


def test_every_folder_is_a_room_of_the_graph():
    rooms = {room_of(m) for m in MODULES} - {"facade"}
    assert rooms == set(ALLOWED), f"rooms in the tree {sorted(rooms)}, in the graph {sorted(ALLOWED)}"


def test_the_graph_has_no_cycle():
    done: set[str] = set()

    def visit(room: str, path: tuple[str, ...]) -> None:
        assert room not in path, f"cycle: {' -> '.join((*path, room))}"
        if room not in done:
            for below in ALLOWED[room]:
                visit(below, (*path, room))
            done.add(room)

    for room in ALLOWED:
        visit(room, ())


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_graph(module):
    mine = room_of(module)
    if mine == "facade":
        return
    for target in _imports(MODULES[module]):
        theirs = room_of(target)
        assert theirs == mine or theirs in ALLOWED[mine], (
            f"{module} ({mine}) imports {target} ({theirs}); {mine} may import {sorted(ALLOWED[mine])}"
        )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_files_are_cut_by_concept(module):
    path = MODULES[module]
    lines = len(path.read_text().splitlines())
    where = path.relative_to(ROOT)
    assert lines <= MAX_LINES, f"{where} has {lines} lines: cut it by concept (at most {MAX_LINES})"
    if lines > WARN_LINES:
        warnings.warn(f"{where} has {lines} lines (more than {WARN_LINES}): one concept?", stacklevel=1)


def test_no_module_only_holds_another_modules_checks():
    # argument checks shared across rooms live in kvcopy/_checks.py; a subject's own checks live beside it
    split = [m for m in MODULES if re.search(r"(^|_)(checks|args)$", m.rpartition(".")[2]) and m != "kvcopy._checks"]
    assert not split, f"checks split from their subject: {split}"


def test_folders_hold_one_concern():
    for folder in sorted({p.parent for p in MODULES.values()}):
        count = len(list(folder.glob("*.py")))
        assert count <= MAX_MODULES_PER_FOLDER, f"{folder.relative_to(ROOT)} holds {count} modules"


def _named_in_architecture() -> set[str]:
    """The module paths docs/architecture.md's tree names: its ``kvcopy/`` block, folder lines ending in /."""
    text = ARCHITECTURE.read_text()
    tree = re.search(r"```text\nkvcopy/\n(.*?)```", text, re.S)
    assert tree, "docs/architecture.md has no ```text block starting with kvcopy/"
    named, folders = set(), ["kvcopy"]
    for line in tree.group(1).splitlines():
        match = re.match(r"( *)(\S+)", line)
        if not match:
            continue
        if not match.group(1):
            break  # the next tree (csrc/)
        depth = len(match.group(1)) // 2
        folders = folders[:depth]  # a line indented 2 * depth sits in the folder `depth` deep
        name = match.group(2)
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        elif name.endswith(".py"):
            named.add("/".join([*folders, name]))
    return named


def test_architecture_page_names_every_module_that_exists_and_no_other():
    named = _named_in_architecture()
    actual = {str(p.relative_to(ROOT)) for p in MODULES.values()}
    assert not named - actual, f"docs/architecture.md names modules that do not exist: {sorted(named - actual)}"
    assert not actual - named, f"docs/architecture.md does not name: {sorted(actual - named)}"


def test_architecture_page_names_every_room():
    text = ARCHITECTURE.read_text()
    missing = [room for room in ALLOWED if f"**{room}**" not in text]
    assert not missing, f"docs/architecture.md does not describe the rooms {missing} (as **room**)"


# --------------------------------------------------------------------------- the tests (tests/)
# tests/<room>/ holds the tests of each room; tests/helpers/ what they share; tests/ itself the repo's own.
NOT_ROOMS = {"helpers", "__pycache__"}


def test_tests_have_a_folder_per_room_and_no_other():
    folders = {p.name for p in TESTS.iterdir() if p.is_dir()} - NOT_ROOMS
    assert folders == set(ALLOWED), (
        f"tests/ folders without a room: {sorted(folders - set(ALLOWED))}; "
        f"rooms without a folder: {sorted(set(ALLOWED) - folders)}"
    )


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers/ (fixtures in conftest.py): a test module imports neither
    another test module nor conftest."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if re.match(r"(test_|conftest$)", n)]
    assert not found, f"imports of test modules: {found}"


def _quick_tests_by_room(node_ids: list[str]) -> dict[str, int]:
    """How many of ``node_ids`` (pytest's, from the repository root) each room's tests/ folder holds."""
    quick: dict[str, int] = {}
    for node_id in node_ids:
        match = re.match(r"tests/([^/]+)/[^/]+\.py::", node_id)
        if match:
            quick[match.group(1)] = quick.get(match.group(1), 0) + 1
    return quick


def test_every_room_keeps_tests_in_the_quick_loop(request):
    """``pytest -m "not slow"`` runs at least one test of every room: the quick loop touches them all. What this
    run collected proves it when it holds such a test of every room; else the quick loop is collected whole."""
    collected = request.config.stash.get(COLLECTED_TESTS, [])
    quick = _quick_tests_by_room([node_id for node_id, slow in collected if not slow])
    if any(not quick.get(room) for room in ALLOWED):
        listed = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not slow"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
        assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
        quick = _quick_tests_by_room(listed.stdout.splitlines())
    missing = sorted(room for room in ALLOWED if not quick.get(room))
    assert not missing, f"rooms with no test outside slow (the quick loop leaves them untested): {missing}"


# --------------------------------------------------------------------------- C++ (csrc/)
CSRC = ROOT / "csrc"
CSRC_FILES = sorted(p for ext in ("*.h", "*.cpp", "*.cu") for p in CSRC.rglob(ext))
# csrc folder -> the csrc folders its files may include (their own always). Only ops/ includes torch headers.
CSRC_ALLOWED: dict[str, set[str]] = {
    "include": set(),
    "common": {"include"},
    "cpu": {"include"},
    "kernels": {"include"},
    "ops": {"include", "cpu", "kernels"},
    "python": {"include", "cpu", "kernels"},
    "bench": {"include", "kernels", "python"},
}
TORCH_HEADER = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10)/', re.M)
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _csrc_folder(path: Path) -> str:
    return path.relative_to(CSRC).parts[0]


@pytest.mark.parametrize("path", CSRC_FILES, ids=lambda p: str(p.relative_to(CSRC)))
def test_csrc_includes_follow_the_rule(path):
    mine = _csrc_folder(path)
    assert mine in CSRC_ALLOWED, f"csrc/{mine}/ is not in the include rule (docs/architecture.md)"
    text = path.read_text()
    if mine != "ops":
        assert not TORCH_HEADER.search(text), f"{path.relative_to(ROOT)} includes a torch header; only csrc/ops/ may"
    for name in LOCAL_INCLUDE.findall(text):
        # The build's include path: the file's own folder, then csrc/include and csrc (setup.py).
        found = [c for c in (path.parent / name, CSRC / "include" / name, CSRC / name) if c.is_file()]
        assert found, f"{path.relative_to(ROOT)} includes {name}, which does not exist"
        theirs = _csrc_folder(found[0].resolve())
        allowed = sorted(CSRC_ALLOWED[mine])
        assert theirs == mine or theirs in allowed, (
            f"{path.relative_to(ROOT)} includes csrc/{theirs}/ ({name}); csrc/{mine}/ may include {allowed}"
        )


# Sources only a test builds, never the extension: the SM kernel compiled for the CPU
# (tests/core/test_sm_kernel_on_host.py), with its stand-in for the CUDA runtime.
HOST_SHIM = CSRC / "kernels" / "host_shim"


def test_setup_builds_every_csrc_source_and_no_other():
    named = set(re.findall(r'"(csrc/[\w/]+\.(?:cpp|cu))"', (ROOT / "setup.py").read_text()))
    sources = [p for p in CSRC_FILES if p.suffix in (".cpp", ".cu")]
    actual = {str(p.relative_to(ROOT)) for p in sources if HOST_SHIM not in p.parents}
    shim = {str(p.relative_to(ROOT)) for p in sources if HOST_SHIM in p.parents}
    assert not named - actual - shim, f"setup.py builds sources that do not exist: {sorted(named - actual - shim)}"
    assert not actual - named, f"setup.py does not build: {sorted(actual - named)}"
    assert not named & shim, f"setup.py builds the host shim, which is for a test only: {sorted(named & shim)}"
    assert "host_shim" not in (ROOT / "setup.py").read_text(), "the host shim must not be on the build's paths"
