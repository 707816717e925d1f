"""The agent bench: what each retention policy gains over LRU at agents' pauses, as a fraction of an oracle's gain,
under vLLM's real Scheduler and tiering manager with bench_vllm_tiers.py's CPU rig (tests/helpers/vllm_tiers.py).

The arms, one after another on the same seeded trace, each a new engine with a new disk tier:

- ``vllm_fs_lru``: vLLM's stock ``TieringOffloadingSpec`` over its ``fs`` tier (the CPU stand-in worker): LRU;
- ``kvcopy_off``: kvcopy's tiered spec over ``KVCopyDiskTier``, ``kvcopy_agents: "off"`` (kvcopy today);
- ``kvcopy_learned``: agents ``"auto"``, no hints: sessions learned by prefix continuation;
- ``kvcopy_hints``: every request carries a pause hint (``kv_transfer_params``' ``"kvcopy"``): its session, the
  true tool (None for a user's wait) and ``resume_in_s`` = the true gap x a log-normal factor (sigma
  HINT_ERROR_SIGMA); the session's last turn says ``done``;
- ``oracle``: the same hints with the exact gap, and the manager's forecast of each pause replaced by a point
  mass at it (AgentPauses._forecast patched): the same planner, leases, bounds and capacity, knowing every
  resume time.

The trace (:func:`make_trace`; parameters and sources in docs/measurements.md, "The agent bench"): sessions
arrive as a Poisson process; each has a number of turns; its first prompt is FIRST_CONTEXT tokens (TraceLab's
154K input tokens per step, scaled 1/150) and each turn appends the previous turn's output token and a
log-normal number of new tokens (median APPEND_MEDIAN: TraceLab's 6.6K appended per step, scaled alike). The
pause after a turn is a user's wait with probability HUMAN_SHARE (TraceLab: 9.2 user requests per 73.6
tool-initiated steps), log-normal p50 1.4 min / p90 20.6 min, else a tool's, from per-tool log-normal classes
(TOOLS) whose mixture has TraceLab's p50 0.3 s and p90 13.6 s. Gaps are real seconds, truncated at
``--truncate-s``, so that the run fits its time.

Time. The rig's KV is 16 layers x 8 KV heads x 128 dims in fp32: 2 MiB per 16-token block, the bytes of
Llama-3.1-8B's 32 layers in bf16. Its model config has Llama-3.1-8B's dimensions (hidden 4096, 32 heads,
intermediate 14336) over those 16 layers. Each forward of the rig is charged what Llama-3.1-8B's would take on
an H200: the H200 profile's prefill roofline (results/gpu_h200_2026-12-04/profile.json, calibrated with
llama-3.1-8b) for the step's scheduled tokens after their cached ones, plus its host->device load line (the
fastest method) for the blocks the step's load jobs bring in; the forward writes its KV, then sleeps until that
time since it began (a forward whose CPU work takes longer is counted: ``overshoot``). kvcopy's arms plan with a
profile built from the same lines (its prefill rates scaled so that the rig's 16-layer config predicts
Llama-3.1-8B's seconds: checked in the header) plus this machine's disk read line (results/profile_cpu_disk.json),
with ``kvcopy_learn`` off. The disk tiers read and write this machine's disk for real (2 MiB chunks).

What is measured per arm: each resume's TTFT (its arrival, ``add_request``, to the end of the step whose forward
finishes its prompt), by its gap's bucket; tokens recomputed (a resume's tokens computed beyond those after the
previous turn's complete blocks); bytes read from the secondary tier (every promotion job's chunks) and wasted
(prefetched chunks read back and gone from host RAM when their session resumed, or read back for a session that
never came back before the prefetch's end: a chunk still being read at the resume is not wasted, the resume
waits on it); host byte-seconds leased
(the leased chunks' bytes, integrated over the run); the agents' counters; the forecaster's calibration (the
fraction of resumes inside the forecast's 10-90% band, the median |forecast median / actual - 1|). Then each
arm's fraction of the oracle's gain over mean resume TTFT, (LRU - arm) / (LRU - oracle). Last, a trace with no
pauses (every turn arrives as the previous one finishes) through every arm, ``--no-pause-runs`` times each,
interleaved: the medians of makespan and mean TTFT against LRU's (one run varies by more than the 2% it is
judged at).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_agents.py [--seed 7] [--sessions 12] [--turns 4,10]
        [--truncate-s 30] [--no-pause-runs 5] [--dir /path/on/the/disk] [--csv out.csv] [--txt out.txt] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import heapq
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm_tiers as tiers_bench  # (its rig and its tiers' configuration, reused)

from kvcopy.calibration.machine import machine_identity
from kvcopy.model import ModelSpec
from kvcopy.planner import Planner
from kvcopy.profile import DISK_METHOD, DISK_READ_DIRECTION, Profile
from kvcopy.tools.bench.report import IDENTITY_COLUMNS

vllm_rig, tiers_rig = tiers_bench.vllm_rig, tiers_bench.tiers_rig
BLOCK_TOKENS = tiers_bench.BLOCK_TOKENS
ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------- the trace

# Per-tool classes of a tool's execution: (name, weight, median s, log-sigma). Fast reads ~0.1 s, edits ~0.35 s,
# web calls ~3 s, test runs 12 s (5-95%: 2.7-53 s). The weights were solved so that the mixture's p50 and p90
# are TraceLab's tool execution (arXiv 2606.30560): 0.3 s and 13.6 s (the mixture gives 0.300 s and 13.6 s).
TOOLS: tuple[tuple[str, float, float, float], ...] = (
    ("read_file", 0.38, 0.1, 0.6),
    ("edit_file", 0.32, 0.35, 0.7),
    ("web_search", 0.08, 3.0, 0.8),
    ("run_tests", 0.22, 12.0, 0.9),
)
# A user's think time, TraceLab: p50 1.4 min, p90 20.6 min (log-normal through them: sigma 2.10).
HUMAN_MEDIAN_S, HUMAN_P90_S = 84.0, 20.6 * 60.0
# The share of pauses that are a user's, TraceLab's per-session averages: 9.2 / (9.2 + 73.6) = 1/9.
HUMAN_SHARE = 9.2 / (9.2 + 73.6)
# Contexts: TraceLab's ~154K input tokens per step and ~6.6K appended, scaled 1/150 (a 2-core machine writes
# and reads every chunk for real); the appended count is log-normal around its median.
FIRST_CONTEXT = 1024
APPEND_MEDIAN, APPEND_SIGMA = 44, 0.6
# Client estimates in the hints arm: the true gap times exp(N(0, sigma)), sigma as the issue sets it.
HINT_ERROR_SIGMA = 0.5
Z_90 = 1.2815515655446004  # the standard normal's 90% quantile

# The full run and the smoke test. Sessions arrive over ARRIVAL_SPAN_S (Poisson); turns uniform in [lo, hi].
# The trace without pauses is short (a few seconds an arm) and its makespan varies run to run by more than the
# 2% it is judged at (vLLM's fs tier: 3.26-4.98 s over the committed run's five, on an idle machine): each arm runs it
# no_pause_runs times, and the medians are compared.
FULL = {"sessions": 12, "turns": "4,10", "truncate_s": 30.0, "arrival_span_s": 20.0, "first_context": FIRST_CONTEXT,
        "no_pause_runs": 5}  # fmt: skip
QUICK = {"sessions": 3, "turns": "3,3", "truncate_s": 0.5, "arrival_span_s": 0.3, "first_context": 64,
         "no_pause_runs": 1}  # fmt: skip


@dataclass(frozen=True)
class Turn:
    """One request of a session: its prompt, and the pause after it (None after the last turn)."""

    tokens: tuple[int, ...]
    gap_s: float | None
    tool: str | None  # the tool that runs in the pause (None: the user's wait, or none after the last turn)
    estimate_s: float | None  # the hints arm's resume_in_s


@dataclass(frozen=True)
class Session:
    name: str
    arrival_s: float
    turns: tuple[Turn, ...]


def tool_quantiles(qs: Sequence[float], samples: int = 200_000, seed: int = 0) -> list[float]:
    """The tool mixture's quantiles, from ``samples`` draws (reported beside TraceLab's)."""
    rng = np.random.default_rng(seed)
    names = rng.choice(len(TOOLS), size=samples, p=[t[1] for t in TOOLS])
    medians = np.array([t[2] for t in TOOLS])[names]
    sigmas = np.array([t[3] for t in TOOLS])[names]
    draws = medians * np.exp(sigmas * rng.standard_normal(samples))
    return [float(np.quantile(draws, q)) for q in qs]


def make_trace(
    seed: int, sessions: int, turns: tuple[int, int], truncate_s: float, arrival_span_s: float, first_context: int
) -> list[Session]:
    """The seeded agent trace (see the module): sessions, their turns' prompts and pauses."""
    rng = np.random.default_rng(seed)
    arrivals = np.sort(rng.uniform(0.0, arrival_span_s, size=sessions))  # a Poisson process, given its count
    human_sigma = math.log(HUMAN_P90_S / HUMAN_MEDIAN_S) / Z_90
    out = []
    for i in range(sessions):
        count = int(rng.integers(turns[0], turns[1] + 1))
        tokens = tiers_bench.prompt_tokens(seed * 100_000 + i, first_context)
        made = []
        for k in range(count):
            if k:
                scale = first_context / FIRST_CONTEXT * math.exp(APPEND_SIGMA * rng.standard_normal())
                append = max(1, round(APPEND_MEDIAN * scale))
                tokens = [*tokens, 1, *(int(t) for t in rng.integers(0, tiers_bench.VOCAB, size=append))]
            if k == count - 1:
                made.append(Turn(tuple(tokens), None, None, None))
                break
            if rng.random() < HUMAN_SHARE:
                tool, gap = None, HUMAN_MEDIAN_S * math.exp(human_sigma * rng.standard_normal())
            else:
                index = int(rng.choice(len(TOOLS), p=[t[1] for t in TOOLS]))
                name, _, median, sigma = TOOLS[index]
                tool, gap = name, median * math.exp(sigma * rng.standard_normal())
            gap = min(gap, truncate_s)
            estimate = gap * math.exp(HINT_ERROR_SIGMA * rng.standard_normal())
            made.append(Turn(tuple(tokens), gap, tool, estimate))
        out.append(Session(f"s{i}", float(arrivals[i]), tuple(made)))
    return out


