"""TransferEngine and Transfer given wrong arguments: a typed error naming the argument, and nothing changed. A
wait given a bad timeout leaves its transfer running (a later wait() completes it, bytes exact); a transfer
that failed says so on every later wait, never returning as if it had succeeded (issue #32: "a retry that
returns a corrupt block as valid")."""

from __future__ import annotations

import math

import pytest
import torch

import kvcopy
import kvcopy.engine.engine as engine_module
from kvcopy import dispatch
from kvcopy.engine.engine import engine_method
from kvcopy.methods.choice import available_methods

from helpers.copies import assert_same_bytes, dst_bytes, fill_random_, make_layout, reference_copy, snapshot

BAD_TIMEOUTS = [
    pytest.param(-1, ValueError, id="negative"),
    pytest.param(-0.5, ValueError, id="negative-float"),
    pytest.param(math.nan, ValueError, id="nan"),
    pytest.param(math.inf, ValueError, id="inf"),
    pytest.param(10**400, ValueError, id="huge-int"),
    pytest.param("x", TypeError, id="str"),
    pytest.param(True, TypeError, id="bool"),
    pytest.param([1], TypeError, id="list"),
]


def _setup(num_layers: int = 2):
    gen = torch.Generator().manual_seed(0)
    kv = make_layout("vllm", 8, torch.bfloat16, gen, num_layers=num_layers)
    pool = kvcopy.HostKVPool(kv, 6, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
def test_a_bad_timeout_changes_nothing(engines, monkeypatch, timeout, error):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)  # the copy is held in flight until the gate opens
    expected = reference_copy(kv, [1, 2], pool, [3, 4])
    transfer = eng.offload([1, 2], [3, 4])
    gate.wait_held()
    for _ in range(2):  # and again: still nothing changes
        with pytest.raises(error, match="timeout"):
            transfer.wait(timeout=timeout)
        assert not transfer.done()
        assert eng.num_in_flight == 1
    gate.open()
    transfer.wait()  # completes normally, bytes exact
    assert transfer.done() and eng.num_in_flight == 0
    assert_same_bytes(dst_bytes(pool), expected)


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS[:3] + BAD_TIMEOUTS[5:6])
def test_a_bad_timeout_on_a_finished_transfer_is_still_refused(engines, timeout, error):
    kv, pool = _setup()
    transfer = engines(kv, pool).offload([0], [0])
    transfer.wait()
    with pytest.raises(error, match="timeout"):
        transfer.wait(timeout)
    transfer.wait(0)  # a good timeout on a finished transfer returns at once


def test_a_failed_transfer_raises_on_every_later_wait(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch, hold=lambda src, dst: False)
    gate.fail = lambda src, dst: RuntimeError("the copy broke")
    before = snapshot(pool)
    transfer = eng.offload([1, 2], [3, 4])
    with pytest.raises(TypeError, match="timeout"):  # an argument error says nothing of the transfer
        transfer.wait("soon")
    for timeout in (None, 0, 5.0, None):
        with pytest.raises(RuntimeError, match="the copy broke"):
            transfer.wait(timeout)
        assert transfer.done()  # done, and wait() says it failed
    with pytest.raises(RuntimeError, match="the copy broke"):
        transfer.wait_stream()
    assert_same_bytes(snapshot(pool), before)


def test_wait_layer_and_wait_stream_check_their_arguments(engines):
    kv, pool = _setup(num_layers=2)
    transfer = engines(kv, pool).reload([0], [1], layerwise=True)
    for layer in ("0", 0.0, True, None):
        with pytest.raises(TypeError, match="layer"):
            transfer.wait_layer(layer)
    for stream in ("x", 0, object()):
        with pytest.raises(TypeError, match="stream"):
            transfer.wait_stream(stream)
        with pytest.raises(TypeError, match="stream"):
            transfer.wait_layer(0, stream)
    with pytest.raises(IndexError, match="layer"):
        transfer.wait_layer(2)
    transfer.wait()


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        pytest.param({"method": 1}, TypeError, "method", id="method-int"),
        pytest.param({"method": None}, TypeError, "method", id="method-none"),
        pytest.param({"profile": "fast"}, TypeError, "profile", id="profile-str"),
        pytest.param({"debug": "no"}, TypeError, "debug", id="debug-str"),
        pytest.param({"debug": 1}, TypeError, "debug", id="debug-int"),
        pytest.param({"num_ctas": 4.0}, TypeError, "num_ctas", id="num-ctas-float"),
        pytest.param({"observer": 5}, TypeError, "observer", id="observer-int"),
    ],
)
def test_engine_arguments(kwargs, error, name):
    kv, pool = _setup()
    with pytest.raises(error, match=f"^{name}"):
        kvcopy.TransferEngine(kv, pool, **kwargs)


