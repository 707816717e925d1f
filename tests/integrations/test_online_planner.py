"""OnlinePlanner and PathClock: the Planner an engine adapter decides with, and the paths it measures.

What is checked:

* forward_seconds / predict_paths against the roofline computed here from ``spec.prefill_flops`` and
  ``spec.weight_bytes``, on hand-written chunk lists (each forward of at most max_forward_tokens costed whole);
* OnlinePlanner: with ``learn=False`` the calibrated Planner forever; with ``learn=True`` the calibrated one
  until REFIT_EVERY observations, then one refitted toward what was observed (the count it was built from),
  kept as it is when the refit changes nothing material; without a base, none until both a load link and
  forwards were observed; a CPU TransferEngine's real transfers through ``observe_transfer``;
* Planner.t_forward / own_share against the batch roofline written out here;
* PathClock, on a fake clock: each forward reported once with its requests' tokens and seconds; a resumed
  request's measured path (reload wait + of each forward carrying it, the part that is its own: the forward's
  seconds times the law's forward of the request alone over the law's forward of the batch; a forward it
  rides alone whole), forgotten paths, reloads not yet done recorded at a later settle();
* PathClock on a stream's events (stand-ins for CUDA events, the device's clock written by the test): an
  engine that prepares batch N+1 while batch N runs (transformers' asynchronous batching) has each forward
  timed from the stream reaching its start to the stream reaching its end, reported once the stream passed
  it, in order, and the reload's wait outside the forward.

Observations are synthetic, from known laws; nothing here reads the wall clock.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import kvcopy
from kvcopy import Planner
from kvcopy.integrations.common import path_clock as _path_clock
from kvcopy.integrations.common.offload_stats import OffloadDecision
from kvcopy.integrations.common.online_planner import (
    REFIT_EVERY,
    OnlinePlanner,
    forward_seconds,
    own_share,
    predict_paths,
)
from kvcopy.integrations.common.path_clock import ForwardRequest, PathClock
from kvcopy.profile import CostLine, MethodProfile, PrefillProfile, Profile

from helpers import HANG_TIMEOUT_S

LLAMA = kvcopy.ModelSpec.preset("llama-3.1-8b")
BLOCK = LLAMA.block_nbytes(16)

# The calibrated base: loads at 1 ms + 10 GB/s; a forward of LLAMA 5 ms + max(FLOPs at 400 TFLOP/s, 4 TB/s).
LOAD_ALPHA_S = 1e-3
LOAD_BYTES_PER_S = 10e9
PREFILL_ALPHA_S = 5e-3
FLOPS_PER_S = 4e14
WEIGHT_BYTES_PER_S = 4e12
BASE = Profile(
    hardware={"device": "test"},
    directions={
        "h2h": {
            "cpu": MethodProfile(
                fit=CostLine(alpha_s=LOAD_ALPHA_S, beta_bytes_per_s=LOAD_BYTES_PER_S, r2=1.0, max_abs_residual=0.0)
            )
        }
    },
    prefill=PrefillProfile(
        model=LLAMA.name,
        alpha_s=PREFILL_ALPHA_S,
        flops_per_s=FLOPS_PER_S,
        r2=1.0,
        weight_bytes_per_s=WEIGHT_BYTES_PER_S,
        num_layers=LLAMA.num_layers,
    ),
)

# What the engine measures instead, far from the base: loads at 5 ms + 1 GB/s, forwards 20 ms + half as fast.
FAR_LOAD_ALPHA_S = 5e-3
FAR_LOAD_BYTES_PER_S = 1e9
FAR_PREFILL_ALPHA_S = 20e-3
FAR_SLOWDOWN = 2.0
# A refit must close at least this share of the gap between the base's prediction and the observed law.
GAP_CLOSED = 0.5
# Without a base, a planner learned from one shape of each predicts that shape within this.
LEARNED_REL = 0.01
PROBE_BLOCKS = (1, 64)
PROBE_TOKENS = (1, 64, 1024)
OBSERVED_BLOCKS = (1, 4, 16, 64)
OBSERVED_TOKENS = ((1, 0), (64, 300), (512, 0), (1024, 2000))  # (new, cached) of single-request forwards

# PathClock: fake perf_counter seconds (binary fractions, so sums are exact).
START_S = 100.0
RELOAD_WAIT_S = 0.0625
FINISH_AFTER_S = 0.05  # a reload settle(wait=True) waits for ends this long after it is asked


def roofline(tokens: int, cached: int) -> float:
    """Seconds of one forward under the base: the Planner's roofline, written out."""
    compute = LLAMA.prefill_flops(tokens, cached) / FLOPS_PER_S
    memory = LLAMA.weight_bytes(tokens, cached) / WEIGHT_BYTES_PER_S
    return PREFILL_ALPHA_S + max(compute, memory)


