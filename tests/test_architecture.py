"""The layering docs/architecture.md describes, checked on the source: the copy core never imports
kvcopy.policy, .remote, .storage, .tools or .integrations; each room imports only the rooms below it;
no Python file is longer than the size the docs promise."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvcopy"
# The rooms, lowest first; a module may import its own room and the ones below it.
LAYERS = ("core", "policy", "remote", "storage", "tools", "integrations")
MAX_LINES = 400  # docs/architecture.md: a file holds one concern


def _room(module: str) -> str:
    """ "kvcopy.model.spec" -> "policy"; the package facade (kvcopy/__init__.py) is its own room."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "core"


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def _imports(module: str, path: Path) -> set[str]:
    """Every kvcopy module ``module`` imports, at top level or inside functions."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names] if not node.module or node.level else []
            found.update(n for n in [target, *names] if n.startswith("kvcopy"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvcopy"))
    return found


@pytest.mark.parametrize(("module", "path"), _modules(), ids=lambda v: str(v) if isinstance(v, str) else "")
def test_imports_point_down(module, path):
    if module in ("kvcopy", "kvcopy.__main__"):
        return  # the facade re-exports every room's public names; `python -m kvcopy` runs the CLI
    mine = LAYERS.index(_room(module))
    for target in _imports(module, path):
        theirs = _room(target)
        assert LAYERS.index(theirs) <= mine or theirs == _room(module), f"{module} imports {target} ({theirs})"


@pytest.mark.parametrize(("module", "path"), _modules(), ids=lambda v: str(v) if isinstance(v, str) else "")
def test_files_stay_small(module, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES})"