def test_layerwise_is_a_bool(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    before = snapshot(kv)
    for layerwise in ("no", 1, None):
        with pytest.raises(TypeError, match="layerwise"):
            eng.reload([0], [1], layerwise=layerwise)
    assert eng.num_in_flight == 0 and gate.num_calls == 0
    assert_same_bytes(snapshot(kv), before)


def test_an_engine_over_a_meta_cache_is_refused():
    kv, pool = _setup()
    meta = kvcopy.PagedKV.from_planes([p.to("meta") for p in kv.planes], planes_per_layer=kv.planes_per_layer)
    with pytest.raises(ValueError, match=r"^kv: .*meta"):
        kvcopy.TransferEngine(meta, pool)


# ----------------------------------------------------------------------------- "torch" in a CUDA engine
# The engine's method choice is tested with cuda=True on host tensors: which method a CUDA engine may run
# does not depend on where these test tensors live, only on the rule (issue #33, finding 12).


def _pair():
    kv, pool = _setup()
    return kv, pool.paged


def test_a_cuda_engine_refuses_the_torch_method_naming_why():
    kv, host = _pair()
    for src, dst in ((kv, host), (host, kv)):
        with pytest.raises(ValueError, match=r"method: 'torch' cannot run in a CUDA TransferEngine: .*blocks"):
            engine_method("torch", src, dst, cuda=True, host_ids=True)
    assert engine_method("torch", kv, host, cuda=False, host_ids=True).name == "torch"  # the CPU engine's worker
    kvcopy.TransferEngine(kv, kvcopy.HostKVPool(kv, 6, pin_memory=False), method="torch").close()


def test_auto_in_a_cuda_engine_never_falls_back_to_torch(monkeypatch):
    kv, host = _pair()
    # "auto" as a profile that measured torch fastest would choose: torch whenever it is a candidate
    monkeypatch.setattr(dispatch, "choose_method", lambda src, dst, available, **_: available[0])
    monkeypatch.setattr(engine_module, "choose_method", lambda src, dst, available, **_: available[0])
    assert available_methods(kv, host)[0] == "torch"  # torch is listed first, so the stand-in picks it
    assert engine_method("auto", kv, host, cuda=False, host_ids=True).name == "torch"
    chosen = engine_method("auto", kv, host, cuda=True, host_ids=True)
    assert chosen.name != "torch" and chosen.name in available_methods(kv, host)


def test_auto_in_a_cuda_engine_with_only_torch_is_a_clear_error(monkeypatch):
    kv, host = _pair()
    monkeypatch.setattr(dispatch, "available_methods", lambda src, dst: ["torch"])
    monkeypatch.setattr(engine_module, "available_methods", lambda src, dst: ["torch"])
    with pytest.raises(ValueError, match=r"method: 'auto' found no copy method for a CUDA TransferEngine but 'torch'"):
        engine_method("auto", kv, host, cuda=True, host_ids=True)


# ----------------------------------------------------------------------------- eager transfers beside a capture
# While another thread captures the engine's transfers (global capture mode), staging host ids on the GPU goes
# through torch's pinned-memory allocator, whose event queries invalidate the capture (an H200, 2026-12-04).
# The rule is tested with cuda=True on host tensors, the methods that can run stood in for as above;
# tests/engine/test_engine_gpu.py runs it beside a real capture.

_GPU_METHODS = ["torch", "triton", "cuda", "copy_engine"]  # what a pinned pool beside a GPU cache can run


@pytest.mark.parametrize("method", ["auto", "cuda", "triton"])
def test_an_eager_transfer_beside_a_capture_does_not_stage_its_host_ids(monkeypatch, method):
    kv, host = _pair()
    monkeypatch.setattr(dispatch, "available_methods", lambda src, dst: _GPU_METHODS)
    monkeypatch.setattr(engine_module, "available_methods", lambda src, dst: _GPU_METHODS)
    # "auto" as for small plane-blocks without a profile: the SM kernel, which stages host ids
    monkeypatch.setattr(dispatch, "choose_method", lambda src, dst, available, **_: "cuda")
    for src, dst in ((kv, host), (host, kv)):
        alone = engine_method(method, src, dst, cuda=True, host_ids=True)
        assert alone.stages_ids and alone.name == ("cuda" if method == "auto" else method)
        beside = engine_method(method, src, dst, cuda=True, host_ids=True, beside_capture=True)
        assert beside.name == "copy_engine" and not beside.stages_ids
        # ids already on the GPU are not staged: the method stays
        assert engine_method(method, src, dst, cuda=True, host_ids=False, beside_capture=True) is alone
        # without a capture in progress nothing changes
        assert engine_method(method, src, dst, cuda=True, host_ids=True, beside_capture=False) is alone


def test_beside_a_capture_a_method_that_stages_nothing_stays(monkeypatch):
    kv, host = _pair()
    monkeypatch.setattr(dispatch, "available_methods", lambda src, dst: _GPU_METHODS)
    monkeypatch.setattr(engine_module, "available_methods", lambda src, dst: _GPU_METHODS)
    chosen = engine_method("copy_engine", kv, host, cuda=True, host_ids=True, beside_capture=True)
    assert chosen.name == "copy_engine"
    # where the copy engines cannot run, the method chosen runs as it would (nothing better to do)
    monkeypatch.setattr(engine_module, "available_methods", lambda src, dst: ["torch", "cuda"])
    monkeypatch.setattr(dispatch, "available_methods", lambda src, dst: ["torch", "cuda"])
    assert engine_method("cuda", kv, host, cuda=True, host_ids=True, beside_capture=True).name == "cuda"