def base_planner(extra_request_s: float = 0.0) -> Planner:
    return Planner(
        LLAMA,
        load=CostLine(LOAD_ALPHA_S, LOAD_BYTES_PER_S),
        prefill_flops_per_s=FLOPS_PER_S,
        prefill_alpha_s=PREFILL_ALPHA_S,
        weight_bytes_per_s=WEIGHT_BYTES_PER_S,
        prefill_extra_request_s=extra_request_s,
    )


def far_load(nbytes: int) -> float:
    return FAR_LOAD_ALPHA_S + nbytes / FAR_LOAD_BYTES_PER_S


def far_forward(tokens: int, cached: int) -> float:
    return FAR_PREFILL_ALPHA_S + FAR_SLOWDOWN * (roofline(tokens, cached) - PREFILL_ALPHA_S)


def base_load(nbytes: int) -> float:
    return LOAD_ALPHA_S + nbytes / LOAD_BYTES_PER_S


def copy_of(blocks: int, seconds: float, direction: str = "h2h") -> SimpleNamespace:
    """A finished transfer as OnlinePlanner.observe_transfer reads one."""
    return SimpleNamespace(
        profile_direction=direction, method="cpu", nbytes=blocks * BLOCK, num_blocks=blocks, turnaround=seconds
    )


