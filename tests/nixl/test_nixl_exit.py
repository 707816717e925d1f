"""A process that used NIXL's UCX backend exits with status 0: docs/remote.md's example, run in a process of its
own (a DiskKVStore's and the vLLM disk tier's are checked beside their other tests). UCX's InfiniBand modules
are left out where this machine has no RDMA device (loaded there, they bring a second libnl-route that ends the
process in SIGSEGV at exit wherever the system's RDMA providers are installed), and a user's own UCX_MODULES is
what UCX runs with."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("nixl_cu13", reason="kvcopy.nixl needs the nixl extra (pip install 'kvcopy[nixl]')")

from kvcopy.nixl.agent import UCX_MODULES_WITHOUT_RDMA, ucx_modules_chosen

from helpers.docs import python_block
from helpers.exit_status import assert_ucx_modules_chosen_for_this_machine, run_python


@pytest.mark.slow
def test_the_remote_example_exits_with_status_0():
    code = python_block("docs/remote.md", 0, "## Peers")
    result = run_python(code)
    assert result.returncode == 0, result.described
    assert f"1 {32 << 20}" in result.stdout.splitlines()  # the example ran to its end: one descriptor, 32 MiB
    assert "ucx cma module loaded: True" in result.stdout  # the peers' UCX started, with its other modules
    assert_ucx_modules_chosen_for_this_machine(result)


@pytest.mark.slow
def test_a_users_own_ucx_modules_is_what_ucx_runs_with():
    # The user's choice leaves the InfiniBand modules out and cross-memory attach too: UCX read it, not kvcopy's.
    users = "^ib,rdmacm,cma"
    code = """
        from helpers.remote import make_pool
        from kvcopy.remote import KVPeer
        with KVPeer(make_pool("bf16", 4, "page_first", seed=3), "users-ucx-modules") as peer:
            print("descriptor bytes:", len(peer.descriptor()) > 0)
    """
    result = run_python(code, UCX_MODULES=users)
    assert result.returncode == 0, result.described
    assert "descriptor bytes: True" in result.stdout  # the peer's UCX agent started
    assert f"UCX_MODULES: {users}" in result.stdout, result.described
    assert "ucx cma module loaded: False" in result.stdout, result.described


# ucx_modules_chosen on its own: an environment and a device folder of the test's


def test_without_an_rdma_device_ucx_leaves_its_rdma_modules_out_said_once(tmp_path, caplog):
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    for devices in (empty, missing):
        environ: dict[str, str] = {}
        with caplog.at_level(logging.INFO, logger="kvcopy.nixl"):
            caplog.clear()
            assert ucx_modules_chosen(environ, devices) == UCX_MODULES_WITHOUT_RDMA
            assert ucx_modules_chosen(environ, devices) is None  # set already: the second agent changes nothing
        assert environ == {"UCX_MODULES": UCX_MODULES_WITHOUT_RDMA}
        said = [r.getMessage() for r in caplog.records if r.name == "kvcopy.nixl"]
        assert len(said) == 1 and str(devices) in said[0] and UCX_MODULES_WITHOUT_RDMA in said[0]


def test_with_an_rdma_device_ucx_keeps_its_rdma_modules(tmp_path, caplog):
    (tmp_path / "mlx5_0").mkdir()  # as /sys/class/infiniband lists a ConnectX port
    environ: dict[str, str] = {}
    with caplog.at_level(logging.INFO, logger="kvcopy.nixl"):
        assert ucx_modules_chosen(environ, tmp_path) is None
    assert environ == {} and not [r for r in caplog.records if r.name == "kvcopy.nixl"]


@pytest.mark.parametrize("users", ["^cma", "", "ib,cma"])
def test_a_users_own_ucx_modules_is_left_as_set(tmp_path, users):
    environ = {"UCX_MODULES": users}
    assert ucx_modules_chosen(environ, tmp_path / "missing") is None
    assert environ == {"UCX_MODULES": users}
