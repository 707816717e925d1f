"""kvcopy.tools.bench: config validation, the runner on tiny CPU points, its correctness check, baselines and reports.

One tiny run (llama8b-16 at 2 blocks, a two-point count sweep, a one-point
size sweep, the fixed-cost point, one repeat) serves the tests of rows, tables, CSV and plot; the
reports are also checked on hand-made rows with exact times.
"""

from __future__ import annotations

import csv
import functools
import math
import re

import pytest
import torch

import kvcopy
from kvcopy.calibration.machine import machine_identity
from kvcopy.profile import CostLine, MethodProfile, Profile
from kvcopy.tools.bench import (
    CSV_COLUMNS,
    IDENTITY_COLUMNS,
    LIMIT,
    WORKLOADS,
    BenchConfig,
    BenchRow,
    check_output,
    format_tables,
    num_points,
    read_csv,
    run_benchmarks,
    with_ratios,
    write_csv,
)
from kvcopy.tools.bench.baselines import per_block_copy_loop, per_layer_index_loop
from kvcopy.tools.bench.report import MEASURED_COLUMNS
from kvcopy.tools.bench.runner import AUTO, PER_BLOCK_LOOP, PER_BLOCK_MEMCPY, PER_LAYER_LOOP
from kvcopy.tools.bench.runner import _cache_and_pool as runner_cache_and_pool
from kvcopy.tools.bench.workloads import BIG_CACHE_BYTES, ONE_PLANE_32K, TINY_PLANES, Workload

from helpers import HAS_CUDA
from helpers.copies import assert_same_bytes, dst_bytes, fill_random_, make_layout, reference_copy, snapshot

CPU = torch.device("cpu")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DIRECTIONS = ("gather", "scatter")
SUITES = ("workloads", "count_sweep", "size_sweep", "fixed_cost")
CPU_ROW_METHODS = {LIMIT, "kvcopy cpu", PER_LAYER_LOOP, PER_BLOCK_LOOP}
TINY = dict(
    device=CPU,
    workloads=("llama8b-16",),
    blocks=2,
    counts=(1, 2),
    block_tokens=(1,),
    sweep_blocks=2,
    repeats=1,
    warmup=0,
)


def _link(alpha_s: float, beta: float) -> CostLine:
    return CostLine(alpha_s=alpha_s, beta_bytes_per_s=beta, r2=1.0, max_abs_residual=0.0)


# Per-size fits, so a prediction depends on the plane count passed (the plane-block size), not only on bytes.
PROFILE = Profile(
    hardware={"device": "cpu", "device_name": "hand-made", "calibration_planes": 2},
    directions={
        "h2h": {"cpu": MethodProfile(_link(20e-6, 4e9), {2048: _link(10e-6, 1e9), 65536: _link(30e-6, 8e9)}, [])}
    },
)


@pytest.fixture(scope="module")
def tiny():
    """(config, rows, rows handed to on_point per call) of the tiny run, with PROFILE's predictions."""
    config = BenchConfig(**TINY)
    seen: list[list[BenchRow]] = []
    rows = run_benchmarks(config, profile=PROFILE, on_point=seen.append)
    return config, rows, seen


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(workloads=("llama8b-16", "nope")), "workloads"),
        (dict(ids="zigzag"), "ids"),
        (dict(blocks=0), "blocks"),
        (dict(sweep_blocks=-1), "sweep_blocks"),
        (dict(repeats=0), "repeats"),
        (dict(counts=(1, 0)), "counts"),
        (dict(counts=(4, 4)), "counts"),
        (dict(block_tokens=(0,)), "block_tokens"),
        (dict(block_tokens=(2, 1, 2)), "block_tokens"),
        (dict(warmup=-1), "warmup"),
    ],
)
def test_config_rejects_bad_fields(overrides, field):
    with pytest.raises(ValueError, match=field):
        BenchConfig(device=CPU, **overrides)