def observe(live: OnlinePlanner, count: int, load, forward) -> None:
    """``count`` observations, copies and forwards in turn, timed by the laws ``load`` and ``forward``."""
    for i in range(count):
        if i % 2:
            blocks = OBSERVED_BLOCKS[(i // 2) % len(OBSERVED_BLOCKS)]
            live.observe_transfer(copy_of(blocks, load(blocks * BLOCK)))
        else:
            tokens, cached = OBSERVED_TOKENS[(i // 2) % len(OBSERVED_TOKENS)]
            live.observe_forward([tokens], [cached], forward(tokens, cached))


def assert_same_planner(planner: Planner, expected: Planner) -> None:
    def state(p: Planner) -> tuple:
        return (p.load_options, p.prefill_flops_per_s, p.prefill_alpha_s, p.weight_bytes_per_s, p.split_margin)

    assert state(planner) == state(expected)
    for blocks in PROBE_BLOCKS:
        assert planner.t_load_nbytes(blocks * BLOCK) == expected.t_load_nbytes(blocks * BLOCK)
    for tokens in PROBE_TOKENS:
        assert planner.t_prefill(tokens) == expected.t_prefill(tokens)


# --------------------------------------------------------------------------- forward_seconds, predict_paths

MAX_FORWARD = 256


@pytest.mark.parametrize(
    "tokens, cached, max_forward, chunks",
    [
        (1000, 300, MAX_FORWARD, [(256, 300), (256, 556), (256, 812), (232, 1068)]),
        (1024, 0, MAX_FORWARD, [(256, 0), (256, 256), (256, 512), (256, 768)]),
        (1000, 300, None, [(1000, 300)]),
        (100, 7, 4096, [(100, 7)]),
        (3, 5, 1, [(1, 5), (1, 6), (1, 7)]),
        (0, 50, MAX_FORWARD, []),
    ],
)
def test_forward_seconds_costs_each_chunk_whole(tokens, cached, max_forward, chunks):
    expected = sum(roofline(n, p) for n, p in chunks)
    assert forward_seconds(base_planner(), tokens, cached, max_forward) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "max_forward, extend_chunks, recompute_chunks",
    [
        (MAX_FORWARD, [(256, 500), (44, 756)], [(256, 0), (256, 256), (256, 512), (32, 768)]),
        (None, [(300, 500)], [(800, 0)]),
    ],
)
def test_predict_paths_is_load_plus_extension_against_recompute(max_forward, extend_chunks, recompute_chunks):
    prefix, new, nbytes = 500, 300, 32 * BLOCK
    reload, recompute = predict_paths(base_planner(), prefix, new, nbytes, max_forward)
    assert reload == pytest.approx(base_load(nbytes) + sum(roofline(n, p) for n, p in extend_chunks), rel=1e-12)
    assert recompute == pytest.approx(sum(roofline(n, p) for n, p in recompute_chunks), rel=1e-12)


def batch_roofline(new: tuple[int, ...], cached: tuple[int, ...]) -> float:
    """Seconds of one batched forward under the base, written out: each request's FLOPs and cached KV summed,
    the weights read once."""
    flops = sum(LLAMA.prefill_flops(n, p) for n, p in zip(new, cached, strict=True))
    read = LLAMA.weight_bytes(sum(new)) + sum(LLAMA.kv_bytes(p) for p in cached)
    return PREFILL_ALPHA_S + max(flops / FLOPS_PER_S, read / WEIGHT_BYTES_PER_S)


def own(new: tuple[int, ...], cached: tuple[int, ...], index: int) -> float:
    """Request ``index``'s own part of a forward under the base: alone over the batch."""
    return roofline(new[index], cached[index]) / batch_roofline(new, cached)


# Batches: decode steps only (memory-bound on the base), and a decode step beside a 2048-token prefill chunk.
DECODES = ((1, 1, 1), (500, 90, 3000))
CROWDED = ((1, 2048), (500, 0))


# What each request beside the first adds to a forward, against the base's fixed cost.
EXTRA_REQUEST_S = 2 * PREFILL_ALPHA_S


@pytest.mark.parametrize("extra_request_s", [0.0, EXTRA_REQUEST_S], ids=["calibrated", "work per request"])
@pytest.mark.parametrize("batch", [DECODES, CROWDED, ((64,), (300,))], ids=["decodes", "crowded", "one"])
def test_a_batched_forward_is_the_batch_roofline_and_each_requests_work_beside_the_first(batch, extra_request_s):
    planner = base_planner(extra_request_s)
    extra = (len(batch[0]) - 1) * extra_request_s
    assert planner.t_forward(*batch) == pytest.approx(batch_roofline(*batch) + extra, rel=1e-12)
    assert planner.t_forward((), ()) == 0.0
    assert planner.t_prefill(64, 300) == base_planner().t_prefill(64, 300)  # one request: none of it


def test_a_requests_own_part_of_a_forward_is_its_forward_alone_over_the_batchs():
    planner = base_planner()
    for batch in (DECODES, CROWDED):
        for index in range(len(batch[0])):
            assert own_share(planner, *batch, index) == pytest.approx(own(*batch, index), rel=1e-12)
    # beside decode steps a decode step is most of the forward (the weights are read once for all); beside a
    # long prefill chunk, a small part of it
    assert own_share(planner, *DECODES, 0) > 0.9
    assert own_share(planner, *CROWDED, 0) < 0.5
    assert own_share(planner, (64,), (300,), 0) == 1.0  # alone: the whole forward
    assert own_share(None, *CROWDED, 0) == 1.0  # no law yet: the whole forward


def test_a_requests_own_part_counts_the_work_per_request_as_the_others():
    """Three decode steps: alone, a step costs the roofline; the batch, that plus two requests' extra work, so
    each step's own part is about a third, where the law without the term made it nearly all."""
    planner = base_planner(EXTRA_REQUEST_S)
    batch = batch_roofline(*DECODES) + 2 * EXTRA_REQUEST_S
    for index, cached in enumerate(DECODES[1]):
        assert own_share(planner, *DECODES, index) == pytest.approx(roofline(1, cached) / batch, rel=1e-12)
    assert own_share(planner, *DECODES, 0) < 0.5 < own_share(base_planner(), *DECODES, 0)


@pytest.mark.parametrize("value", [-1e-3, float("nan")])
def test_a_negative_work_per_request_is_refused(value):
    with pytest.raises(ValueError, match="prefill_extra_request_s"):
        base_planner(value)


# --------------------------------------------------------------------------- OnlinePlanner


def test_without_learning_the_calibrated_planner_is_kept_forever():
    before = BASE.to_dict()
    live = OnlinePlanner(LLAMA, BASE, learn=False)
    planner, observations = live.current()
    assert observations == 0
    assert_same_planner(planner, Planner.from_profile(BASE, LLAMA))
    observe(live, 3 * REFIT_EVERY, far_load, far_forward)
    assert live.current() == (planner, 0)
    assert live.current()[0] is planner
    assert live.profile() is BASE
    assert BASE.to_dict() == before


def test_learning_refits_after_refit_every_observations_toward_the_observed_law():
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    base, observations = live.current()
    assert observations == 0
    assert_same_planner(base, Planner.from_profile(BASE, LLAMA))
    observe(live, REFIT_EVERY - 1, far_load, far_forward)
    planner, observations = live.current()
    assert planner is base and observations == 0

    observe(live, 1, far_load, far_forward)
    learned, observations = live.current()
    assert learned is not base
    assert observations == REFIT_EVERY
    for blocks in PROBE_BLOCKS:
        nbytes = blocks * BLOCK
        gap = abs(base.t_load_nbytes(nbytes) - far_load(nbytes))
        assert abs(learned.t_load_nbytes(nbytes) - far_load(nbytes)) <= (1 - GAP_CLOSED) * gap
    for tokens in PROBE_TOKENS:
        gap = abs(base.t_prefill(tokens) - far_forward(tokens, 0))
        assert abs(learned.t_prefill(tokens) - far_forward(tokens, 0)) <= (1 - GAP_CLOSED) * gap

    observe(live, REFIT_EVERY - 1, far_load, far_forward)  # not yet due again
    assert live.current() == (learned, REFIT_EVERY)
    learned_from = live.profile().hardware["online"]["observations"]  # the profile has them all, the planner waits
    assert sum(learned_from.values()) == 2 * REFIT_EVERY - 1


def test_a_refit_that_changes_nothing_material_keeps_the_planner():
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    base, _ = live.current()
    refits = live.online.refits
    observe(live, 3 * REFIT_EVERY, base_load, lambda n, p: base_planner().t_prefill(n, p))
    planner, observations = live.current()
    assert live.online.refits > refits  # it did refit, and found the same law
    assert planner is base and observations == 0


# Two-request decode batches measured this much slower than the base's law: work per request beside the first.
BATCH_EXTRA_S = 10e-3
# Decode batches of two requests, at these cached lengths (the probe itself is at 0 and 0).
DECODE_CACHED = ((100, 300), (700, 50), (0, 900), (450, 450))


def test_a_refit_that_moves_only_two_request_batches_replaces_the_planner():
    """Loads and single-request forwards exactly as calibrated, two-request decode steps 10 ms slower: the only
    prediction that moves is a batch's, and that alone makes the refit material."""
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    base, _ = live.current()
    law = base_planner()
    for i in range(REFIT_EVERY):
        turn = i // 3
        if i % 3 == 0:
            blocks = OBSERVED_BLOCKS[turn % len(OBSERVED_BLOCKS)]
            live.observe_transfer(copy_of(blocks, base_load(blocks * BLOCK)))
        elif i % 3 == 1:
            tokens, cached = OBSERVED_TOKENS[turn % len(OBSERVED_TOKENS)]
            live.observe_forward([tokens], [cached], law.t_prefill(tokens, cached))
        else:
            cached = DECODE_CACHED[turn % len(DECODE_CACHED)]
            live.observe_forward([1, 1], list(cached), law.t_forward((1, 1), cached) + BATCH_EXTRA_S)
    planner, observations = live.current()
    assert planner is not base and observations == REFIT_EVERY
    probe = ((1, 1), (0, 0))
    assert planner.t_forward(*probe) - base.t_forward(*probe) == pytest.approx(BATCH_EXTRA_S, rel=0.05)
    # what the other probes see did not move: the batch probe is what replaced the planner
    for blocks in PROBE_BLOCKS:
        assert planner.t_load_nbytes(blocks * BLOCK) == pytest.approx(base.t_load_nbytes(blocks * BLOCK), rel=1e-6)
    for tokens in PROBE_TOKENS:
        assert planner.t_prefill(tokens) == pytest.approx(base.t_prefill(tokens), rel=1e-6)


@pytest.mark.parametrize("forwards_first", [True, False])
def test_without_a_base_there_is_no_planner_until_loads_and_forwards_were_observed(forwards_first):
    live = OnlinePlanner(LLAMA, None, learn=True)
    assert live.current() == (None, 0)
    first, then = (0, 1) if forwards_first else (1, 0)
    observe_one = [
        lambda: live.observe_forward([64], [300], far_forward(64, 300)),
        lambda: live.observe_transfer(copy_of(4, far_load(4 * BLOCK))),
    ]
    for _ in range(3):
        observe_one[first]()
        assert live.current() == (None, 0)
    live.observe_transfer(copy_of(4, far_load(4 * BLOCK), direction="d2h"))  # an offload tells nothing of loads
    assert live.current() == (None, 0)
    observe_one[then]()
    planner, observations = live.current()
    assert isinstance(planner, Planner)
    assert observations == 5
    # Learned from the observations alone: it predicts what it was shown.
    assert planner.t_load_nbytes(4 * BLOCK) == pytest.approx(far_load(4 * BLOCK), rel=LEARNED_REL)
    assert planner.t_prefill(64, 300) == pytest.approx(far_forward(64, 300), rel=LEARNED_REL)


def test_real_transfers_of_a_cpu_engine_feed_the_learned_profile(engines):
    kv = kvcopy.PagedKV.from_planes([torch.randn(16, 1024) for _ in range(4)])
    host = kvcopy.HostKVPool(kv, 16, pin_memory=False)
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    base, _ = live.current()
    engine = engines(kv, host, method="cpu", observer=live.observe_transfer)
    for i in range(REFIT_EVERY // 2):
        engine.offload([i % 8, 8 + i % 8], [i % 8, 8 + i % 8])
        engine.reload([i % 8], [(i + 4) % 8], layerwise=i % 4 == 0)
    engine.close()
    assert live.online.num_observations["h2h cpu"] == REFIT_EVERY
    planner, observations = live.current()
    assert (planner is base) == (observations == 0)
    assert observations in (0, REFIT_EVERY)


# --------------------------------------------------------------------------- PathClock


class FakeClock:
    """perf_counter for PathClock: the seconds the test sets."""

    def __init__(self) -> None:
        self.now = START_S

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(_path_clock, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


class Reload:
    """A reload as PathClock sees one: done(), wait(), and its turnaround once done (``failed``: it raised)."""

    def __init__(self, turnaround: float, *, done: bool = True, failed: bool = False) -> None:
        self._turnaround = turnaround
        self._done = threading.Event()
        self.failed = failed
        self.waits = 0
        if done or failed:
            self._done.set()

    def finish(self) -> None:
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        self.waits += 1
        assert self._done.wait(HANG_TIMEOUT_S), "the test never finished this reload"
        if self.failed:
            raise RuntimeError("reload failed on purpose")

    @property
    def turnaround(self) -> float | None:
        return self._turnaround if self.done() and not self.failed else None


def decision(request_id: str, action: str = "reload") -> OffloadDecision:
    return OffloadDecision(
        request_id,
        prefix_tokens=500,
        new_tokens=1,
        reload_blocks=32,
        reload_nbytes=32 * BLOCK,
        action=action,
        reason="test",
        predicted_reload_s=None,
        predicted_recompute_s=None,
    )


def spied(live: OnlinePlanner, monkeypatch) -> list[tuple[list[int], list[int], float]]:
    """The forwards PathClock reports to ``live`` (still passed on to it)."""
    seen = []
    real = live.observe_forward

    def observe_forward(tokens, cached_tokens, seconds):
        seen.append((list(tokens), list(cached_tokens), seconds))
        real(tokens, cached_tokens, seconds)

    monkeypatch.setattr(live, "observe_forward", observe_forward)
    return seen


def forward(clock: PathClock, fake: FakeClock, seconds: float, *requests: ForwardRequest) -> None:
    clock.start(list(requests))
    fake.now += seconds
    clock.stop()
    fake.now += 1.0  # time between forwards is nobody's


def test_a_forward_is_reported_once_with_its_tokens_and_seconds(fake_clock, monkeypatch):
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    seen = spied(live, monkeypatch)
    clock = PathClock(live)
    clock.stop()  # no forward started: nothing to report
    assert seen == []
    clock.start([ForwardRequest("a", 5, 100, True), ForwardRequest("b", 1, 40, False)])
    fake_clock.now += 0.25
    clock.stop()
    clock.stop()  # already reported
    assert seen == [([5, 1], [100, 40], 0.25)]
    assert live.online.num_observations["prefill"] == 1


def test_a_dropped_forward_is_not_reported(fake_clock, monkeypatch):
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    seen = spied(live, monkeypatch)
    clock = PathClock(live)
    clock.start([ForwardRequest("a", 5, 100, True)])
    fake_clock.now += 0.25
    clock.drop_forward()
    clock.stop()
    assert seen == []


def test_a_reloaded_path_is_its_reload_wait_plus_its_part_of_the_forwards_that_carry_it(fake_clock, monkeypatch):
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    seen = spied(live, monkeypatch)
    clock = PathClock(live)
    resumed = decision("r")
    clock.resumed("r", resumed)
    clock.reloaded(["r"], [Reload(RELOAD_WAIT_S)])
    forward(clock, fake_clock, 0.25, ForwardRequest("r", 64, 500, False), ForwardRequest("o", 1, 90, True))
    forward(clock, fake_clock, 0.5, ForwardRequest("o", 1, 91, True))  # does not carry r
    assert resumed.measured_s is None  # not caught up yet
    forward(clock, fake_clock, 0.125, ForwardRequest("r", 64, 564, True), ForwardRequest("o", 1, 92, True))
    expected = RELOAD_WAIT_S + 0.25 * own((64, 1), (500, 90), 0) + 0.125 * own((64, 1), (564, 92), 0)
    assert resumed.measured_s == pytest.approx(expected, rel=1e-12)
    assert [s for _, _, s in seen] == [0.25, 0.5, 0.125]
    forward(clock, fake_clock, 0.5, ForwardRequest("r", 1, 628, True))  # measured once: later forwards do not count
    assert resumed.measured_s == pytest.approx(expected, rel=1e-12)


def test_a_path_beside_another_prefill_chunk_is_charged_its_own_part_and_records_the_chunk(fake_clock):
    clock = PathClock(OnlinePlanner(LLAMA, BASE, learn=True))
    crowded, alone = decision("r"), decision("q")
    clock.resumed("r", crowded)
    clock.resumed("q", alone)
    # r rides beside another request's 2048-token chunk, then beside decode steps only; q beside decode steps only
    forward(clock, fake_clock, 0.25, ForwardRequest("r", 64, 500, False), ForwardRequest("p", 2048, 0, False))
    forward(clock, fake_clock, 0.125, ForwardRequest("r", 1, 564, True), ForwardRequest("o", 1, 92, True))
    forward(clock, fake_clock, 0.125, ForwardRequest("q", 1, 300, True), ForwardRequest("o", 1, 93, True))
    assert (crowded.crowding_tokens, alone.crowding_tokens) == (2048, 0)
    crowded_part = own((64, 2048), (500, 0), 0)
    assert crowded_part < 0.5  # the chunk's compute is not r's
    assert crowded.measured_s == pytest.approx(0.25 * crowded_part + 0.125 * own((1, 1), (564, 92), 0), rel=1e-12)
    assert alone.measured_s == pytest.approx(0.125 * own((1, 1), (300, 93), 0), rel=1e-12)


def test_a_recomputed_path_is_the_forwards_that_carry_it(fake_clock):
    clock = PathClock(OnlinePlanner(LLAMA, BASE, learn=True))
    recomputed = decision("c", "recompute")
    clock.resumed("c", recomputed)
    forward(clock, fake_clock, 0.375, ForwardRequest("c", 256, 0, False))
    forward(clock, fake_clock, 0.25, ForwardRequest("c", 245, 256, True))
    assert recomputed.measured_s == pytest.approx(0.375 + 0.25)


def test_a_forgotten_path_is_not_measured(fake_clock):
    clock = PathClock(OnlinePlanner(LLAMA, BASE, learn=True))
    forgotten, never_ran = decision("r"), decision("s")
    clock.resumed("r", forgotten)
    clock.resumed("s", never_ran)
    clock.reloaded(["r", "s"], [Reload(RELOAD_WAIT_S)])
    forward(clock, fake_clock, 0.25, ForwardRequest("r", 64, 500, False))
    clock.forget("r")  # preempted again before catching up
    clock.forget("s")
    forward(clock, fake_clock, 0.25, ForwardRequest("r", 1, 564, True), ForwardRequest("s", 1, 500, True))
    clock.settle(wait=True)
    assert forgotten.measured_s is None and never_ran.measured_s is None


class Device:
    """A stream's clock, written by the test: where the stream has got to, in seconds."""

    def __init__(self) -> None:
        self.now = START_S
        self.pending: list[FakeEvent] = []  # recorded, not yet passed (in order)
        self.work_s = 0.0  # what the stream does before each event a host waits for

    def run(self, seconds: float) -> None:
        """The stream works ``seconds``, then passes the first event recorded and not yet passed."""
        self.now += seconds
        self.pending.pop(0).passed_at = self.now


class FakeEvent:
    """A CUDA event's stand-in on a :class:`Device`: recorded behind the work already queued on the stream."""

    device: Device

    def __init__(self, *, enable_timing: bool) -> None:
        assert enable_timing
        self.passed_at: float | None = None

    def record(self, stream: object) -> None:
        assert stream == "compute stream"
        self.device.pending.append(self)

    def query(self) -> bool:
        return self.passed_at is not None

    def synchronize(self) -> None:
        while self.passed_at is None:  # the host waits: the stream runs on to this event
            self.device.run(self.device.work_s)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.passed_at is not None and end.passed_at is not None, "elapsed_time of an event not passed"
        return (end.passed_at - self.passed_at) * 1e3


@pytest.fixture
def device() -> Device:
    device = Device()
    FakeEvent.device = device
    return device


def test_a_forward_on_a_stream_is_the_streams_time_from_its_start_to_its_end_not_the_hosts(
    fake_clock, device, monkeypatch
):
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    seen = spied(live, monkeypatch)
    clock = PathClock(live, timer=_path_clock.StreamTimer("compute stream", event_type=FakeEvent))
    resumed = decision("r")
    clock.resumed("r", resumed)
    clock.reloaded(["r"], [Reload(RELOAD_WAIT_S)])
    # Batch 1: its start marked once the stream waits for r's reload; the host prepares batch 2 at once (the
    # host's clock would end batch 1 here, 0.0 s after its start), while the stream still runs batch 1.
    clock.start([ForwardRequest("r", 64, 500, False), ForwardRequest("o", 1, 90, True)])
    fake_clock.now += 0.001
    clock.stop()
    clock.start([ForwardRequest("r", 1, 564, True), ForwardRequest("o", 1, 91, True)])
    assert seen == []  # batch 1's end is not reached yet: nothing reported
    device.run(RELOAD_WAIT_S)  # the stream waited for the reload, then passes batch 1's start
    device.run(0.25)  # batch 1's forward, then its end
    clock.stop()  # the host prepares batch 3: batch 1 is read now, batch 2's end is not reached
    assert [s for _, _, s in seen] == [0.25]
    device.run(0.0)  # batch 2's start (nothing between the forwards)
    device.run(0.125)
    clock.settle()
    assert [s for _, _, s in seen] == [0.25, 0.125]
    expected = RELOAD_WAIT_S + 0.25 * own((64, 1), (500, 90), 0) + 0.125 * own((1, 1), (564, 91), 0)
    assert resumed.measured_s == pytest.approx(expected, rel=1e-12)


def test_settle_with_wait_waits_for_the_stream_to_end_the_forward(device, monkeypatch):
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    seen = spied(live, monkeypatch)
    clock = PathClock(live, timer=_path_clock.StreamTimer("compute stream", event_type=FakeEvent))
    clock.start([ForwardRequest("a", 5, 100, True)])
    clock.stop()
    assert seen == []
    device.work_s = 0.5  # the stream's work before the forward's start, then the forward's own
    clock.settle(wait=True)
    assert seen == [([5], [100], 0.5)]
    assert device.pending == []


def caught_up_before_its_reload_is_done(fake_clock: FakeClock) -> tuple[PathClock, OffloadDecision, Reload]:
    """A resumed request caught up in one forward of 0.25 s, while its reload is not seen done yet."""
    clock = PathClock(OnlinePlanner(LLAMA, BASE, learn=True))
    resumed = decision("r")
    reload = Reload(RELOAD_WAIT_S, done=False)
    clock.resumed("r", resumed)
    clock.reloaded(["r"], [reload])
    forward(clock, fake_clock, 0.25, ForwardRequest("r", 1, 500, True))
    return clock, resumed, reload


def test_a_path_whose_reload_is_not_done_is_recorded_at_a_later_settle(fake_clock):
    clock, resumed, reload = caught_up_before_its_reload_is_done(fake_clock)
    clock.settle()
    assert resumed.measured_s is None  # caught up, but when its blocks arrived is not known yet
    reload.finish()
    clock.settle()
    assert resumed.measured_s == pytest.approx(RELOAD_WAIT_S + 0.25)


def test_settle_with_wait_waits_for_the_reloads(fake_clock):
    clock, resumed, reload = caught_up_before_its_reload_is_done(fake_clock)
    assert resumed.measured_s is None
    finisher = threading.Timer(FINISH_AFTER_S, reload.finish)
    finisher.start()
    try:
        clock.settle(wait=True)
    finally:
        finisher.cancel()
    assert reload.waits >= 1
    assert resumed.measured_s == pytest.approx(RELOAD_WAIT_S + 0.25)


def test_a_failed_reload_is_not_measured_and_breaks_nothing(fake_clock, monkeypatch):
    live = OnlinePlanner(LLAMA, BASE, learn=True)
    seen = spied(live, monkeypatch)
    clock = PathClock(live)
    failed = decision("r")
    clock.resumed("r", failed)
    clock.reloaded(["r"], [Reload(RELOAD_WAIT_S, failed=True)])
    forward(clock, fake_clock, 0.25, ForwardRequest("r", 1, 500, True))
    clock.settle(wait=True)
    assert failed.measured_s is None
    later = decision("c", "recompute")  # the clock goes on measuring
    clock.resumed("c", later)
    forward(clock, fake_clock, 0.125, ForwardRequest("c", 501, 0, True))
    assert later.measured_s == pytest.approx(0.125)
    assert seen[-1] == ([501], [0], 0.125)
