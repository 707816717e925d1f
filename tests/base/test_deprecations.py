"""Every name renamed in 0.2.0 still works under its old spelling, warns with a DeprecationWarning that names
the new one, and means exactly what the new one means (CHANGELOG.md lists them)."""

from __future__ import annotations

import json

import pytest
import torch

import kvcopy
from kvcopy import CostLine, ModelSpec, Planner
from kvcopy.profile import MethodProfile, PrefillProfile, Profile

LLAMA = ModelSpec.preset("llama-3.1-8b")
LOAD, FETCH, DISK = CostLine(20e-6, 50e9), CostLine(2e-4, 4e9), CostLine(1e-4, 3e9)


def _planner() -> Planner:
    return Planner(LLAMA, load=LOAD, prefill_flops_per_s=5e14, fetch=FETCH, disk=DISK)


def _profile() -> Profile:
    prefill = PrefillProfile(model="llama-3.1-8b", alpha_s=1e-3, flops_per_s=5e14, r2=1.0, num_layers=32)
    return Profile(hardware={"device": "cpu"}, directions={"h2h": {"cpu": MethodProfile(LOAD)}}, prefill=prefill)


def test_planner_cost_keywords_are_cost_lines():
    with pytest.deprecated_call() as said:
        old = Planner(
            LLAMA,
            load_alpha_s=LOAD.alpha_s,
            load_bytes_per_s=LOAD.beta_bytes_per_s,
            prefill_flops_per_s=5e14,
            fetch_alpha_s=FETCH.alpha_s,
            fetch_bytes_per_s=FETCH.beta_bytes_per_s,
            disk_alpha_s=DISK.alpha_s,
            disk_bytes_per_s=DISK.beta_bytes_per_s,
        )
    assert sorted(str(w.message).rpartition("use ")[2] for w in said) == [
        "Planner(disk=CostLine(...))",
        "Planner(fetch=CostLine(...))",
        "Planner(load=CostLine(...))",
    ]
    new = _planner()
    assert (old.load, old.fetch, old.disk) == (new.load, new.fetch, new.disk)
    for source in ("host", "peer", "disk"):
        assert old.decide(4096, 8, source=source) == new.decide(4096, 8, source=source)
    with pytest.deprecated_call(match="load_options"):
        options = Planner(LLAMA, load=LOAD, prefill_flops_per_s=5e14, load_options=[(1e-6, 1e9)])
    assert options.load_options == (LOAD, CostLine(1e-6, 1e9))
    with pytest.raises(TypeError, match="unexpected keyword"):
        Planner(LLAMA, load=LOAD, prefill_flops_per_s=5e14, load_rate=1.0)
    with pytest.deprecated_call(), pytest.raises(TypeError, match="not both"):
        Planner(LLAMA, load=LOAD, load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_flops_per_s=5e14)


def test_planner_cost_attributes_read_the_lines():
    p = _planner()
    expected = {
        "load_alpha_s": LOAD.alpha_s,
        "load_bytes_per_s": LOAD.beta_bytes_per_s,
        "fetch_alpha_s": FETCH.alpha_s,
        "fetch_bytes_per_s": FETCH.beta_bytes_per_s,
        "disk_alpha_s": DISK.alpha_s,
        "disk_bytes_per_s": DISK.beta_bytes_per_s,
    }
    for name, value in expected.items():
        with pytest.deprecated_call(match=f"Planner.{name}"):
            assert getattr(p, name) == value
    with pytest.deprecated_call():
        assert Planner(LLAMA, load=LOAD, prefill_flops_per_s=5e14).fetch_bytes_per_s is None


@pytest.mark.parametrize(("flag", "source"), [("from_peer", "peer"), ("from_disk", "disk")])
def test_from_peer_and_from_disk_are_source(flag, source):
    p = _planner()
    with pytest.deprecated_call(match='source="peer" | "disk"'):
        old = p.decide(4096, 8, **{flag: True})
    assert old == p.decide(4096, 8, source=source)
    with pytest.deprecated_call():
        assert p.threshold_tokens(8, **{flag: True}) == p.threshold_tokens(8, source=source)
    with pytest.deprecated_call():
        assert p.t_fetch_nbytes(1 << 26, **{flag: True}) == p.t_fetch_nbytes(1 << 26, source=source)
    with pytest.deprecated_call():
        assert p.decide(4096, 8, **{flag: False}) == p.decide(4096, 8)  # False: the prefix is here
    with pytest.deprecated_call(), pytest.raises(TypeError, match="not both"):
        p.decide(4096, 8, source="disk" if source == "peer" else "peer", **{flag: True})


