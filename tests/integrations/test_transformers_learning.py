"""kvcopy learns transformers' own costs while it serves (``kvt.offloading(..., learn=True)``).

The calibration given is the engine's real case: far too fast for what the engine measures (helpers.hf's
crossover profile: copies at 1 ms + 10 GB/s and prefill with no per-forward cost, against forwards of
transformers' continuous batching that carry milliseconds of Python each). Each test asserts that the path
it is about ran: forwards and copies observed, decisions made from the learned profile.

Where the point is how well the learning predicts, the engine is timed by a known law (helpers.hf.time_by_law),
so that no load on the machine can change the outcome; the wall clock is asserted on only for what no load can
invert (a real forward is slower than the calibration says).
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is part of the test install")

import kvcopy
from kvcopy.integrations import transformers as kvt
from kvcopy.integrations.common.online_planner import REFIT_EVERY, predict_paths
from kvcopy.planner.decision import seconds_text
from kvcopy.tools import cli

from helpers.hf import MODEL_CASES, ROOMY_BLOCKS, crossover_profile, engine_law, time_by_law

pytestmark = [pytest.mark.engine, pytest.mark.slow]

LLAMA = MODEL_CASES[0]
# helpers.hf's ContinuousBatchingConfig: forwards of at most this many tokens.
MAX_BATCH_TOKENS = 256


def errors(decisions: list[kvt.OffloadDecision]) -> dict[tuple[str, int], float]:
    """|predicted for the path taken / measured - 1| per measured decision, keyed by (request, prefix)."""
    return {(d.request_id, d.prefix_tokens): d.prediction_error for d in decisions if d.prediction_error is not None}


# The learned predictions' median error must be at most this share of the calibration's, on the same
# preemptions: with the engine timed by helpers.hf.engine_law, far slower than the calibration, the learned
# profile closes most of the gap (measured: 0.21 against 0.81, the same on every run).
LEARNED_ERROR_SHARE = 0.5


def test_learning_makes_the_later_predictions_closer_to_what_the_engine_measures(monkeypatch):
    """The engine's forwards and copies are timed by a known law (helpers.hf.time_by_law), far from the
    calibration: what the decisions learn from, and what their paths measure, is that law whatever the
    machine's load. Learning must bring the later predictions closer to it than the calibration's."""
    model = LLAMA.build()
    # a CPU machine's calibration: host-to-host copies only (the Planner loads by h2d where a profile has it)
    base = dataclasses.replace(crossover_profile(model), directions={"h2h": crossover_profile(model).directions["h2h"]})
    spec = kvt.model_spec(model)
    law = kvcopy.Planner.from_profile(engine_law(model, base), spec)
    time_by_law(monkeypatch, law)
    runs = {}
    for learn in (False, True):
        # policy "offload": every preempted request takes the same path in both runs, so the runs' decisions
        # are the same preemptions, and their predictions are judged against the same kind of measurement
        with kvt.offloading(model, host_gib=0.25, policy="offload", profile=base, learn=learn) as stats:
            LLAMA.generate(model)
        runs[learn] = stats
    assert all(d.observations == 0 for d in runs[False].decisions)
    learned = [d for d in runs[True].decisions if d.observations > 0]
    assert learned, "no decision was made from a learned profile"
    static = errors(runs[False].decisions)
    later = {key: e for key, e in errors(learned).items() if key in static}
    assert later, "no preemption of the learning run was measured in both runs"
    assert all(later[key] < static[key] for key in later), (later, static)
    assert statistics.median(later.values()) <= LEARNED_ERROR_SHARE * statistics.median(static[k] for k in later)
    # and each half of a path, the copy and the forwards, was learned: the learned profile is closer to the law
    calibrated, learned_planner = (
        kvcopy.Planner.from_profile(base, spec),
        kvcopy.Planner.from_profile(runs[True].profile, spec),
    )
    for d in learned:
        for predict in (
            lambda p, d=d: p.t_load_nbytes(d.reload_nbytes),
            lambda p, d=d: p.t_prefill(d.new_tokens, d.prefix_tokens),
        ):
            gap = abs(predict(calibrated) - predict(law))
            assert abs(predict(learned_planner) - predict(law)) <= LEARNED_ERROR_SHARE * gap


def test_the_first_decisions_are_the_calibrations_and_later_ones_use_only_earlier_observations():
    model = LLAMA.build()
    base = crossover_profile(model)
    with kvt.offloading(model, host_gib=0.25, policy="offload", profile=base) as stats:
        LLAMA.generate(model)
    first = stats.decisions[0]
    planner = kvcopy.Planner.from_profile(base, kvt.model_spec(model))
    expected = predict_paths(planner, first.prefix_tokens, first.new_tokens, first.reload_nbytes, MAX_BATCH_TOKENS)
    assert first.observations == 0 and (first.predicted_reload_s, first.predicted_recompute_s) == expected
    counts = [d.observations for d in stats.decisions]
    assert counts == sorted(counts)  # a decision's profile never holds more than was observed by then
    observed = stats.profile.hardware["online"]["observations"]
    assert counts[-1] <= sum(observed.values())
    assert observed["prefill"] >= REFIT_EVERY and observed["h2h cpu"] > 0
    # On the wall clock, only what no load can invert: transformers' forwards carry milliseconds of Python, above
    # the calibration's 1-token forward (microseconds), and a loaded machine only makes them slower.
    learned = kvcopy.Planner.from_profile(stats.profile, kvt.model_spec(model))
    assert learned.t_prefill(1) > planner.t_prefill(1)


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_fp32_tokens_are_unchanged_while_learning(case):
    model = case.build(torch.float32)
    expected = case.generate(model, ROOMY_BLOCKS)
    with kvt.offloading(model, host_gib=0.25, policy="auto", profile=crossover_profile(model)) as stats:
        assert case.generate(model) == expected
    assert stats.decisions and stats.reloaded_requests + stats.recomputed_requests > 0
    assert any(d.observations > 0 for d in stats.decisions), "no decision was made from a learned profile"
    assert stats.host_blocks_in_use == 0


def test_the_learned_profile_is_saved_and_the_next_start_and_kvcopy_plan_begin_there(tmp_path, capsys):
    model = LLAMA.build()
    path = tmp_path / "learned.json"
    with kvt.offloading(model, host_gib=0.25, policy="auto", profile=crossover_profile(model), save_profile=path):
        LLAMA.generate(model)
    saved = kvcopy.Profile.load(path)
    online = saved.hardware["online"]
    assert online["learned_online"] and online["observations"]["prefill"] > 0 and online["base"] is not None
    spec = kvt.model_spec(model)
    assert saved.prefill.model == spec.name and saved.prefill.num_layers == spec.num_layers
    # the next start decides from it at once
    with kvt.offloading(model, host_gib=0.25, policy="auto", profile=path) as stats:
        LLAMA.generate(model)
    first = stats.decisions[0]
    expected = predict_paths(
        kvcopy.Planner.from_profile(saved, spec),
        first.prefix_tokens,
        first.new_tokens,
        first.reload_nbytes,
        MAX_BATCH_TOKENS,
    )
    assert first.observations == 0 and (first.predicted_reload_s, first.predicted_recompute_s) == expected
    # and `kvcopy plan --profile` reads it
    config = tmp_path / "config.json"
    model.config.to_json_file(config)
    capsys.readouterr()
    assert cli.main(["plan", "--profile", str(path), "--model", str(config), "--prefix", "128"]) == 0
    printed = capsys.readouterr().out
    planned = kvcopy.Planner.from_profile(saved, kvcopy.ModelSpec.from_hf_config(str(config))).decide(128, 1)
    assert "decision: " in printed and f"recompute {seconds_text(planned.t_recompute)}" in printed


def test_learning_without_a_calibration_starts_as_offload_and_then_plans(monkeypatch):
    monkeypatch.setenv("KVCOPY_PROFILE", "none")
    monkeypatch.setattr(kvcopy.profile, "_default", {})
    model = LLAMA.build()
    with kvt.offloading(model, host_gib=0.25, policy="auto", profile=None) as stats:
        LLAMA.generate(model)
    assert "no profile" in stats.decisions[0].reason and stats.decisions[0].predicted_reload_s is None
    planned = [d for d in stats.decisions if d.predicted_reload_s is not None]
    assert planned and all(d.observations > 0 and "learned from" in d.reason for d in planned)
    assert stats.profile.hardware["online"]["base"] is None
