"""A script run in a Python process of its own, to see how that process ends: its exit status (a process that
used NIXL's UCX backend once ended in SIGSEGV at exit) and what UCX loaded in it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from helpers import SUBPROCESS_TIMEOUT_S
from helpers.docs import ROOT

TESTS = str(ROOT / "tests")
# Appended to each script: what UCX loaded (its InfiniBand and cross-memory-attach modules mapped or not) and
# UCX_MODULES as the process left it, read by the tests from its output.
LOADED_REPORT = """
import os as _os
_maps = open("/proc/self/maps").read()
print("ucx ib module loaded:", "libuct_ib" in _maps)
print("ucx cma module loaded:", "libuct_cma" in _maps)
print("UCX_MODULES:", _os.environ.get("UCX_MODULES"))
"""


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` (dedented, then LOADED_REPORT) in a new Python process at the repository root, with tests/ on
    its path, under this environment without UCX_MODULES, plus ``env``. The result's ``described`` says how it
    ended, for an assertion's message."""
    environ = {name: value for name, value in os.environ.items() if name != "UCX_MODULES"}
    script = f"import sys\nsys.path.insert(0, {TESTS!r})\n{textwrap.dedent(code)}\n{LOADED_REPORT}"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    crashed = " (SIGSEGV: a shell says 139)" if result.returncode == -signal.SIGSEGV else ""
    result.described = (
        f"exit {result.returncode}{crashed}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )
    return result


def assert_ucx_modules_chosen_for_this_machine(result: subprocess.CompletedProcess) -> None:
    """Where this machine has no RDMA device, the process ran UCX without its InfiniBand module; where it has,
    kvcopy left UCX_MODULES unset."""
    from kvcopy.nixl.agent import RDMA_DEVICES, UCX_MODULES_WITHOUT_RDMA

    described = result.described
    if RDMA_DEVICES.is_dir() and any(RDMA_DEVICES.iterdir()):
        assert "UCX_MODULES: None" in result.stdout, described
    else:
        assert f"UCX_MODULES: {UCX_MODULES_WITHOUT_RDMA}" in result.stdout, described
        assert "ucx ib module loaded: False" in result.stdout, described