def without_pauses(trace: list[Session], arrival_scale: float = 0.1) -> list[Session]:
    """The same sessions with every gap 0 (each turn arrives as the previous one finishes), arriving
    ``arrival_scale`` as spread."""
    return [
        Session(
            s.name,
            s.arrival_s * arrival_scale,
            tuple(
                replace(t, gap_s=None if t.gap_s is None else 0.0, estimate_s=None if t.gap_s is None else 0.0)
                for t in s.turns
            ),
        )
        for s in trace
    ]


# ----------------------------------------------------------------------------------------------- the costs

H200_PROFILE = ROOT / "results" / "gpu_h200_2026-12-04" / "profile.json"
DISK_PROFILE = ROOT / "results" / "profile_cpu_disk.json"
NAMED_MODEL = "llama-3.1-8b"
# The rig's model config: Llama-3.1-8B's dimensions (its preset), the rig's own layers, KV heads and head size.
LLAMA_DIMS = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32}


RigModel = tiers_bench.Model  # the stand-in model's KV dimensions (fp32), as the tier bench's

FULL_MODEL = RigModel(16, 8, 128)  # 2 MiB a block: Llama-3.1-8B's 32 layers' bytes in bf16
QUICK_MODEL = RigModel(2, 2, 16)


def rig_config(model: RigModel, max_model_len: int) -> dict[str, Any]:
    """The config.json the rig's model directory gets (helpers.vllm.write_model_dir's, with LLAMA_DIMS)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **LLAMA_DIMS,
        "num_hidden_layers": model.layers,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": 256,
        "max_position_embeddings": max_model_len,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-5,
        "eos_token_id": vllm_rig.EOS,
    }


def llama_dims_model_dir() -> Callable[[], None]:
    """Makes helpers.vllm.write_model_dir write LLAMA_DIMS into the rig's config; returns the undo."""
    original = vllm_rig.write_model_dir

    def written(path: str, num_layers: int, sliding_window: int | None = None, **kwargs: Any) -> str:
        import json

        path = original(path, num_layers, sliding_window, **kwargs)
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config.update(LLAMA_DIMS)
        with open(config_path, "w") as f:
            json.dump(config, f)
        return path

    vllm_rig.write_model_dir = written
    return lambda: setattr(vllm_rig, "write_model_dir", original)