def test_profile_links_are_directions(tmp_path):
    profile = _profile()
    with pytest.deprecated_call(match="Profile.directions"):
        assert profile.links is profile.directions
    with pytest.deprecated_call(match="directions="):
        old = Profile(hardware=profile.hardware, links=profile.directions, prefill=profile.prefill)
    assert old == profile
    mp = profile.directions["h2h"]["cpu"]
    with pytest.deprecated_call(match="line_at"):
        assert mp.link_at(4096) == mp.line_at(4096)
    with pytest.deprecated_call(match="CostLine"):
        from kvcopy.profile import LinkFit
    assert LinkFit is CostLine
    # A file written by 0.1 (format 1, "links") loads as the same profile.
    data = profile.to_dict()
    data["format"], data["links"] = 1, data.pop("directions")
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Profile.load(tmp_path / "old.json") == profile


def test_fastest_method_is_best_method():
    profile = Profile(
        hardware={"calibration_planes": 2},
        directions={"h2h": {"cpu": MethodProfile(CostLine(1e-6, 1e9)), "torch": MethodProfile(CostLine(1e-3, 9e9))}},
    )
    for nbytes in (4096, 1 << 30):
        with pytest.deprecated_call(match="best_method"):
            old = profile.fastest_method("h2h", nbytes, nbytes / 2)
        assert old == profile.best_method("h2h", nbytes, 1, planes=2)
    assert profile.best_method("h2h", 4096, 1) == "cpu" and profile.best_method("h2h", 1 << 30, 1) == "torch"


def test_engine_names(gen):
    kv = kvcopy.PagedKV([torch.zeros(4, 8, dtype=torch.uint8)])
    pool = kvcopy.HostKVPool(kv, 2, pin_memory=False)
    with pytest.deprecated_call(match="plane_block_nbytes"):
        assert kv.block_nbytes == kv.plane_block_nbytes
    with pytest.deprecated_call(match="num_ctas"):
        engine = kvcopy.TransferEngine(kv, pool, sm_budget=3)
    with engine:
        assert engine.num_ctas == 3
        transfer = engine.offload([1], [0])
        transfer.wait()
        with pytest.deprecated_call(match="profile_direction"):
            assert transfer.link == transfer.profile_direction == "h2h"
    with pytest.deprecated_call(), pytest.raises(TypeError, match="not both"):
        kvcopy.TransferEngine(kv, pool, sm_budget=3, num_ctas=3)


def test_module_names():
    with pytest.deprecated_call(match="HOST_MEMORY_CTA_BUDGET"):
        from kvcopy.methods import HOST_LINK_CTA_BUDGET
    assert HOST_LINK_CTA_BUDGET == kvcopy.methods.HOST_MEMORY_CTA_BUDGET
    with pytest.deprecated_call(match="kvcopy.online.OnlineProfile"):
        from kvcopy.policy import OnlineProfile
    assert OnlineProfile is kvcopy.OnlineProfile
    with pytest.deprecated_call():
        assert kvcopy.policy.OnlineProfile is kvcopy.OnlineProfile
    with pytest.raises(AttributeError):
        kvcopy.policy.Planner  # noqa: B018 - never was in kvcopy.policy


@pytest.mark.parametrize(
    "module",
    ["kvcopy", "kvcopy.remote", "kvcopy.storage", "kvcopy.integrations.transformers", "kvcopy.integrations.vllm"],
)
def test_every_public_name_imports(module):
    """What engines import: every name in these modules' __all__ resolves, without a deprecation warning."""
    imported = __import__(module, fromlist=["__all__"])
    assert imported.__all__
    for name in imported.__all__:
        assert getattr(imported, name) is not None, f"{module}.{name}"
