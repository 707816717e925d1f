"""Planner: a prefix in the disk store (read into the host pool and reloaded, pipelined) against recomputing
it: ``decide(..., source="disk")``, ``threshold_tokens(source="disk")``, the disk link from a profile's
``f2h`` fits, and ``kvcopy plan --from-disk``. Expected values from the stage formulas, by brute force."""

from __future__ import annotations

import math

import pytest

import kvcopy
from kvcopy import Planner
from kvcopy.planner.pipeline import MAX_PIPELINE_CHUNKS
from kvcopy.profile import DISK_READ_DIRECTION, CostLine, MethodProfile, PrefillProfile, Profile

LLAMA = kvcopy.ModelSpec.preset("llama-3.1-8b")
BLOCK = LLAMA.block_nbytes(16)


def planner(*, da=100e-6, db=6e9, **kw) -> Planner:
    """An NVMe disk (6 GB/s, 100 us a read), PCIe Gen5 reloads (50 GB/s, 20 us), 500 TFLOP/s prefill."""
    return Planner(
        LLAMA,
        load=CostLine(20e-6, 50e9),
        prefill_flops_per_s=5e14,
        weight_bytes_per_s=4.8e12,
        disk=CostLine(da, db),
        **kw,
    )


def expected_disk(p: Planner, nbytes: int) -> float:
    blocks = math.ceil(nbytes / BLOCK)
    best = math.inf
    for k in (2**i for i in range(20)):
        if k > min(blocks, MAX_PIPELINE_CHUNKS):
            break
        read = p.disk.alpha_s + nbytes / k / p.disk.beta_bytes_per_s
        load = p.load.alpha_s + nbytes / k / p.load.beta_bytes_per_s
        best = min(best, read + max(read, load) * (k - 1) + load)
    return best


@pytest.mark.parametrize("prefix", [1, 64, 1024, 16384])
def test_a_prefix_on_disk_is_read_and_reloaded_or_recomputed(prefix):
    p = planner(layerwise=True)
    d = p.decide(prefix, 8, source="disk")
    assert d.t_reload is None and d.t_layerwise is None
    assert d.t_fetch == pytest.approx(expected_disk(p, LLAMA.kv_bytes(prefix)) + p.t_prefill(8, prefix))
    assert d.action in ("fetch", "split", "recompute")
    if d.action == "fetch":
        assert "fetch from the disk (disk read and reload" in d.explanation


@pytest.mark.slow
def test_the_disk_threshold_is_where_reading_starts_to_win_by_brute_force():
    p = planner(da=5e-3)  # a slow disk: a few ms a read
    limit = 8192
    threshold = p.threshold_tokens(max_tokens=limit, source="disk")
    wins = [p.decide(n, source="disk").action != "recompute" for n in range(1, limit + 1)]
    expected = next(n for n in range(limit, 0, -1) if not wins[n - 1]) + 1 if not all(wins) else 1
    assert threshold == expected
    assert threshold > p.threshold_tokens(max_tokens=limit)  # from host RAM, keeping pays earlier


def test_without_a_disk_line_a_disk_source_is_a_value_error_naming_it():
    p = Planner(LLAMA, load=CostLine(20e-6, 50e9), prefill_flops_per_s=5e14)
    with pytest.raises(ValueError, match=r'source="disk": .*no disk cost line.*calibrate --disk'):
        p.decide(1024, source="disk")
    with pytest.raises(ValueError, match="source: expected one of"):
        planner().decide(1024, source="tape")
    with pytest.deprecated_call(), pytest.raises(ValueError, match=r"from_peer / from_disk: .*not both"):
        planner().decide(1024, from_peer=True, from_disk=True)
    with pytest.deprecated_call(), pytest.raises(ValueError, match="disk_alpha_s / disk_bytes_per_s: expected both"):
        Planner(LLAMA, load=CostLine(0, 1e9), prefill_flops_per_s=1e14, disk_alpha_s=1e-4)


def test_from_profile_reads_the_disk_at_a_block_s_range_size():
    fit = CostLine(alpha_s=1e-4, beta_bytes_per_s=3e9, r2=1.0, max_abs_residual=0.0)
    other = CostLine(alpha_s=9e-3, beta_bytes_per_s=1e8, r2=1.0, max_abs_residual=0.0)
    load = CostLine(alpha_s=1e-5, beta_bytes_per_s=20e9, r2=1.0, max_abs_residual=0.0)
    profile = Profile(
        hardware={"device": "cpu"},
        directions={
            "h2h": {"cpu": MethodProfile(fit=load)},
            DISK_READ_DIRECTION: {"nixl_posix": MethodProfile(fit=other, by_block_nbytes={BLOCK: fit})},
        },
        prefill=PrefillProfile(model="llama-3.1-8b", alpha_s=0.0, flops_per_s=1e13, r2=1.0),
    )
    p = Planner.from_profile(profile, LLAMA)
    assert (p.disk.alpha_s, p.disk.beta_bytes_per_s) == (1e-4, 3e9)  # the fit at one page-first block's size
    assert Planner.from_profile(profile, LLAMA).decide(4096, source="disk").t_fetch is not None


def _profile_with_disk(disk: bool) -> Profile:
    load = CostLine(alpha_s=1e-5, beta_bytes_per_s=20e9, r2=1.0, max_abs_residual=0.0)
    links = {"h2h": {"cpu": MethodProfile(fit=load)}}
    if disk:
        read = CostLine(alpha_s=2e-4, beta_bytes_per_s=2e9, r2=0.99, max_abs_residual=0.1)
        links[DISK_READ_DIRECTION] = {"nixl_posix": MethodProfile(fit=read)}
    hardware = {"device": "cpu", "device_name": "test", **({"disk": "/data (ext4; O_DIRECT)"} if disk else {})}
    prefill = PrefillProfile(model="llama-3.1-8b", alpha_s=0.0, flops_per_s=1e12, r2=1.0)
    return Profile(hardware=hardware, directions=links, prefill=prefill)


@pytest.mark.slow
def test_plan_from_disk_prints_the_disk_read_against_recompute(tmp_path, capsys):
    from kvcopy.tools import cli

    path = tmp_path / "profile.json"
    _profile_with_disk(True).save(path)
    plot = tmp_path / "plan.png"
    args = ["plan", "--model", "llama-3.1-8b", "--profile", str(path), "--prefix", "4096", "--from-disk"]
    assert cli.main([*args, "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "4096 tokens in a disk store (/data (ext4; O_DIRECT))" in printed
    options = [line.lstrip(" *").split()[0] for line in printed.splitlines() if line.startswith("  ")]
    assert options == ["fetch", "split", "recompute"]  # no reload from host RAM: the prefix is on disk
    assert "read it from the disk and reload it" in printed
    assert printed.split("decision: ")[1].split()[0] in ("fetch", "split")  # 1 TFLOP/s prefill: keeping wins
    assert "threshold: " in printed and plot.read_bytes().startswith(b"\x89PNG")


def test_plan_from_disk_without_disk_measurements_is_a_user_error(tmp_path, capsys):
    from kvcopy.tools import cli

    path = tmp_path / "profile.json"
    _profile_with_disk(False).save(path)
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--profile", str(path), "--from-disk"]) == 2
    assert "--from-disk: the profile has no disk measurements" in capsys.readouterr().err