@dataclass
class Costs:
    """What a step is charged (the named model on the named GPU), and the profile kvcopy's arms plan with."""

    charge: Planner  # llama-3.1-8b on the H200 profile
    kvcopy_profile: str  # the path of the profile kvcopy's arms get
    rig_planner: Planner  # what kvcopy's arms predict for the rig's model, to check against ``charge``
    block_bytes: int

    def load_s(self, blocks: Sequence[int]) -> float:
        """One load call per job of ``blocks`` blocks."""
        return sum(self.charge.t_load_nbytes(n * self.block_bytes) for n in blocks if n)

    def forward_s(self, new: Sequence[int], cached: Sequence[int]) -> float:
        return self.charge.t_forward(list(new), list(cached))


def make_costs(model: RigModel, max_model_len: int, work: str) -> Costs:
    h200 = Profile.load(H200_PROFILE)
    llama = ModelSpec.preset(NAMED_MODEL)
    rig_spec = ModelSpec.from_hf_config(rig_config(model, max_model_len), name="rig")
    charge = Planner.from_profile(h200, llama, block_tokens=BLOCK_TOKENS)
    # kvcopy's prefill rates scaled so the rig's config predicts Llama's seconds (FLOPs and weight bytes are
    # linear in the layers; the ratio taken at 1024 tokens)
    flops_ratio = rig_spec.prefill_flops(1024, 0) / llama.prefill_flops(1024, 0)
    weight_ratio = rig_spec.weight_bytes(1024, 0) / llama.weight_bytes(1024, 0)
    assert h200.prefill is not None
    prefill = replace(
        h200.prefill,
        flops_per_s=h200.prefill.flops_per_s * flops_ratio,
        weight_bytes_per_s=None
        if h200.prefill.weight_bytes_per_s is None
        else h200.prefill.weight_bytes_per_s * weight_ratio,
        model="rig",
    )
    disk = Profile.load(DISK_PROFILE).directions[DISK_READ_DIRECTION][DISK_METHOD]
    directions = {**h200.directions, DISK_READ_DIRECTION: {DISK_METHOD: disk}}
    hardware = {**h200.hardware, "note": f"H200 lines, prefill scaled to the rig's config; disk: {DISK_PROFILE.name}"}
    profile = Profile(hardware=hardware, directions=directions, peaks=dict(h200.peaks), prefill=prefill)
    path = os.path.join(work, "kvcopy_profile.json")
    profile.save(path)
    rig_planner = Planner.from_profile(profile, rig_spec, block_tokens=BLOCK_TOKENS)
    return Costs(charge, path, rig_planner, model.block_bytes)


