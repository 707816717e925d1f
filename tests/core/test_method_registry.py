"""The method registry: a method is one record, and every consumer (copy_blocks, the engine, "auto",
available_methods, the calibrator, the bench) finds it there. Proved with a toy method registered
for one test: a Python loop over blocks, written independently of kvcopy's methods."""

from __future__ import annotations

import pytest
import torch

import kvcopy
from kvcopy import methods
from kvcopy.calibration import local as calibrator
from kvcopy.methods import CopyMethod

from helpers.copies import assert_same_bytes, dst_bytes, fill_random_, make_layout, reference_copy, snapshot


def _toy_run(src, src_ids, dst, dst_ids, num_ctas):
    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        for src_plane, dst_plane in zip(src.planes, dst.planes, strict=True):
            dst_plane[d].copy_(src_plane[s])


@pytest.fixture
def toy():
    """A host-only toy method that "auto" prefers to everything (rank -1) for host-to-host copies."""
    calls = []

    def run(src, src_ids, dst, dst_ids, num_ctas):
        calls.append(src_ids.numel())
        _toy_run(src, src_ids, dst, dst_ids, num_ctas)

    method = CopyMethod(
        "toy",
        run=run,
        unavailable=lambda src, dst: None if src.device.type == dst.device.type == "cpu" else "host only",
        auto_rank=lambda src, dst: -1,
    )
    methods.register(method)
    try:
        yield calls
    finally:
        methods.unregister("toy")


def _pair(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kv = make_layout("vllm", 12, torch.bfloat16, gen, num_layers=2)
    pool = kvcopy.HostKVPool(kv, 10, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


def test_a_registered_method_is_listed_chosen_and_run(toy):
    kv, pool = _pair()
    assert "toy" in methods.method_names()
    assert kvcopy.available_methods(kv, pool)[-1] == "toy"
    src_ids, dst_ids = torch.tensor([4, 0, 7]), torch.tensor([9, 1, 2])
    expected = reference_copy(kv, src_ids, pool, dst_ids)
    kvcopy.copy_blocks(kv, src_ids, pool, dst_ids, method="toy")
    assert_same_bytes(dst_bytes(pool), expected)
    assert toy == [3]
    # "auto" ranks it first, also on the eager fast path's cached choice.
    expected = reference_copy(pool, [1, 2], kv, [5, 6])
    kvcopy.copy_blocks(pool, torch.tensor([1, 2]), kv, torch.tensor([5, 6]))
    assert_same_bytes(dst_bytes(kv), expected)
    assert toy == [3, 2]


def test_a_registered_method_keeps_every_check(toy):
    kv, pool = _pair(1)
    before = snapshot(pool)
    with pytest.raises(IndexError, match=r"dst_ids: expected ids in \[0, 10\), got 10"):
        kvcopy.copy_blocks(kv, [0], pool, [10], method="toy")
    with pytest.raises(ValueError, match="distinct destination ids"):
        kvcopy.copy_blocks(kv, [0, 1], pool, [3, 3], method="toy")
    assert_same_bytes(snapshot(pool), before)
    assert toy == []


def test_the_engine_and_the_calibrator_use_a_registered_method(toy):
    kv, pool = _pair(2)
    expected = reference_copy(kv, [3, 5], pool, [0, 8])
    with kvcopy.TransferEngine(kv, pool, method="toy") as engine:
        engine.offload([3, 5], [0, 8]).wait()
    assert_same_bytes(dst_bytes(pool), expected)
    assert toy == [2]
    assert "toy" in calibrator._methods_to_time(kv, pool.paged, None)


def test_a_method_that_cannot_run_says_why(toy):
    kv, _ = _pair(3)
    with pytest.raises(ValueError, match=r"'toy' cannot run for this pair \(host only\)"):
        kvcopy.copy_blocks(kv, [0], _device_like(kv), [0], method="toy")


def _device_like(kv):
    """A PagedKV whose device is not the CPU, without a GPU: the meta device."""
    return kvcopy.PagedKV(
        [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in kv.planes], planes_per_layer=kv.planes_per_layer
    )


def test_registering_twice_or_as_auto_is_refused(toy):
    with pytest.raises(ValueError, match="taken"):
        methods.register(CopyMethod("toy", run=_toy_run, unavailable=lambda s, d: None, auto_rank=lambda s, d: None))
    with pytest.raises(ValueError, match="taken"):
        methods.register(CopyMethod("auto", run=_toy_run, unavailable=lambda s, d: None, auto_rank=lambda s, d: None))
    with pytest.raises(TypeError, match="CopyMethod"):
        methods.register("toy2")  # type: ignore[arg-type]


def test_unregistering_forgets_the_method():
    method = CopyMethod("gone", run=_toy_run, unavailable=lambda s, d: None, auto_rank=lambda s, d: None)
    methods.register(method)
    methods.unregister("gone")
    kv, pool = _pair(4)
    with pytest.raises(ValueError, match="unknown method 'gone'"):
        kvcopy.copy_blocks(kv, [0], pool, [0], method="gone")


def test_builtin_records_say_what_the_docs_say():
    records = {m.name: m for m in methods.registry.methods()}
    assert tuple(records)[: len(kvcopy.METHODS)] == kvcopy.METHODS == ("torch", "cpu", "triton", "cuda", "copy_engine")
    assert {n for n, m in records.items() if m.capturable} == set(kvcopy.CAPTURABLE_METHODS) == {"cuda", "triton"}
    assert {n for n, m in records.items() if m.host_ids_only} == {"cpu", "copy_engine"}
    assert {n for n, m in records.items() if m.uses_sms} == {"cuda", "triton"}
