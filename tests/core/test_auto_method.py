"""``method="auto"`` consulting a Profile: choose_method, the default profile steering copy_blocks, gather and
scatter, and a TransferEngine's own profile (over the default one). Synthetic profiles (helpers.profiles)
make one method clearly faster."""

from __future__ import annotations

import pytest
import torch

import kvcopy
from kvcopy import _ext
from kvcopy.methods import available_methods, choose_method

from helpers.copies import assert_same_bytes, byte_rows, dst_bytes, fill_random_, make_layout, reference_copy, snapshot
from helpers.profiles import synthetic_profile


def _cpu_pair(seed=0, num_blocks=10, host_blocks=12):
    gen = torch.Generator().manual_seed(seed)
    kv = make_layout("vllm", num_blocks, torch.bfloat16, gen)
    pool = kvcopy.HostKVPool(kv, host_blocks, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


@pytest.fixture
def record_methods(monkeypatch):
    """The methods kvcopy.dispatch.run is called with (the real copy still runs)."""
    seen: list[str] = []
    real = kvcopy.dispatch.run

    def run(method, src, src_ids, dst, dst_ids, num_ctas=None):
        seen.append(method.name)
        real(method, src, src_ids, dst, dst_ids, num_ctas)

    monkeypatch.setattr(kvcopy.dispatch, "run", run)
    return seen


def test_choose_method_follows_the_profile():
    kv, pool = _cpu_pair()
    available = available_methods(kv, pool.paged)
    default = choose_method(kv, pool.paged, available, host_ids=True, num_blocks=4)
    assert default == ("cpu" if _ext.has_cpu_kernels() else "torch")
    chosen = choose_method(kv, pool.paged, available, host_ids=True, num_blocks=4, profile=synthetic_profile("torch"))
    assert chosen == "torch"
    if _ext.has_cpu_kernels():
        assert (
            choose_method(
                kv, pool.paged, available, host_ids=True, num_blocks=4, profile=synthetic_profile("cpu", "torch")
            )
            == "cpu"
        )
    # A profile that did not measure this direction: the documented defaults.
    other = synthetic_profile("torch", "cpu", direction="d2h")
    assert choose_method(kv, pool.paged, available, host_ids=True, num_blocks=4, profile=other) == default


def test_choose_method_ignores_measured_methods_that_cannot_run():
    kv, pool = _cpu_pair()
    available = available_methods(kv, pool.paged)
    p = synthetic_profile("copy_engine", "torch")  # fastest measured, but not for a CPU pair
    assert choose_method(kv, pool.paged, available, host_ids=True, profile=p) == "torch"
    # "cpu" reads host ids: with device ids it is not a candidate.
    if _ext.has_cpu_kernels():
        p = synthetic_profile("cpu", "torch")
        assert choose_method(kv, pool.paged, available, host_ids=False, profile=p) == "torch"


def test_default_profile_steers_auto_copies(restore_default_profile, record_methods):
    kv, pool = _cpu_pair(seed=1)
    src_ids, dst_ids = [3, 0, 7, 7, 9], [11, 2, 5, 0, 8]
    kvcopy.set_default_profile(synthetic_profile("torch"))
    try:
        expected = reference_copy(kv, src_ids, pool, dst_ids)
        before = snapshot(kv)
        kvcopy.copy_blocks(kv, src_ids, pool, dst_ids, method="auto")
        assert_same_bytes(dst_bytes(pool), expected)
        assert_same_bytes(snapshot(kv), before)
        assert record_methods == ["torch"]
        # gather / scatter go through the same "auto".
        expected = reference_copy(pool, [1, 4], kv, [6, 2])
        kvcopy.copy_blocks(pool, [1, 4], kv, [6, 2])
        assert_same_bytes(dst_bytes(kv), expected)
        assert record_methods == ["torch", "torch"]
    finally:
        kvcopy.set_default_profile(None)
    # Without the profile: the default again (KVCOPY_PROFILE=none in conftest).
    record_methods.clear()
    kvcopy.copy_blocks(kv, [0], pool, [0], method="auto")
    assert record_methods == ["cpu" if _ext.has_cpu_kernels() else "torch"]


def test_engine_uses_its_profile(record_methods):
    kv, pool = _cpu_pair(seed=2)
    original = snapshot(kv)
    p = synthetic_profile("torch")
    with kvcopy.TransferEngine(kv, pool, profile=p) as eng:
        assert eng.profile is p
        block_ids, host_ids = [1, 5, 9, 0], [10, 3, 7, 0]
        expected_host = reference_copy(kv, block_ids, pool, host_ids)
        eng.offload(block_ids, host_ids).wait()
        assert_same_bytes(dst_bytes(pool), expected_host)
        targets = [2, 4, 6, 8]
        expected_dev = reference_copy(pool, host_ids, kv, targets)
        t = eng.reload(host_ids, targets, layerwise=True)
        t.wait()
        assert_same_bytes(dst_bytes(kv), expected_dev)
    for src, dst in zip(block_ids, targets, strict=True):  # bitwise round trip
        for p_i, plane in enumerate(kv.planes):
            assert torch.equal(byte_rows(plane)[dst], original[p_i][src])
    assert record_methods and set(record_methods) == {"torch"}


def test_engine_profile_beats_the_default_profile(restore_default_profile, record_methods):
    if not _ext.has_cpu_kernels():
        pytest.skip("needs the compiled CPU kernels for a second method")
    kvcopy.set_default_profile(synthetic_profile("torch", "cpu"))
    kv, pool = _cpu_pair(seed=3)
    with kvcopy.TransferEngine(kv, pool, profile=synthetic_profile("cpu", "torch")) as eng:
        eng.offload([0, 1], [0, 1]).wait()
    assert set(record_methods) == {"cpu"}