# ----------------------------------------------------------------------------------------------- the arms

ARMS = ("vllm_fs_lru", "kvcopy_off", "kvcopy_learned", "kvcopy_hints", "oracle")
BUCKETS = ((0.0, 1.0, "<1s"), (1.0, 10.0, "1-10s"), (10.0, 60.0, "10-60s"), (60.0, math.inf, ">60s"))
IDLE_SLEEP_S = 0.002  # the driver's nap when nothing is due: short against a forward


class ExactGap:
    """A point mass at a pause's true length: the oracle's forecast."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s

    def quantile(self, q: float) -> float:
        return self.gap_s

    def quantiles(self, qs: Sequence[float]) -> np.ndarray:
        return np.full(len(qs), self.gap_s)


@dataclass
class ArmResult:
    arm: str
    ttft_s: list[tuple[float, float]] = field(default_factory=list)  # (gap before it, TTFT) of each resume
    first_ttft_s: list[float] = field(default_factory=list)  # each session's first turn
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    disk_read_bytes: int = 0
    wasted_bytes: int = 0
    leased_byte_s: float = 0.0
    makespan_s: float = 0.0
    overshoot_s: float = 0.0  # forward CPU time beyond the charge, summed
    overshoot_steps: int = 0
    steps: int = 0
    counters: dict[str, dict[tuple, float]] = field(default_factory=dict)
    forecast: list[tuple[float, float, float, float]] = field(default_factory=list)  # (median, p10, p90, actual)

    def mean_resume_ttft(self) -> float:
        return statistics.fmean(t for _, t in self.ttft_s) if self.ttft_s else float("nan")


def make_arm_rig(arm: str, work: str, model: RigModel, costs: Costs, host_chunks: int, gpu_blocks: int,
                 max_model_len: int, tier_bytes: int) -> Any:  # fmt: skip
    tier = "vllm fs" if arm == "vllm_fs_lru" else "kvcopy disk"
    config = tiers_bench.tier_config(tier, os.path.join(work, "tier"), tier_bytes)
    spec, extra = None, None
    if arm != "vllm_fs_lru":
        spec = vllm_rig.SPEC_PATH
        extra = {
            "kvcopy_profile": costs.kvcopy_profile,
            "kvcopy_learn": False,
            "kvcopy_agents": "off" if arm == "kvcopy_off" else "auto",
        }
    return tiers_rig.make_tiering_rig(
        Path(work),
        secondary_tiers=[config],
        spec=spec,
        extra=extra,
        cpu_bytes_to_use=host_chunks * model.block_bytes,
        num_blocks=gpu_blocks,
        max_batch_tokens=min(2048, max_model_len),
        max_model_len=max_model_len,
        num_layers=model.layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
    )


def charge_forwards(rig: Any, costs: Costs, result: ArmResult) -> None:
    """Each forward of ``rig`` takes what the named model's would (see the module)."""
    forward = rig._forward

    def charged(output: Any) -> dict[str, int]:
        start = time.perf_counter()
        new, cached = [], []
        for request_id, count in output.num_scheduled_tokens.items():
            new.append(count)
            cached.append(rig.requests[request_id].num_computed_tokens - count)
        jobs = getattr(output.kv_connector_metadata, "load_jobs", {}) or {}
        blocks = [len(job.dst_spec.block_ids) for job in jobs.values()]
        seconds = costs.load_s(blocks) + (costs.forward_s(new, cached) if new else 0.0)
        computed = forward(output)
        left = start + seconds - time.perf_counter()
        if left > 0:
            time.sleep(left)
        elif seconds:
            result.overshoot_s -= left
            result.overshoot_steps += 1
        return computed

    rig._forward = charged


def spy_reads(rig: Any, result: ArmResult, block_bytes: int) -> None:
    """Every promotion job's chunks counted as bytes read from the secondary tier."""
    (tier,) = rig.tiers
    submit = tier.submit_load

    def counted(job: Any) -> Any:
        result.disk_read_bytes += len(job.keys) * block_bytes
        return submit(job)

    tier.submit_load = counted