def test_default_quick_config_is_small():
    config = BenchConfig.default("cpu", quick=True)
    assert config.device == CPU
    # every workload but those with a cache of their own size (gigabytes), which run when named
    assert set(config.workloads) == {name for name, w in WORKLOADS.items() if w.cache_bytes is None}
    assert "llama8b-big-4" in WORKLOADS and "llama8b-big-4" not in config.workloads
    assert "llama8b-big-4" in BenchConfig.default("cpu", quick=True, workloads=("llama8b-big-4",)).workloads
    assert set(BenchConfig.default("cpu").workloads) == set(WORKLOADS)
    assert config.blocks <= 16 and max(config.counts) <= 16 and config.sweep_blocks <= 8 and config.repeats <= 2
    assert BenchConfig.default("cpu", quick=True, blocks=3).blocks == 3  # overrides win
    assert BenchConfig.default("cpu").blocks > config.blocks


@pytest.mark.skipif(HAS_CUDA, reason="checks the error without a CUDA device")
def test_default_cuda_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="device"):
        BenchConfig.default(device="cuda")


def test_default_rejects_other_device_types():
    with pytest.raises(ValueError, match="device"):
        BenchConfig.default(device="meta")


def test_big_cache_workload_is_64_planes_of_64_mib():
    workload = WORKLOADS["llama8b-big-4"]
    one = workload.build(1, CPU)
    assert (one.num_planes, one.nbytes_per_block // one.num_planes) == (64, 8 * 1024)
    assert workload.cache_bytes == BIG_CACHE_BYTES == 64 * (64 << 20)


def test_the_runner_keeps_a_workloads_own_cache_size():
    # One plane of 1 MiB blocks, never touched (torch.empty): by the blocks it moves, a 2-block call gets
    # a cache of 2 x 64 blocks (room for calls that cycle over COLD_BYTES = 64 MiB); cache_bytes asks for more.
    def build(num_blocks: int, device: torch.device) -> kvcopy.PagedKV:
        return kvcopy.PagedKV([torch.empty((num_blocks, 1 << 20), dtype=torch.uint8, device=device)])

    kv, host = runner_cache_and_pool(Workload("plain", "", build), 2, CPU)
    assert (kv.num_blocks, host.num_blocks) == (128, 64)
    kv, host = runner_cache_and_pool(Workload("big", "", build, cache_bytes=200 << 20), 2, CPU)
    assert (kv.num_blocks, host.num_blocks) == (200, 64)


# --------------------------------------------------------------------------- runner


@pytest.mark.slow
def test_run_has_every_method_per_suite_and_direction(tiny):
    config, rows, _ = tiny
    assert config.fixed_cost  # on by default
    assert {r.suite for r in rows} == set(SUITES)
    for suite in SUITES:
        for direction in DIRECTIONS:
            methods = {r.method for r in rows if r.suite == suite and r.direction == direction}
            assert methods >= CPU_ROW_METHODS, (suite, direction, methods)
            assert "kvcopy torch" not in methods  # the per-layer index loop is its row
    assert sorted({r.num_blocks for r in rows if r.suite == "count_sweep"}) == [1, 2]
    assert {r.num_blocks for r in rows if r.suite in ("workloads", "size_sweep")} == {2}
    assert all(r.ids == "random" for r in rows)


@pytest.mark.slow
def test_run_rows_have_sane_times_and_bytes(tiny):
    _, rows, _ = tiny
    for r in rows:
        assert 0 < r.p20_s <= r.median_s <= r.p80_s, r
        assert r.bytes == r.num_blocks * r.block_bytes
        assert r.gbps > 0
    llama = WORKLOADS["llama8b-16"].build(1, CPU)
    for r in rows:
        if r.suite in ("workloads", "count_sweep"):
            assert (r.num_planes, r.block_bytes) == (llama.num_planes, llama.nbytes_per_block)
    size_rows = [r for r in rows if r.suite == "size_sweep"]
    assert {(r.workload, r.plane_block_bytes) for r in size_rows} == {("llama8b-1", 2048)}


@pytest.mark.slow
def test_fixed_cost_point_is_one_block_of_small_plane_blocks(tiny):
    _, rows, _ = tiny
    fixed = [r for r in rows if r.suite == "fixed_cost"]
    assert {(r.workload, r.num_blocks, r.num_planes, r.plane_block_bytes) for r in fixed} == {
        (TINY_PLANES.name, 1, 64, 256),
        (ONE_PLANE_32K.name, 1, 1, 32768),
    }
    for workload in (TINY_PLANES.name, ONE_PLANE_32K.name):  # "auto" too: the call overhead a user pays
        mine = {(r.direction, r.method) for r in fixed if r.workload == workload}
        assert mine >= {(d, m) for d in DIRECTIONS for m in CPU_ROW_METHODS | {AUTO}}


@pytest.mark.slow
def test_on_point_is_called_once_per_point(tiny):
    config, rows, seen = tiny
    assert len(seen) == num_points(config) == 6
    assert [r for point in seen for r in point] == rows
    for point in seen:  # one point: one cache, one block count
        assert len({(r.suite, r.workload, r.num_blocks) for r in point}) == 1


@pytest.mark.slow
def test_predictions_are_the_profiles_for_kvcopy_rows_only(tiny):
    _, rows, _ = tiny
    for r in rows:
        if r.method == "kvcopy cpu":
            expected = PROFILE.predict("h2h", r.bytes, num_blocks=r.num_blocks, method="cpu", planes=r.num_planes)
            assert r.predicted_s == pytest.approx(expected, rel=1e-12), r
        else:
            assert r.predicted_s is None, r


def test_device_is_resolved_from_a_string():
    assert BenchConfig(device="cpu").device == CPU
    with pytest.raises(ValueError, match="device: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        BenchConfig(device="gpu")


@pytest.mark.slow
def test_slow_rows_get_fewer_repeats_and_say_so(monkeypatch):
    import kvcopy.tools.bench.runner as runner

    monkeypatch.setattr(runner, "SLOW_CALL_S", 0.0)  # every row is "slow"
    config = BenchConfig(
        device=CPU,
        workloads=("llama8b-16",),
        blocks=2,
        counts=(),
        block_tokens=(),
        fixed_cost=False,
        repeats=7,
        warmup=0,
    )
    rows = run_benchmarks(config)
    assert rows and {r.repeats for r in rows} == {runner.SLOW_ROW_REPEATS}
    assert {r["repeats"] for r in with_ratios(rows)} == {runner.SLOW_ROW_REPEATS}


@pytest.mark.slow
def test_large_calls_are_checked_on_their_first_ids(monkeypatch):
    import kvcopy.tools.bench.runner as runner

    block_bytes = WORKLOADS["llama8b-16"].build(1, CPU).nbytes_per_block
    monkeypatch.setattr(runner, "MAX_CHECKED_BYTES", 2 * block_bytes)
    checked = []
    real_check = runner.check_output

    def spy(name, fn, src, src_ids, dst, dst_ids, **kw):
        checked.append((name, len(src_ids), len(dst_ids)))
        return real_check(name, fn, src, src_ids, dst, dst_ids, **kw)

    monkeypatch.setattr(runner, "check_output", spy)
    config = BenchConfig(
        device=CPU,
        workloads=("llama8b-16",),
        blocks=5,
        counts=(),
        block_tokens=(),
        fixed_cost=False,
        repeats=1,
        warmup=0,
    )
    rows = run_benchmarks(config)
    methods = {(r.direction, r.method) for r in rows if r.method != LIMIT}
    assert {name.split(" ", 1)[1] for name, _, _ in checked} == {f"{d} {m}" for d, m in methods}
    assert {(s, d) for _, s, d in checked} == {(2, 2)}  # every row checked, each on its first 2 ids of 5
    assert {r.num_blocks for r in rows} == {5}


@pytest.mark.slow
def test_csv_writer_saves_each_point_as_it_ends(tmp_path):
    from kvcopy.tools.bench import CsvWriter

    out = tmp_path / "stream.csv"
    identity = {"device": "cpu", "device_name": "streamer"}
    config = BenchConfig(
        device=CPU,
        workloads=("llama8b-16",),
        blocks=2,
        counts=(1,),
        block_tokens=(),
        fixed_cost=False,
        repeats=1,
        warmup=0,
    )
    seen_on_disk = []
    with CsvWriter(out, identity) as writer:
        assert read_csv(out) == []  # the header is there before any point

        def on_point(rows):
            writer.write(rows)
            seen_on_disk.append(len(read_csv(out)))

        rows = run_benchmarks(config, on_point=on_point)
    per_point = len(rows) // 2
    assert seen_on_disk == [per_point, 2 * per_point]  # flushed point by point
    assert [r["method"] for r in read_csv(out)] == [r.method for r in rows]


@pytest.mark.slow
def test_other_workloads_and_sequential_ids_run():
    config = BenchConfig(
        device=CPU,
        workloads=("llama8b-fp8-16", "deepseek-v3-mla-64"),
        ids="sequential",
        blocks=2,
        counts=(),
        block_tokens=(),
        fixed_cost=False,
        repeats=1,
        warmup=0,
    )
    assert num_points(config) == 2
    d2h_only = Profile(hardware={}, directions={"d2h": {"cpu": MethodProfile(_link(1e-5, 1e9))}})
    rows = run_benchmarks(config, profile=d2h_only)  # the profile never measured h2h: no predictions
    for name in config.workloads:
        built = WORKLOADS[name].build(1, CPU)
        for direction in DIRECTIONS:
            mine = [r for r in rows if r.workload == name and r.direction == direction]
            assert {r.method for r in mine} >= CPU_ROW_METHODS, (name, direction)
            assert all(r.num_planes == built.num_planes and r.block_bytes == built.nbytes_per_block for r in mine)
    assert all(r.ids == "sequential" and r.suite == "workloads" and r.num_blocks == 2 for r in rows)
    assert all(r.median_s > 0 and r.predicted_s is None for r in rows)


# --------------------------------------------------------------------------- check_output


def _cache_and_pool(layout: str, dtype: torch.dtype, gen: torch.Generator):
    kv = make_layout(layout, 8, dtype, gen)
    pool = kvcopy.HostKVPool(kv, 6, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


SRC_IDS, DST_IDS = torch.tensor([0, 3, 4, 6]), torch.tensor([5, 1, 2, 0])


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [
        pytest.param("vllm", torch.bfloat16, id="vllm-bf16"),
        pytest.param("planes", torch.float8_e4m3fn, id="planes-fp8"),
    ],
)
def test_check_output_passes_a_correct_copy(layout, dtype, gen):
    kv, pool = _cache_and_pool(layout, dtype, gen)
    copy = functools.partial(kvcopy.copy_blocks, kv, SRC_IDS, pool, DST_IDS, method="cpu")
    check_output("kvcopy cpu", copy, kv, SRC_IDS, pool.paged, DST_IDS)
    check_output(
        "scatter",
        functools.partial(kvcopy.copy_blocks, pool, DST_IDS, kv, SRC_IDS, method="cpu"),
        pool.paged,
        DST_IDS,
        kv,
        SRC_IDS,
    )


@pytest.mark.parametrize("wrong", ["shifted ids", "no copy", "last plane skipped", "already there"])
def test_check_output_fails_a_wrong_copy(wrong, gen):
    kv, pool = _cache_and_pool("planes", torch.float8_e4m3fn, gen)
    if wrong == "shifted ids":
        fn = functools.partial(kvcopy.copy_blocks, kv, SRC_IDS + 1, pool, DST_IDS, method="cpu")
    elif wrong == "no copy":
        fn = lambda: None  # noqa: E731
    elif wrong == "last plane skipped":
        partial_src = kvcopy.PagedKV.from_planes(kv.planes[:-1])
        partial_dst = kvcopy.PagedKV.from_planes(pool.paged.planes[:-1])
        fn = functools.partial(per_layer_index_loop, partial_src, SRC_IDS, partial_dst, DST_IDS)
    else:
        # The destination held the right bytes before the check: it clears them first, so a no-op still fails.
        kvcopy.copy_blocks(kv, SRC_IDS, pool, DST_IDS, method="cpu")
        fn = lambda: None  # noqa: E731
    with pytest.raises(AssertionError, match="my method") as err:
        check_output("my method", fn, kv, SRC_IDS, pool.paged, DST_IDS)
    if wrong == "last plane skipped":
        assert f"plane {kv.num_planes - 1} " in str(err.value)


@pytest.mark.parametrize("stray", ["another destination block", "the source"])
def test_check_output_fails_a_copy_that_writes_elsewhere(stray, gen):
    kv, pool = _cache_and_pool("planes", torch.float8_e4m3fn, gen)
    side, ids = (pool.paged, DST_IDS) if stray == "another destination block" else (kv, SRC_IDS)
    unnamed = next(i for i in range(side.num_blocks) if i not in ids.tolist())

    def copy_and_stray() -> None:
        kvcopy.copy_blocks(kv, SRC_IDS, pool, DST_IDS, method="cpu")
        side.planes[1][unnamed].view(torch.uint8).bitwise_not_()

    with pytest.raises(AssertionError, match="my method: plane 1"):
        check_output("my method", copy_and_stray, kv, SRC_IDS, pool.paged, DST_IDS)
    check_output("my method", copy_and_stray, kv, SRC_IDS, pool.paged, DST_IDS, whole=False)  # not looked for


@pytest.mark.parametrize("stray", ["another destination block", "the source"])
def test_a_kept_copy_serves_the_next_check_and_still_finds_a_stray_write(stray, gen):
    """The bench checks each method of a point against one copy of the caches (kept=): the copy is made once,
    a correct copy passes against it again and again, and a stray write after it is still found."""
    kv, pool = _cache_and_pool("planes", torch.float8_e4m3fn, gen)
    side, ids = (pool.paged, DST_IDS) if stray == "another destination block" else (kv, SRC_IDS)
    unnamed = next(i for i in range(side.num_blocks) if i not in ids.tolist())
    copy = functools.partial(kvcopy.copy_blocks, kv, SRC_IDS, pool, DST_IDS, method="cpu")
    kept: list = []
    check_output("first", copy, kv, SRC_IDS, pool.paged, DST_IDS, kept=kept)
    assert len(kept) == kv.num_planes  # the copy, one (source, destination) pair of words per plane
    copies = [(s.data_ptr(), d.data_ptr()) for s, d in kept]
    check_output("second", copy, kv, SRC_IDS, pool.paged, DST_IDS, kept=kept)
    assert [(s.data_ptr(), d.data_ptr()) for s, d in kept] == copies  # used, not made again

    def copy_and_stray() -> None:
        copy()
        side.planes[1][unnamed].view(torch.uint8).bitwise_not_()

    with pytest.raises(AssertionError, match="third: plane 1"):
        check_output("third", copy_and_stray, kv, SRC_IDS, pool.paged, DST_IDS, kept=kept)


# --------------------------------------------------------------------------- baselines


def _run_baseline(baseline: str, src, src_ids, dst, dst_ids) -> None:
    if baseline == PER_LAYER_LOOP:
        per_layer_index_loop(src, torch.tensor(src_ids), dst, torch.tensor(dst_ids))
    else:
        per_block_copy_loop(src, src_ids, dst, dst_ids)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    ("layout", "dtype"),
    [
        pytest.param("vllm", torch.bfloat16, id="vllm-bf16"),
        pytest.param("mla", torch.float16, id="mla-fp16"),
        pytest.param("planes", torch.float8_e4m3fn, id="planes-fp8"),
        pytest.param("flashinfer", torch.float8_e4m3fn, id="flashinfer-fp8"),
        pytest.param("planes", torch.float32, id="planes-fp32"),
    ],
)
@pytest.mark.parametrize("baseline", [PER_LAYER_LOOP, PER_BLOCK_LOOP])
def test_baselines_copy_like_plain_indexing(baseline, layout, dtype, direction, gen):
    kv, pool = _cache_and_pool(layout, dtype, gen)
    if direction == "gather":  # a repeated source id and a run of adjacent ids
        src, src_ids, dst, dst_ids = kv, [5, 1, 2, 3, 5, 0], pool.paged, [4, 0, 1, 2, 5, 3]
    else:
        src, src_ids, dst, dst_ids = pool.paged, [2, 2, 3, 4, 0], kv, [7, 0, 1, 2, 5]
    expected = reference_copy(src, src_ids, dst, dst_ids)
    src_before = snapshot(src)
    _run_baseline(baseline, src, src_ids, dst, dst_ids)
    assert_same_bytes(dst_bytes(dst), expected)
    assert_same_bytes(snapshot(src), src_before)


# --------------------------------------------------------------------------- report


def _row(
    method: str,
    median: float,
    *,
    suite: str = "workloads",
    direction: str = "gather",
    n: int = 4,
    predicted: float | None = None,
    block_bytes: int = 1000,
    planes: int = 4,
) -> BenchRow:
    return BenchRow(
        suite,
        "w",
        direction,
        "random",
        method,
        n,
        planes,
        block_bytes,
        median,
        median * 0.9,
        median * 1.1,
        5,
        predicted,
    )


def _hand_made_rows() -> list[BenchRow]:
    return [
        # point A: every baseline
        _row(LIMIT, 1.0),
        _row("kvcopy cpu", 2.0, predicted=3.0),
        _row(PER_LAYER_LOOP, 8.0),
        _row(PER_BLOCK_LOOP, 4.0),
        _row(PER_BLOCK_MEMCPY, 5.0),
        # point B (other block count): no per-block rows
        _row(LIMIT, 0.5, n=8),
        _row("kvcopy cpu", 0.25, n=8, predicted=0.2),
        _row(PER_LAYER_LOOP, 1.0, n=8),
        # point C (other direction): no limit row
        _row("kvcopy cpu", 3.0, direction="scatter"),
        _row(PER_BLOCK_LOOP, 6.0, direction="scatter"),
    ]


def _by_method(ratios, n=4, direction="gather"):
    return {r["method"]: r for r in ratios if r["num_blocks"] == n and r["direction"] == direction}


def test_with_ratios_on_exact_times():
    ratios = with_ratios(_hand_made_rows())
    assert all(list(r) == list(MEASURED_COLUMNS) for r in ratios)
    a = _by_method(ratios)
    assert a[LIMIT]["x_limit"] == 1.0
    assert a["kvcopy cpu"]["x_limit"] == pytest.approx(0.5)
    assert a["kvcopy cpu"]["x_layer_loop"] == pytest.approx(4.0)
    assert a["kvcopy cpu"]["x_per_block_loop"] == pytest.approx(2.0)
    assert a["kvcopy cpu"]["x_per_block_memcpy"] == pytest.approx(2.5)
    assert a[PER_LAYER_LOOP]["x_layer_loop"] == 1.0
    assert a[PER_LAYER_LOOP]["x_limit"] == pytest.approx(1 / 8)
    assert a["kvcopy cpu"]["predicted_s"] == 3.0
    assert a["kvcopy cpu"]["prediction_error"] == pytest.approx(0.5)
    assert math.isnan(a[LIMIT]["predicted_s"]) and math.isnan(a[LIMIT]["prediction_error"])
    assert a["kvcopy cpu"]["bytes"] == 4000 and a["kvcopy cpu"]["plane_block_bytes"] == 250
    assert a["kvcopy cpu"]["gbps"] == pytest.approx(4000 / 2.0 / 1e9)
    b = _by_method(ratios, n=8)
    assert b["kvcopy cpu"]["x_limit"] == pytest.approx(2.0)
    assert b["kvcopy cpu"]["x_layer_loop"] == pytest.approx(4.0)
    assert math.isnan(b["kvcopy cpu"]["x_per_block_loop"]) and math.isnan(b["kvcopy cpu"]["x_per_block_memcpy"])
    assert b["kvcopy cpu"]["prediction_error"] == pytest.approx(0.2 / 0.25 - 1)
    c = _by_method(ratios, direction="scatter")
    assert math.isnan(c["kvcopy cpu"]["x_limit"]) and math.isnan(c["kvcopy cpu"]["x_layer_loop"])
    assert c["kvcopy cpu"]["x_per_block_loop"] == pytest.approx(2.0)


def test_csv_round_trip(tmp_path):
    rows = _hand_made_rows()
    identity = {**machine_identity(CPU), "device_name": "Test Device 9000"}
    path = tmp_path / "bench.csv"
    write_csv(rows, identity, path)
    with path.open(newline="") as f:
        raw = list(csv.DictReader(f))
    with path.open(newline="") as f:
        assert next(csv.reader(f)) == list(CSV_COLUMNS)
    read = read_csv(path)
    assert len(read) == len(raw) == len(rows)
    assert all(list(r) == list(CSV_COLUMNS) for r in read)
    for r in read:
        for key in IDENTITY_COLUMNS:
            value = identity.get(key)
            assert r[key] == ("" if value is None else str(value)), key
    assert r["device_name"] == "Test Device 9000"
    for written, raw_row, back in zip(with_ratios(rows), raw, read, strict=True):
        for key, value in written.items():
            if isinstance(value, float) and math.isnan(value):
                assert raw_row[key] == "" and math.isnan(back[key]), key
            elif key in ("suite", "workload", "direction", "ids", "method"):
                assert back[key] == value
            else:
                assert back[key] == value, key  # floats are written exactly (repr)


def test_format_tables_on_hand_made_rows():
    fixed = [
        _row(method, median, suite="fixed_cost", n=1, block_bytes=64 * 256, planes=64)
        for method, median in ((LIMIT, 2.5e-6), ("kvcopy cpu", 12.5e-6))
    ]
    text = format_tables(_hand_made_rows() + fixed, {"device_name": "Test Device 9000", "device": "cpu"})
    assert "Test Device 9000" in text
    assert "pred. err" in text and "+50%" in text  # prediction error column of point A
    assert "fixed cost (w)" in text and "64 plane(s) x 256 B" in text
    assert re.search(r"^  gather\s+kvcopy cpu\s+12\.5\s+.*\s5\.0x$", text, re.M), text  # 5x the limit
    assert "fixed cost" not in format_tables(_hand_made_rows(), {})


@pytest.mark.slow
def test_format_tables_names_workloads_methods_and_device(tiny):
    _, rows, _ = tiny
    identity = {**machine_identity(CPU), "device_name": "Test Device 9000"}
    text = format_tables(rows, identity)
    assert "Test Device 9000" in text
    assert "llama8b-16:" in text
    assert "count_sweep:" in text and "size_sweep:" in text
    for method in {r.method for r in rows}:
        assert method in text, method


# --------------------------------------------------------------------------- plot


@pytest.mark.slow
def test_plot_bench_writes_a_png(tiny, tmp_path):
    pytest.importorskip("matplotlib", reason="plot_bench needs matplotlib")
    from kvcopy.tools.plots import plot_bench

    _, rows, _ = tiny
    path = tmp_path / "bench.png"
    plot_bench(with_ratios(rows), path, title="test")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    csv_path, from_csv = tmp_path / "bench.csv", tmp_path / "from_csv.png"  # read_csv rows plot too
    write_csv(rows, machine_identity(CPU), csv_path)
    plot_bench(read_csv(csv_path), from_csv)
    assert from_csv.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_plot_bench_draws_what_there_is_and_refuses_nothing(tiny, tmp_path):
    pytest.importorskip("matplotlib", reason="plot_bench needs matplotlib")
    from kvcopy.tools.plots import plot_bench

    _, rows, _ = tiny
    workloads_only = tmp_path / "workloads.png"  # no sweeps: the workload and fixed-cost panels alone
    plot_bench([r for r in with_ratios(rows) if r["suite"] in ("workloads", "fixed_cost")], workloads_only)
    assert workloads_only.read_bytes()[:8] == PNG_MAGIC
    path = tmp_path / "bench.png"
    with pytest.raises(ValueError, match="no sweep, workload or fixed_cost rows"):
        plot_bench([], path)
    assert not path.exists()