def spy_pauses(rig: Any, arm: str, result: ArmResult, block_bytes: int) -> None:
    """The agents' counters, the forecasts scored at each resume, the prefetched chunks not in host RAM at their
    resume; for the oracle, the forecast replaced by the exact gap."""
    from vllm.v1.kv_offload.base import LookupResult

    pauses = getattr(rig.manager, "pauses", None)
    get_stats = rig.manager.get_stats

    def collecting() -> Any:
        stats = get_stats()
        if stats is not None:
            for name, by_label in stats.metric_sections()[1].items():
                if "_agent_" not in name:
                    continue
                for labels, value in by_label.items():
                    if not isinstance(value, (int, float)):
                        continue  # (a histogram's observations: scored from the forecasts instead)
                    mine = result.counters.setdefault(name.rsplit("_agent_", 1)[-1], {})
                    mine[labels] = mine.get(labels, 0) + value
        return stats

    rig.manager.get_stats = collecting
    if pauses is None:
        return
    resume = pauses._resume

    def scored(context: Any, found: Any) -> None:
        if found is not None:
            pause, gap = found
            planned = pauses._planned.get(pause.session)
            if planned is not None and gap > 0:
                result.forecast.append((planned.median, planned.band[0], planned.band[1], gap))
            prefetch = pauses._prefetches.get(pause.session)
            if prefetch is not None and prefetch.started:
                primary = rig.manager.primary_tier
                # (a chunk still being read is not wasted: the resume waits on it, HIT_PENDING)
                gone = sum(primary.lookup(key, context) is LookupResult.MISS for key in prefetch.read)
                result.wasted_bytes += gone * block_bytes
        resume(context, found)

    pauses._resume = scored
    end = pauses._end

    def ended(session: str) -> None:
        prefetch = pauses._prefetches.get(session)
        if prefetch is not None:  # (ended before its session came back: its reads were never used)
            result.wasted_bytes += len(prefetch.read) * block_bytes
        end(session)

    pauses._end = ended
    if arm == "oracle":
        forecast = pauses._forecast

        def exact(session: str, hint: Any) -> Any:
            if hint is not None and hint.resume_in_s is not None:
                return ExactGap(hint.resume_in_s)
            return forecast(session, hint)

        pauses._forecast = exact


def hint_of(arm: str, session: Session, turn: Turn) -> dict[str, Any] | None:
    if arm not in ("kvcopy_hints", "oracle"):
        return None
    if turn.gap_s is None:
        return {"kvcopy": {"session": session.name, "done": True}}
    estimate = turn.gap_s if arm == "oracle" else turn.estimate_s
    hint: dict[str, Any] = {"session": session.name, "resume_in_s": float(estimate)}
    if turn.tool is not None:
        hint["tool"] = turn.tool
    return {"kvcopy": hint}


def run_arm(
    arm: str, trace: list[Session], work: str, model: RigModel, costs: Costs, sizes: dict[str, int]
) -> ArmResult:
    """The trace through one arm's engine, in real time (see the module)."""
    result = ArmResult(arm)
    undo = llama_dims_model_dir()
    try:
        rig = make_arm_rig(arm, work, model, costs, **sizes)
    finally:
        undo()
    try:
        charge_forwards(rig, costs, result)
        spy_reads(rig, result, model.block_bytes)
        spy_pauses(rig, arm, result, model.block_bytes)
        pauses = rig.manager.pauses if arm != "vllm_fs_lru" else None
        row_bytes = int(rig.region.shape[1])
        steps_before = len(rig.forwards)
        due: list[tuple[float, int, int, float]] = [(s.arrival_s, i, 0, 0.0) for i, s in enumerate(trace)]
        heapq.heapify(due)
        live: dict[str, tuple[int, int, float, float]] = {}  # request -> (session, turn, arrival, gap before)
        start = time.monotonic()
        last = start
        while due or live:
            now = time.monotonic() - start
            while due and due[0][0] <= now:
                _, i, k, gap = heapq.heappop(due)
                session, turn = trace[i], trace[i].turns[k]
                request_id = f"{arm}-{session.name}-t{k}"
                rig.add(request_id, list(turn.tokens), kv_transfer_params=hint_of(arm, session, turn))
                live[request_id] = (i, k, time.monotonic(), gap)
            busy = rig.scheduler.has_requests() or rig._transfers_pending() or rig.manager.has_pending_work()
            if busy:
                rig.step()
            else:
                wait = (due[0][0] - (time.monotonic() - start)) if due else IDLE_SLEEP_S
                time.sleep(min(max(wait, 0.0), IDLE_SLEEP_S))
            clock = time.monotonic()
            if pauses is not None:
                result.leased_byte_s += pauses.policy.leased() * row_bytes * (clock - last)
            last = clock
            for request_id in [r for r in live if rig.requests[r].is_finished()]:
                i, k, arrived, gap = live.pop(request_id)
                ttft = clock - arrived
                computed = sum(f.get(request_id, 0) for f in rig.forwards)
                result.computed_tokens += computed
                turns = trace[i].turns
                if k:
                    result.ttft_s.append((gap, ttft))
                    needed = len(turns[k].tokens) - len(turns[k - 1].tokens) // BLOCK_TOKENS * BLOCK_TOKENS
                    result.recomputed_tokens += max(0, computed - needed)
                else:
                    result.first_ttft_s.append(ttft)
                if turns[k].gap_s is not None:
                    heapq.heappush(due, (clock - start + turns[k].gap_s, i, k + 1, turns[k].gap_s))
        result.makespan_s = time.monotonic() - start
        rig.drain()
        result.steps = len(rig.forwards) - steps_before
        if pauses is not None:
            for prefetch in pauses._prefetches.values():  # read back, and never resumed
                result.wasted_bytes += len(prefetch.read) * model.block_bytes
    finally:
        rig.close()
    return result


# ----------------------------------------------------------------------------------------------- the report


def bucket_of(gap: float) -> str:
    return next(name for low, high, name in BUCKETS if low <= gap < high)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def fractions(results: dict[str, ArmResult]) -> dict[str, float]:
    """(LRU - arm) / (LRU - oracle) over mean resume TTFT."""
    lru, oracle = results["vllm_fs_lru"].mean_resume_ttft(), results["oracle"].mean_resume_ttft()
    gain = lru - oracle
    return {arm: (lru - r.mean_resume_ttft()) / gain if gain else float("nan") for arm, r in results.items()}


def calibration(result: ArmResult) -> tuple[float, float, int]:
    """(fraction of resumes inside the forecast's 10-90% band, median |median / actual - 1|, resumes scored)."""
    if not result.forecast:
        return float("nan"), float("nan"), 0
    inside = statistics.fmean(1.0 if low <= actual <= high else 0.0 for _, low, high, actual in result.forecast)
    error = statistics.median(abs(median / actual - 1.0) for median, _, _, actual in result.forecast)
    return inside, error, len(result.forecast)


def rows_of(results: dict[str, ArmResult], flat: dict[str, list[ArmResult]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(
        kind: str, arm: str, metric: str, value: float, unit: str, samples: int, bucket: str = "", note: str = ""
    ) -> None:
        rows.append({"kind": kind, "arm": arm, "metric": metric, "bucket": bucket, "value": value, "unit": unit,
                     "samples": samples, "note": note})  # fmt: skip

    share = fractions(results)
    for arm, r in results.items():
        for _, _, name in BUCKETS:
            values = [t for g, t in r.ttft_s if bucket_of(g) == name]
            for q in (50, 90):
                add("resume", arm, f"ttft_p{q}", percentile(values, q) * 1e3, "ms", len(values), name)
        add("resume", arm, "ttft_mean", r.mean_resume_ttft() * 1e3, "ms", len(r.ttft_s), "all")
        add("resume", arm, "first_turn_ttft_mean", statistics.fmean(r.first_ttft_s) * 1e3, "ms", len(r.first_ttft_s))
        add("arm", arm, "tokens_recomputed", r.recomputed_tokens, "tokens", len(r.ttft_s))
        add("arm", arm, "tokens_computed", r.computed_tokens, "tokens", len(r.ttft_s) + len(r.first_ttft_s))
        add("arm", arm, "disk_read_bytes", r.disk_read_bytes, "bytes", 0)
        add("arm", arm, "prefetched_wasted_bytes", r.wasted_bytes, "bytes", 0)
        add("arm", arm, "host_leased_byte_s", r.leased_byte_s, "byte*s", 0)
        add("arm", arm, "makespan", r.makespan_s, "s", r.steps)
        add("arm", arm, "forward_overshoot", r.overshoot_s, "s", r.overshoot_steps, note="CPU work beyond the charge")
        inside, error, scored = calibration(r)
        add("forecast", arm, "resumes_in_10_90_band", inside, "fraction", scored)
        add("forecast", arm, "median_abs_median_over_actual_minus_1", error, "ratio", scored)
        for name, by_label in sorted(r.counters.items()):
            for labels, value in sorted(by_label.items()):
                add("counter", arm, f"{name}:{','.join(map(str, labels))}", value, "count", 0)
        add("fraction", arm, "fraction_of_oracle_gain", share[arm], "", len(r.ttft_s))
    lru_makespan = statistics.median(r.makespan_s for r in flat["vllm_fs_lru"])
    for arm, runs in flat.items():
        makespans = [r.makespan_s for r in runs]
        add("no_pause", arm, "makespan", statistics.median(makespans), "s", len(runs), note="median of the runs")
        add("no_pause", arm, "makespan_min", min(makespans), "s", len(runs))
        add("no_pause", arm, "makespan_max", max(makespans), "s", len(runs))
        ttfts = [statistics.fmean([t for _, t in r.ttft_s] + r.first_ttft_s) * 1e3 for r in runs]
        add("no_pause", arm, "ttft_mean", statistics.median(ttfts), "ms", len(runs), note="median of the runs")
        ratio = statistics.median(makespans) / lru_makespan
        add("no_pause", arm, "makespan_over_lru", ratio, "ratio", len(runs), note="medians")
    return rows


TABLE = (
    ("arm", "tokens_recomputed"),
    ("arm", "disk_read_bytes"),
    ("arm", "prefetched_wasted_bytes"),
    ("arm", "host_leased_byte_s"),
    ("forecast", "resumes_in_10_90_band"),
    ("forecast", "median_abs_median_over_actual_minus_1"),
    ("arm", "makespan"),
    ("arm", "forward_overshoot"),
)


def report(rows: list[dict[str, Any]], header: str) -> str:
    by = {(r["kind"], r["arm"], r["metric"], r["bucket"]): r for r in rows}
    lines = [header, "", "resume TTFT, ms (p50 / p90, resumes) by the gap before the resume"]
    lines.append(f"{'arm':<16}" + "".join(f"{name:>24}" for _, _, name in BUCKETS) + f"{'mean':>10}")
    for arm in ARMS:
        cells = []
        for _, _, name in BUCKETS:
            p50, p90 = by[("resume", arm, "ttft_p50", name)], by[("resume", arm, "ttft_p90", name)]
            cells.append(f"{p50['value']:.1f} / {p90['value']:.1f} ({p50['samples']})")
        mean = by[("resume", arm, "ttft_mean", "all")]["value"]
        lines.append(f"{arm:<16}" + "".join(f"{c:>24}" for c in cells) + f"{mean:>10.1f}")
    lines += ["", f"{'arm':<16}{'recomputed':>12}{'disk read MB':>14}{'wasted MB':>11}{'leased GB*s':>13}"
              f"{'in band':>9}{'|med/act-1|':>13}{'makespan s':>12}{'overshoot s':>13}"]  # fmt: skip
    for arm in ARMS:
        v = {m: by[(k, arm, m, "")]["value"] for k, m in TABLE}
        lines.append(
            f"{arm:<16}{v['tokens_recomputed']:>12.0f}{v['disk_read_bytes'] / 1e6:>14.1f}"
            f"{v['prefetched_wasted_bytes'] / 1e6:>11.1f}{v['host_leased_byte_s'] / 1e9:>13.2f}"
            f"{v['resumes_in_10_90_band']:>9.2f}{v['median_abs_median_over_actual_minus_1']:>13.2f}"
            f"{v['makespan']:>12.1f}{v['forward_overshoot']:>13.2f}"
        )
    lines += ["", "the agents' counters (kvcopy's arms)"]
    for arm in ARMS:
        said = [f"{r['metric']}={r['value']:g}" for r in rows if r["kind"] == "counter" and r["arm"] == arm]
        if said:
            lines.append(f"{arm:<16}" + " ".join(said))
    runs = by[("no_pause", "vllm_fs_lru", "makespan", "")]["samples"]
    lines += ["", f"no pauses (back-to-back turns), {runs} runs of each arm interleaved: medians (makespan's range) "
              "against vllm_fs_lru"]  # fmt: skip
    for arm in ARMS:
        m, lo, hi, t, ratio = (
            by[("no_pause", arm, x, "")]["value"]
            for x in ("makespan", "makespan_min", "makespan_max", "ttft_mean", "makespan_over_lru")
        )
        lines.append(
            f"no_pause {arm:<16} makespan {m:.2f} s ({lo:.2f}-{hi:.2f})  ttft_mean {t:.1f} ms  makespan/lru {ratio:.3f}"
        )
    lines.append("")
    for arm in ARMS:
        lines.append(
            f"fraction_of_oracle_gain {arm} {by[('fraction', arm, 'fraction_of_oracle_gain', '')]['value']:.3f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 sessions of 3 turns, a tiny model, gaps <= 0.5 s")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sessions", type=int, help=f"sessions ({FULL['sessions']})")
    parser.add_argument("--turns", help=f"turns per session, lo,hi ({FULL['turns']})")
    parser.add_argument("--truncate-s", type=float, help=f"every gap truncated at this ({FULL['truncate_s']} s)")
    parser.add_argument(
        "--no-pause-runs",
        type=int,
        default=None,
        help=f"runs of each arm on the trace without pauses ({FULL['no_pause_runs']})",
    )
    parser.add_argument("--dir", default=None, help="a directory on the disk under test (default: a temporary one)")
    parser.add_argument("--csv", help="also write the rows here")
    parser.add_argument("--txt", help="also write the report here")
    args = parser.parse_args()
    preset = QUICK if args.quick else FULL
    model = QUICK_MODEL if args.quick else FULL_MODEL
    sessions = args.sessions or int(preset["sessions"])
    lo, hi = (int(x) for x in str(args.turns or preset["turns"]).split(","))
    truncate = args.truncate_s or float(preset["truncate_s"])
    if args.no_pause_runs is None:
        args.no_pause_runs = int(preset["no_pause_runs"])
    if args.no_pause_runs < 1:
        parser.error(f"--no-pause-runs: expected >= 1, got {args.no_pause_runs}")
    first_context = int(preset["first_context"])
    trace = make_trace(args.seed, sessions, (lo, hi), truncate, float(preset["arrival_span_s"]), first_context)
    flat = without_pauses(trace)
    longest = max(len(t.tokens) for s in trace for t in s.turns)
    max_model_len = (longest // BLOCK_TOKENS + 4) * BLOCK_TOKENS
    working_chunks = sum(len(s.turns[-1].tokens) // BLOCK_TOKENS for s in trace)
    sizes = {
        "host_chunks": max(working_chunks // 3, longest // BLOCK_TOKENS + 8),  # a third of the working set
        "gpu_blocks": 2 * (max_model_len // BLOCK_TOKENS) + 8,  # two of the longest contexts
        "max_model_len": max_model_len,
        "tier_bytes": (working_chunks + 64) * model.block_bytes,
    }
    directory = args.dir or tempfile.mkdtemp(prefix="kvcopy-bench-agents-", dir=os.getcwd())
    os.makedirs(directory, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=directory)
    identity = machine_identity(torch.device("cpu"))
    load_at_start = os.getloadavg()
    began = time.monotonic()
    try:
        costs = make_costs(model, max_model_len, work)

        def run_once(arm: str, sessions: list[Session], name: str) -> ArmResult:
            where = os.path.join(work, name)
            try:
                return run_arm(arm, sessions, where, model, costs, sizes)
            finally:  # (each run's tier takes its whole budget of the disk: 30 runs would not fit)
                shutil.rmtree(where, ignore_errors=True)

        results = {arm: run_once(arm, trace, arm) for arm in ARMS}
        flat_results: dict[str, list[ArmResult]] = {arm: [] for arm in ARMS}
        for run in range(args.no_pause_runs):  # (interleaved, each round in another order: a drift hits every arm)
            for arm in ARMS[run % len(ARMS) :] + ARMS[: run % len(ARMS)]:
                flat_results[arm].append(run_once(arm, flat, f"flat-{arm}-{run}"))
    finally:
        shutil.rmtree(directory if args.dir is None else work, ignore_errors=True)
    took = time.monotonic() - began
    rows = rows_of(results, flat_results)
    gaps = [t.gap_s for s in trace for t in s.turns if t.gap_s is not None]
    tool_gaps = [t.gap_s for s in trace for t in s.turns if t.gap_s is not None and t.tool is not None]
    p50, p90 = tool_quantiles((0.5, 0.9))
    checks = ((44, 1024), (1024, 0), (2048, 0))
    predicted = ", ".join(
        f"{n}+{c}: {costs.charge.t_prefill(n, c) * 1e3:.2f} ms (kvcopy's {costs.rig_planner.t_prefill(n, c) * 1e3:.2f})"
        for n, c in checks
    )
    import vllm

    load = " / ".join(f"{x:.2f}" for x in load_at_start)
    users = sum(1 for s in trace for t in s.turns if t.gap_s is not None and t.tool is None)
    rate = costs.charge.prefill_flops_per_s or 0.0
    header = "\n".join(
        [
            f"agents' pauses under vLLM {vllm.__version__}'s Scheduler and tiering (CPU stand-in worker), on "
            f"{identity.get('host_cpu')} ({identity.get('host_cores')} cores), load average at start {load} "
            f"(1/5/15 min), {identity.get('date')}; the whole run {took:.0f} s",
            f"trace (seed {args.seed}): {sessions} sessions arriving over {preset['arrival_span_s']} s, {lo}-{hi} "
            f"turns each ({sum(len(s.turns) for s in trace)} requests, {len(gaps)} resumes), first context "
            f"{first_context} tokens, +{APPEND_MEDIAN * first_context // FIRST_CONTEXT} tokens a turn (median), "
            f"longest {longest}; gaps truncated at {truncate:g} s; tool mixture p50 {p50:.2f} s / p90 {p90:.1f} s "
            f"(TraceLab 0.3 / 13.6), this trace's tool gaps p50 {percentile(tool_gaps, 50):.2f} s / p90 "
            f"{percentile(tool_gaps, 90):.1f} s; user waits {users} (share 1/9)",
            f"rig: {model.layers} layers x {model.kv_heads} KV heads x {model.head_dim} dims fp32, "
            f"{model.block_bytes} bytes a 16-token chunk; host tier {sizes['host_chunks']} chunks (working set "
            f"{working_chunks}); GPU {sizes['gpu_blocks']} blocks; the tier on this machine's disk (vllm_fs_lru: "
            "vLLM's fs; kvcopy: KVCopyDiskTier)",
            f"charged: {NAMED_MODEL} on an H200 (results/gpu_h200_2026-12-04/profile.json: prefill "
            f"{rate / 1e12:.0f} TFLOP/s roofline, host->device load line); prefill new+cached tokens: {predicted}; "
            "kvcopy plans with that profile (prefill scaled to the rig's config) and this machine's disk read "
            "line, kvcopy_learn off",
            f"hints: true tool, resume_in_s x exp(N(0, {HINT_ERROR_SIGMA})); oracle: exact resume_in_s, forecast "
            "a point mass at it; fraction_of_oracle_gain = (LRU - arm) / (LRU - oracle), over mean resume TTFT",
        ]
    )
    text = report(rows, header)
    print(text)
    if args.txt:
        Path(args.txt).write_text(text + "\n")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            columns = ["kind", "arm", "metric", "bucket", "value", "unit", "samples", "note"]
            writer = csv.DictWriter(f, fieldnames=[*IDENTITY_COLUMNS, "load_avg_1min", "seed", *columns])
            writer.writeheader()
            for r in rows:
                ident = {k: identity.get(k, "") for k in IDENTITY_COLUMNS}
                writer.writerow({**ident, "load_avg_1min": f"{load_at_start[0]:.2f}", "seed": args.seed, **r})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
