"""vLLM's ``fs`` tier against kvcopy's ``KVCopyDiskTier``, side by side, under vLLM's real Scheduler, connector and
stock ``TieringOffloadingSpec`` on this machine, with the same CPU stand-in worker (tests/helpers/vllm_tiers.py).

Two engines (rigs) run at once, one per tier, each with its own directory on the disk under test, and take the
same workload in the same rounds, in turn (the order alternates each round, so a disk whose speed drifts slows
both alike). A round, per prefix length: one new prompt is stored (run to its end: its blocks go to the primary
tier, vLLM cascades them to the secondary tier), the stores and cascades drained; then the primary tier, vLLM's
prefix cache and the KV cache are emptied, the tier's files dropped from the page cache (vLLM's fs tier reads
with O_DIRECT where the filesystem takes it, kvcopy's store too; otherwise ``posix_fadvise(DONTNEED)`` on every
file of the fs tier, and the store's ``drop_page_cache``), and the prompt with 3 more tokens is requested again:
its prefix is promoted from the tier and loaded, and the loaded blocks are compared bitwise with the KV the
rig's forwards wrote (kv_value).

What each number measures (every tier the same way, with the same clocks):

- ``cascade GB/s``: a round's bytes cascaded (chunks in the tier's ``submit_store`` jobs x the primary tier's
  row bytes) / seconds from the round's first ``submit_store`` until the scheduler saw its last cascade
  finished (the job in ``get_finished_jobs``); the median over rounds. The rig polls at every step and sleeps
  IDLE_PAUSE_S between idle steps, so a job's end is seen up to a step late, for both tiers alike.
- ``promotion`` (the tier): from the request's ``submit_load`` until the scheduler saw the job finished;
  ``request`` (the engine): from the request's arrival (``add_request``) until the end of the step whose forward
  computes the tokens after the loaded prefix (the rig's forward is a fill, so this is vLLM's steps and the
  tier, not a model). p50 and p90 over the rounds (linear interpolation).
- ``sched ms/step``: time on the scheduler's thread inside the tier's ``lookup``, ``submit_store``,
  ``submit_load``, ``get_finished_jobs``, ``touch`` and ``on_schedule_end`` (perf_counter around each call), per
  engine step, over every step of the phase (store: the request run and the drain; promote: the request again).
- ``restart``: a new engine (a new rig, the same directory and configuration) asks for one stored prompt per
  prefix length: chunks loaded, of those stored, and of those loaded how many differ from what was stored.

Each tier against its disk's own limit, in the same run, on the same directory (benchmarks/disk_limit.py):

- ``disk write`` / ``disk read``: one file of ``--limit-mib`` written and read sequentially at the chunk size, one
  chunk a request and one request at a time, with O_DIRECT where the tiers' files take it (else the page cache,
  dropped before each read), the writes synced; timed by ``fio`` where it is installed, else by a plain
  writer and reader (``--disk-limit``). One write pass in each round, after the tiers' stores, and one read
  pass after their promotions; the median over the rounds.
- ``cascade_x_write_limit``, ``promotion_x_read_limit``: the tier's median cascade GB/s, and its median
  promotion GB/s (the chunks promoted x the row bytes / the promotion's seconds, as above), over the disk's.
  A tier that merges adjacent chunks into one request, or keeps several in flight, can pass 1.
- ``prediction_error`` (p50, p90): for each promotion job, |predicted / measured - 1| with the Planner's
  predicted read, taken as kvcopy's tiering manager takes each promotion
  (kvcopy.integrations.vllm.tiering.observe_promotion: scored against the Planner of the moment, then learned,
  each engine its own Planner, as at kvcopy_learn's default): the figure its ``tier_prediction_error``
  histogram records, measured by the tier's own ``transfer_time`` (kvcopy's: from the job's posting to its
  end on the IO thread; vLLM's fs tier's: its one task reading the job's files, from when a pool thread took
  it, the wait in the pool's queue left out). ``_seen``: measured
  from ``submit_load`` until the scheduler saw the job done (what the request waits). The Planner's profile:
  ``--profile``, else kvcopy's default profile, else this CPU calibrated at the start (``kvcopy calibrate
  --device cpu --quick``: lines the prediction does not use, which a Planner needs); its disk line is
  measured at the start on the same directory (``kvcopy calibrate --disk``), replacing any it had.

Behaviour, measured the same way on each tier (rows ``behaviour`` in the CSV):

- ``rope_scaling``: a prompt stored by one engine; a new engine whose only change is
  ``hf_overrides={"rope_scaling": linear x4}`` asks for it: chunks it loads (KV computed under another RoPE);
- ``flipped byte``: one byte flipped in a stored chunk (the fs tier's ``.bin`` file; kvcopy's data file at the
  chunk's slot), the page cache dropped, the prompt asked again: chunks loaded, and loaded with wrong bytes;
- ``SIGKILL``: an engine (a child process forked from a preloaded server) running prompts is killed with
  SIGKILL at CRASH_POINTS points, each some milliseconds after its k-th cascade job was submitted; a new engine
  on the same directory then asks for every prompt the child began: chunks served, served with wrong bytes,
  and chunks the child's tier reported cascaded (a successful store job in ``get_finished_jobs``) that the new
  engine's tier no longer holds (lost). SIGKILL leaves the kernel's page cache alone: a write the process
  handed to the kernel survives it, fsynced or not; a power loss is not simulated.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_vllm_tiers.py [--dir /path/on/the/disk] [--layers 8]
        [--kv-heads 8] [--head-dim 128] [--prefixes 256,1024,4096] [--repeats 11] [--crash-points 20]
        [--profile profile.json] [--disk-limit auto|fio|python] [--limit-mib 256] [--csv out.csv]
        [--txt out.txt] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import glob
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvcopy.calibration.machine import machine_identity
from kvcopy.model.spec import ModelSpec
from kvcopy.profile import Profile
from kvcopy.storage.files import DATA, filesystem_of
from kvcopy.tools.bench.report import IDENTITY_COLUMNS

from disk_limit import TOOLS, SequentialFile

ROOT = Path(__file__).resolve().parents[1]
# The rig (vLLM's Scheduler and connector around a CPU stand-in worker) is a test helper, kept in one place:
# tests/helpers. vLLM loads the stand-in's spec by module path ("helpers.vllm_tiers"), so tests/ goes on
# sys.path as pytest puts it there (pyproject's pythonpath).
sys.path.insert(0, str(ROOT / "tests"))

BLOCK_TOKENS = 16  # vLLM's block of the rig (helpers.vllm.BLOCK_TOKENS); one block per chunk here
EXTRA_TOKENS = [5, 6, 7]  # a request again: the prompt and 3 more tokens, so its whole chunks are a hit
VOCAB = 250  # prompt tokens are drawn from [0, VOCAB): the rig's vocabulary is 256 and 255 its EOS
# The tiers' methods the tiering manager calls on the scheduler's thread, timed by the spy.
SCHEDULER_METHODS = ("lookup", "submit_store", "submit_load", "get_finished_jobs", "touch", "on_schedule_end")
TIERS = ("vllm fs", "kvcopy disk")
ROPE_OVERRIDE = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
FLIP_CHUNK = 4  # the chunk of the prompt whose byte is flipped (chunks before it are good)
FLIP_OFFSET = 5  # the byte of the chunk's row flipped: inside layer 0's first page
# Milliseconds after the k-th cascade job's submission at which the child is killed, cycled over the kill
# points: at once (the job queued, not begun), and while a job of tens of MiB is being written.
KILL_DELAYS_S = (0.0, 0.003, 0.008, 0.02)
CRASH_PROMPTS = 12  # prompts a crash child runs (it is killed before the end)
# Bounds that only a hang reaches (a crash child not killed, a reply that never comes).
CHILD_TIMEOUT_S = 300.0

# The full run's model: 8 layers x 8 KV heads x 128 dims x fp32 x 16 tokens x (K, V) = 1 MiB per block, a
# chunk of a small model's layers (Llama-3.1-8B has 32 such layers: 4 MiB in fp32, 2 MiB in bf16) that keeps
# the run within minutes on a 2-core VM.
FULL = {
    "layers": 8,
    "kv_heads": 8,
    "head_dim": 128,
    "prefixes": "256,1024,4096",
    "repeats": 11,
    "crash_points": 20,
    "crash_prefix": 256,
    "limit_mib": 256,  # the disk's limit, a pass: the largest prompt's chunks (4096 tokens, 256 MiB)
}
# --quick: the tests' tiny model (8 KiB chunks), short prefixes, one round, 2 kill points: the structure, in
# seconds of work (plus the imports).
QUICK = {
    "layers": 2,
    "kv_heads": 2,
    "head_dim": 16,
    "prefixes": "96,160",
    "repeats": 1,
    "crash_points": 2,
    "crash_prefix": 96,
    "limit_mib": 4,  # 512 chunks: a pass of milliseconds, above fio's 1 ms resolution
}

COLUMNS = (
    "kind",
    "tier",
    "metric",
    "prefix_tokens",
    "value",
    "unit",
    "samples",
    "note",
)


def _import_rig() -> Any:
    """tests/helpers' rig modules; SystemExit saying what is missing without vLLM or NIXL."""
    for module, why in (("vllm", "vLLM (scripts/setup.sh installs it)"), ("nixl_cu13", "NIXL (kvcopy[nixl])")):
        try:
            __import__(module)
        except ImportError:
            raise SystemExit(f"bench_vllm_tiers: needs {why}") from None
    import helpers.vllm as vllm_rig
    import helpers.vllm_tiers as tiers_rig

    return vllm_rig, tiers_rig


vllm_rig, tiers_rig = _import_rig()


# --------------------------------------------------------------------------- the tiers


@dataclass(frozen=True)
class Model:
    """The stand-in model's KV dimensions (fp32)."""

    layers: int
    kv_heads: int
    head_dim: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer: K and V of BLOCK_TOKENS tokens."""
        return 2 * BLOCK_TOKENS * self.kv_heads * self.head_dim * 4 * self.layers

    def rig_kwargs(self) -> dict[str, int]:
        return {"num_layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim}


def tier_config(tier: str, directory: str, bytes_to_use: int) -> dict[str, Any]:
    """The secondary tier's entry of ``secondary_tiers``: vLLM's fs tier, or kvcopy's disk tier, in
    ``directory``."""
    if tier == "vllm fs":
        return {"type": "fs", "root_dir": directory}
    return {
        "type": "KVCopyDiskTier",
        "module_path": "kvcopy.integrations.vllm",
        "path": directory,
        "bytes_to_use": bytes_to_use,
    }


def the_tier(rig: Any) -> Any:
    (tier,) = rig.tiers
    return tier


def holds(rig: Any, key: Any) -> bool:
    """Whether the rig's tier holds the chunk of ``key`` (the fs tier: its file exists; kvcopy's: its index)."""
    tier = the_tier(rig)
    if hasattr(tier, "file_mapper"):
        return os.path.exists(tier.file_mapper.get_file_name(key))
    from kvcopy.integrations.vllm.tiers.disk import store_hash

    return bool(tier.store.contains(store_hash(key)))


def reads_direct(rig: Any) -> bool:
    """Whether the tier reads with O_DIRECT (cold without dropping anything)."""
    tier = the_tier(rig)
    return bool(tier._use_o_direct if hasattr(tier, "file_mapper") else tier.store.direct)


def drop_page_cache(rig: Any, directory: str) -> None:
    """Drops the tier's files from the page cache: every file under the fs tier's ``directory``
    (posix_fadvise DONTNEED), or the store's data file (its drop_page_cache)."""
    tier = the_tier(rig)
    if not hasattr(tier, "file_mapper"):
        tier.store.drop_page_cache()
        return
    for folder, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def flip_byte(rig: Any, key: Any, offset: int) -> None:
    """Flips bit 0 of byte ``offset`` of the chunk of ``key`` where the tier keeps it (the fs tier's file; the
    store's data file at the chunk's slot), synced, its pages dropped."""
    tier = the_tier(rig)
    if hasattr(tier, "file_mapper"):
        path, position = tier.file_mapper.get_file_name(key), offset
    else:
        from kvcopy.integrations.vllm.tiers.disk import store_hash

        (slot,) = tier.store.match([store_hash(key)])
        path, position = os.path.join(tier.store.path, DATA), slot * tier.block_size_bytes + offset
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, position)
        os.pwrite(fd, bytes([byte[0] ^ 0x01]), position)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the spy


@dataclass
class Spy:
    """Wraps the tier's scheduler-side methods: time inside them on the scheduler's thread, and the submission
    and end (as the scheduler saw it) of every job.

    Not kvcopy.calibration.timing: what is timed are events inside vLLM's engine loop (a call, a job from its
    submission to the step that sees it end), each happening once, so the spy reads perf_counter around them
    and the rounds give the repeats."""

    seconds: float = 0.0  # inside the tier's methods, on the scheduler's thread
    by_method: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SCHEDULER_METHODS, 0.0))
    submitted: dict[int, tuple[float, int, bool, str]] = field(default_factory=dict)  # job -> (t, chunks, load, req)
    # job -> (t, success, the tier's transfer_time and transfer_bytes: what vLLM's tiering metrics read)
    finished: dict[int, tuple[float, bool, float | None, int | None]] = field(default_factory=dict)

    @classmethod
    def on(cls, tier: Any) -> Spy:
        spy = cls()
        main = threading.get_ident()
        for name in SCHEDULER_METHODS:
            method = getattr(tier, name)

            def timed(*args: Any, _method: Callable[..., Any] = method, _name: str = name, **kwargs: Any) -> Any:
                start = time.perf_counter()
                if _name in ("submit_store", "submit_load"):
                    job = args[0]
                    spy.submitted[job.job_id] = (start, len(job.keys), job.is_promotion, job.req_context.req_id)
                result = _method(*args, **kwargs)
                if _name == "get_finished_jobs":
                    result = list(result)
                end = time.perf_counter()
                if _name == "get_finished_jobs":
                    for done in result:
                        spy.finished[done.job_id] = (end, done.success, done.transfer_time, done.transfer_bytes)
                if threading.get_ident() == main:
                    spy.seconds += end - start
                    spy.by_method[_name] += end - start
                return result

            setattr(tier, name, timed)
        return spy

    def jobs(self, *, promotion: bool, request: str | None = None) -> list[int]:
        return [
            job
            for job, (_, _, load, req) in self.submitted.items()
            if load == promotion and (request is None or req == request)
        ]


# --------------------------------------------------------------------------- the workload


def prompt_tokens(seed: int, length: int) -> list[int]:
    """A prompt of ``length`` tokens drawn from ``seed``: no two seeds share a first block."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def count_steps(rig: Any) -> list[int]:
    """Wraps ``rig.step`` to count its calls in the returned one-element list."""
    count = [0]
    step = rig.step

    def counted() -> dict[str, int]:
        count[0] += 1
        return step()

    rig.step = counted
    return count


def computed_tokens(rig: Any, request_id: str) -> int:
    return sum(f.get(request_id, 0) for f in rig.forwards)


def wrong_chunks(rig: Any, request_id: str, tokens: Sequence[int], chunks: int) -> int:
    """Of the request's first ``chunks`` blocks, how many differ in any layer from the KV its prefix's forwards
    wrote (kv_value): loaded with wrong bytes."""
    table = rig.blocks_of(request_id)[0]
    wrong = 0
    for index in range(chunks):
        block = table[index]
        if any(
            not torch.equal(cache[block], vllm_rig.expected_block(rig, tokens, name, index))
            for name, cache in rig.caches.items()
        ):
            wrong += 1
    return wrong


@dataclass(frozen=True)
class Asked:
    """A request of a stored prompt again, until its first forward after the prefix."""

    loaded: int  # chunks loaded
    wrong: int  # of them, not bitwise the KV stored
    seconds: float  # from its arrival to the end of that forward's step
    steps: int  # engine steps from its arrival to that forward's, both counted


def ask_again(rig: Any, request_id: str, prompt: Sequence[int]) -> Asked:
    """Requests ``prompt`` and EXTRA_TOKENS as ``request_id`` until its first forward after the prefix, reads
    what was loaded, then runs it to its end."""
    tokens = [*prompt, *EXTRA_TOKENS]
    steps = len(rig.forwards)
    start = time.perf_counter()
    rig.add(request_id, tokens, max_tokens=4)  # it keeps its blocks, to be read
    rig.run_until_prefilled(request_id)
    seconds = time.perf_counter() - start
    steps = len(rig.forwards) - steps
    loaded = (len(tokens) - computed_tokens(rig, request_id)) // BLOCK_TOKENS
    wrong = wrong_chunks(rig, request_id, tokens, loaded)
    rig.run()
    return Asked(loaded, wrong, seconds, steps)


@dataclass
class Engine:
    """One tier's engine in the timed rounds, and what was measured of it."""

    tier: str
    directory: str
    rig: Any
    spy: Spy
    steps: list[int]
    row_bytes: int
    direct: bool  # the tier reads with O_DIRECT
    queue: str  # kvcopy's store: its NIXL POSIX queue; "" for the fs tier
    cascade_gbps: dict[int, list[float]] = field(default_factory=dict)
    promotion_s: dict[int, list[float]] = field(default_factory=dict)
    promotion_gbps: dict[int, list[float]] = field(default_factory=dict)
    # per promotion job: the Planner's predicted read, and |predicted / measured - 1| against the tier's own
    # transfer_time (the histogram's) and against submit_load -> seen done
    predicted_s: dict[int, list[float]] = field(default_factory=dict)
    prediction_error: dict[int, list[float]] = field(default_factory=dict)
    prediction_error_seen: dict[int, list[float]] = field(default_factory=dict)
    request_s: dict[int, list[float]] = field(default_factory=dict)
    request_steps: dict[int, list[int]] = field(default_factory=dict)
    sched_s: dict[str, float] = field(default_factory=lambda: {"store": 0.0, "promote": 0.0})
    sched_steps: dict[str, int] = field(default_factory=lambda: {"store": 0, "promote": 0})
    requests: int = 0  # requests in the promote phase (one per round)
    loaded: int = 0
    expected: int = 0
    wrong: int = 0
    live: Any = None  # the Planner that predicts its promotions (an OnlinePlanner), in the timed rounds

    def phase(self, name: str, work: Callable[[], None]) -> None:
        """Runs ``work``, counting the tier's scheduler-thread seconds and the steps into phase ``name``."""
        seconds, steps = self.spy.seconds, self.steps[0]
        work()
        self.sched_s[name] += self.spy.seconds - seconds
        self.sched_steps[name] += self.steps[0] - steps


def make_engine(tier: str, work: str, model: Model, prefix_max: int, bytes_to_use: int, **changes: Any) -> Engine:
    """A rig of vLLM's tiering spec over ``tier`` in ``work``/tier (its model in ``work``/model), sized for
    prompts of ``prefix_max`` tokens: a KV cache of two such prompts, a primary tier of two, one forward for a
    whole prompt."""
    blocks = 2 * (prefix_max // BLOCK_TOKENS + 2)
    directory = os.path.join(work, "tier")
    rig = tiers_rig.make_tiering_rig(
        Path(work),
        secondary_tiers=[tier_config(tier, directory, bytes_to_use)],
        cpu_bytes_to_use=blocks * model.block_bytes,
        num_blocks=blocks,
        max_batch_tokens=prefix_max + BLOCK_TOKENS,
        max_model_len=prefix_max + 2 * BLOCK_TOKENS,
        **model.rig_kwargs(),
        **changes,
    )
    spy, steps = Spy.on(the_tier(rig)), count_steps(rig)
    queue = "" if hasattr(the_tier(rig), "file_mapper") else str(the_tier(rig).store.queue)
    return Engine(tier, directory, rig, spy, steps, int(rig.region.shape[1]), reads_direct(rig), queue)


def store_round(engine: Engine, request_id: str, prompt: Sequence[int]) -> None:
    """Stores ``prompt`` (run to its end, stores and cascades drained); one cascade sample."""
    rig, spy = engine.rig, engine.spy
    before = set(spy.jobs(promotion=False))

    def work() -> None:
        rig.add(request_id, list(prompt))
        rig.run()
        rig.drain()

    engine.phase("store", work)
    jobs = [job for job in spy.jobs(promotion=False) if job not in before]
    assert jobs and all(spy.finished[j][1] for j in jobs), f"{engine.tier}: a cascade failed or never ended"
    nbytes = sum(spy.submitted[j][1] for j in jobs) * engine.row_bytes
    seconds = max(spy.finished[j][0] for j in jobs) - min(spy.submitted[j][0] for j in jobs)
    engine.cascade_gbps.setdefault(len(prompt), []).append(nbytes / seconds / 1e9)


def evict(engine: Engine) -> None:
    """Empties the primary tier, vLLM's prefix cache and the KV cache; drops the tier's files' pages."""
    engine.rig.evict_primary()
    engine.rig.reset_prefix_cache(zero=True)
    drop_page_cache(engine.rig, engine.directory)


def promote_round(engine: Engine, request_id: str, prompt: Sequence[int]) -> None:
    """Requests ``prompt`` again, cold: one promotion and one request sample, the chunks checked."""
    result: list[Asked] = []
    engine.phase("promote", lambda: result.append(ask_again(engine.rig, request_id, prompt)))
    asked = result[0]
    spy = engine.spy
    jobs = spy.jobs(promotion=True, request=request_id)
    length = len(prompt)
    engine.loaded += asked.loaded
    engine.expected += length // BLOCK_TOKENS
    engine.wrong += asked.wrong
    engine.request_s.setdefault(length, []).append(asked.seconds)
    engine.request_steps.setdefault(length, []).append(asked.steps)
    engine.requests += 1
    if jobs:
        ends = [spy.finished[j][0] for j in jobs if j in spy.finished]
        if ends:
            promotion = max(ends) - min(spy.submitted[j][0] for j in jobs)
            engine.promotion_s.setdefault(length, []).append(promotion)
            nbytes = sum(spy.submitted[j][1] for j in jobs) * engine.row_bytes
            engine.promotion_gbps.setdefault(length, []).append(nbytes / promotion / 1e9)
    for job in jobs:
        score_promotion(engine, length, job)


def score_promotion(engine: Engine, length: int, job: int) -> None:
    """The Planner's predicted read of a finished promotion job against what it took, taken as kvcopy's tiering
    manager takes each (observe_promotion: scored against the Planner of the moment, then learned; only a
    successful job that reports its seconds and bytes), and against the job as the scheduler saw it."""
    from kvcopy.integrations.vllm.tiering import observe_promotion, predicted_read_s, prediction_error

    spy = engine.spy
    if engine.live is None or job not in spy.finished:
        return
    end, success, seconds, nbytes = spy.finished[job]
    if not (success and seconds and nbytes):
        return
    planner, _ = engine.live.current()
    predicted = predicted_read_s(planner, nbytes)
    seen = prediction_error(planner, nbytes, end - spy.submitted[job][0])
    error = observe_promotion(engine.live, nbytes, seconds)
    if predicted is None or seen is None or error is None:
        return  # a Planner without a disk line: nothing predicted
    engine.predicted_s.setdefault(length, []).append(predicted)
    engine.prediction_error.setdefault(length, []).append(error)
    engine.prediction_error_seen.setdefault(length, []).append(seen)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# --------------------------------------------------------------------------- behaviour


@dataclass
class Behaviour:
    """What a tier did in one case: chunks offered, loaded, loaded with wrong bytes, lost (reported stored,
    then not held), over ``cases`` runs."""

    tier: str
    case: str
    chunks: int = 0
    loaded: int = 0
    wrong: int = 0
    lost: int = 0
    reported: int = 0
    cases: int = 0
    note: str = ""


def store_then_close(tier: str, work: str, model: Model, prompt: Sequence[int], bytes_to_use: int) -> None:
    engine = make_engine(tier, work, model, len(prompt), bytes_to_use)
    try:
        store_round(engine, "first", prompt)
    finally:
        engine.rig.close()


def rope_case(tier: str, work: str, model: Model, prompt: Sequence[int], bytes_to_use: int) -> Behaviour:
    """A prompt stored; a new engine whose only change is rope_scaling asks for it."""
    store_then_close(tier, work, model, prompt, bytes_to_use)
    engine = make_engine(tier, work, model, len(prompt), bytes_to_use, hf_overrides=ROPE_OVERRIDE)
    try:
        drop_page_cache(engine.rig, engine.directory)
        asked = ask_again(engine.rig, "again", prompt)
    finally:
        engine.rig.close()
    chunks = len(prompt) // BLOCK_TOKENS
    note = "loaded: KV of another RoPE (bitwise what was stored)" if asked.loaded else "every token computed"
    return Behaviour(tier, "rope_scaling changed", chunks, asked.loaded, asked.wrong, cases=1, note=note)


def flip_case(tier: str, work: str, model: Model, prompt: Sequence[int], bytes_to_use: int) -> Behaviour:
    """A prompt stored and evicted, a byte of chunk FLIP_CHUNK flipped where the tier keeps it, asked again."""
    engine = make_engine(tier, work, model, len(prompt), bytes_to_use)
    try:
        store_round(engine, "first", prompt)
        evict(engine)
        flip_byte(engine.rig, engine.rig.offload_keys(prompt)[FLIP_CHUNK], FLIP_OFFSET)
        drop_page_cache(engine.rig, engine.directory)
        asked = ask_again(engine.rig, "again", prompt)
    finally:
        engine.rig.close()
    chunks = len(prompt) // BLOCK_TOKENS
    done = "every chunk loaded" if asked.loaded == chunks else f"computed from chunk {asked.loaded} on"
    note = f"byte {FLIP_OFFSET} of chunk {FLIP_CHUNK} flipped: {done}"
    return Behaviour(tier, "flipped byte", chunks, asked.loaded, asked.wrong, cases=1, note=note)


def crash_prompt(i: int, length: int) -> list[int]:
    return prompt_tokens(1_000_000 + i, length)


def crash_child(conn: Connection, tier: str, work: str, model: Model, length: int, engine_id: str) -> None:
    """A crash child: an engine over ``tier`` in ``work`` running CRASH_PROMPTS prompts one after another,
    sending ("posted",) before each cascade job, ("finished",) as the scheduler sees one end, and ("done", keys)
    with its chunks when it succeeded, until killed."""
    cfg = tier_config(tier, os.path.join(work, "tier"), crash_bytes(model, length))
    blocks = 2 * (length // BLOCK_TOKENS + 2)
    rig = tiers_rig.make_tiering_rig(
        Path(work),
        secondary_tiers=[cfg],
        cpu_bytes_to_use=blocks * model.block_bytes,
        num_blocks=blocks,
        max_batch_tokens=length + BLOCK_TOKENS,
        max_model_len=length + 2 * BLOCK_TOKENS,
        engine_id=engine_id,
        **model.rig_kwargs(),
    )
    tier_obj = the_tier(rig)
    submit, finished = tier_obj.submit_store, tier_obj.get_finished_jobs
    stores: dict[int, list[bytes]] = {}

    def posted(job: Any) -> None:
        stores[job.job_id] = [bytes(k) for k in job.keys]
        conn.send(("posted",))
        submit(job)

    def done() -> list[Any]:
        results = list(finished())
        for result in results:
            keys = stores.pop(result.job_id, None)
            if keys is not None:
                conn.send(("finished",))
            if keys and result.success:
                for start in range(0, len(keys), 16):  # a message under PIPE_BUF: written whole or not at all
                    conn.send(("done", keys[start : start + 16]))
        return results

    tier_obj.submit_store, tier_obj.get_finished_jobs = posted, done
    for i in range(CRASH_PROMPTS):
        conn.send(("started", i))
        rig.add(f"p{i}", crash_prompt(i, length))
        rig.run()
    rig.drain()
    conn.send(("ended",))
    time.sleep(CHILD_TIMEOUT_S)  # wait for the kill (an engine that ended before its kill point is reported)


def crash_bytes(model: Model, length: int) -> int:
    """The crash tier's budget: every chunk of every crash prompt, so nothing is evicted."""
    return (CRASH_PROMPTS * (length // BLOCK_TOKENS) + 8) * model.block_bytes


def kill_points(count: int) -> list[tuple[int, float]]:
    """(k, delay): kill the child ``delay`` seconds after its k-th cascade job's submission; k over the first
    CRASH_PROMPTS - 2 jobs, delays cycled over KILL_DELAYS_S."""
    span = CRASH_PROMPTS - 2
    return [(1 + (i * span) // max(count, 1), KILL_DELAYS_S[i % len(KILL_DELAYS_S)]) for i in range(count)]


def crash_case(
    tier: str, work: str, model: Model, length: int, points: list[tuple[int, float]], context: Any
) -> Behaviour:
    """The engine killed at each of ``points``; a new engine on its directory then asks for every prompt the
    child began."""
    result = Behaviour(tier, "SIGKILL mid-cascade")
    ended = in_flight = 0
    for index, (k, delay) in enumerate(points):
        point = os.path.join(work, f"kill-{index}")
        engine_id = f"kvcopy-bench-crash-{uuid.uuid4().hex[:12]}"
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=crash_child, args=(send, tier, point, model, length, engine_id))
        child.start()
        send.close()
        posted, finished, started, reported = 0, 0, -1, []
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        try:
            while True:
                if not receive.poll(max(deadline - time.monotonic(), 0)):
                    raise SystemExit(f"bench_vllm_tiers: crash child of {tier} sent nothing in {CHILD_TIMEOUT_S} s")
                message = receive.recv()
                if message[0] == "posted":
                    posted += 1
                    if posted == k:
                        time.sleep(delay)
                        os.kill(child.pid, signal.SIGKILL)
                        break
                elif message[0] == "started":
                    started = message[1]
                elif message[0] == "finished":
                    finished += 1
                elif message[0] == "done":
                    reported += message[1]
                elif message[0] == "ended":
                    ended += 1
                    os.kill(child.pid, signal.SIGKILL)
                    break
            child.join(CHILD_TIMEOUT_S)
            with contextlib.suppress(EOFError, OSError):
                while receive.poll(0):  # what it sent before the kill landed
                    message = receive.recv()
                    if message[0] == "done":
                        reported += message[1]
                    elif message[0] == "started":
                        started = message[1]
                    elif message[0] == "posted":
                        posted += 1
                    elif message[0] == "finished":
                        finished += 1
            in_flight += posted > finished  # the kill landed with a cascade job not seen ended
        finally:
            receive.close()
            region = glob.escape(tiers_rig.REGION_PATH.format(engine_id=engine_id))
            for leftover in glob.glob(region) + glob.glob(region + ".*"):
                os.unlink(leftover)  # a killed engine leaves its region (and its segments) behind
        check = make_engine(tier, point, model, length, crash_bytes(model, length))
        try:
            held = {bytes(key) for key in reported if holds(check.rig, key)}
            result.reported += len(set(reported))
            result.lost += len(set(reported) - held)
            for i in range(started + 1):
                prompt = crash_prompt(i, length)
                asked = ask_again(check.rig, f"check{i}", prompt)
                result.chunks += len(prompt) // BLOCK_TOKENS
                result.loaded += asked.loaded
                result.wrong += asked.wrong
        finally:
            check.rig.close()
        result.cases += 1
        shutil.rmtree(point, ignore_errors=True)
    result.note = (
        f"{len(points)} kill points, {length}-token prompts; a prompt's chunks served after the restart, of "
        f"those the child began; {result.reported} chunks reported cascaded before the kills; kills with a cascade "
        f"job in flight: {in_flight}" + (f"; {ended} children ended before their kill point" if ended else "")
    )
    return result


# --------------------------------------------------------------------------- the Planner and the disk's limit


def planner_profile(path: str | None, directory: str, spec: ModelSpec, *, quick: bool) -> tuple[Profile, str]:
    """The profile whose Planner predicts the promotions, and where it came from: ``path``'s (an engine's
    kvcopy_profile), else kvcopy's default profile, else this CPU calibrated now (``kvcopy calibrate --device cpu
    --quick`` for ``spec``: a Planner needs its load and prefill lines, which the prediction does not use).
    Its disk line is measured now in ``directory`` (``kvcopy calibrate --disk``, its quick sweep with
    ``quick``), replacing any it had."""
    from kvcopy.calibration.disk import add_disk_fits
    from kvcopy.calibration.local import calibrate
    from kvcopy.profile import default_profile

    default = default_profile() if path is None else None
    if path is not None:
        profile, where = Profile.load(path), path
    elif default is not None:
        profile, where = copy.deepcopy(default), "kvcopy's default profile"
    else:
        profile = calibrate("cpu", quick=True, progress=False, model=spec)
        where = "this CPU, calibrated at the start (quick)"
    add_disk_fits(profile, directory, quick=quick, progress=False)
    sweep = "quick" if quick else "full"
    return profile, f"{where}; its disk line measured at the start on this directory ({sweep} sweep)"


def served_model(engine: Engine) -> ModelSpec:
    """The ModelSpec kvcopy's vLLM spec reads of the model the engine serves."""
    from kvcopy.integrations.vllm.session import model_spec_of

    spec = model_spec_of(engine.rig.worker_spec.config)
    assert spec is not None, "the rig's model directory has its config.json"
    return spec


def live_planner(engine: Engine, profile: Profile) -> Any:
    """The OnlinePlanner kvcopy's tiering spec would give this engine's scheduler (its session's: the engine's
    kv_connector_extra_config read as kvcopy reads it, the model it serves) over ``profile``."""
    from kvcopy.integrations.vllm._config import read_config
    from kvcopy.integrations.vllm.session import new_session

    settings = read_config(engine.rig.vllm_config.kv_transfer_config.kv_connector_extra_config)
    block_tokens = engine.rig.worker_spec.tokens_per_block
    return new_session(settings, profile, served_model(engine), 0, block_tokens).live


@dataclass
class DiskLimit:
    """The disk's sequential write and read at the chunk size, one pass each a round (GB/s)."""

    tool: str
    direct: bool
    block_bytes: int
    pass_bytes: int
    note: str
    write_gbps: list[float] = field(default_factory=list)
    read_gbps: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- the run


def timed_rounds(
    work: str,
    model: Model,
    prefixes: Sequence[int],
    repeats: int,
    *,
    limit: tuple[str, int],
    profile_path: str | None,
    quick: bool,
) -> tuple[dict[str, Engine], dict[str, Any], DiskLimit, str]:
    """The timed workload, both tiers in the same rounds, each round also one pass of the disk's limit
    (``limit``: the tool and the chunks a pass); then the restart. Returns the engines (closed), the restart's
    counts per tier, the disk's limit, and where the Planner's profile came from."""
    prefix_max = max(prefixes)
    total_chunks = (repeats * sum(prefixes) + prefixes[0]) // BLOCK_TOKENS
    bytes_to_use = (total_chunks + 16) * model.block_bytes
    engines = {
        tier: make_engine(tier, os.path.join(work, tier.replace(" ", "-")), model, prefix_max, bytes_to_use)
        for tier in TIERS
    }
    order = list(TIERS)
    disk: SequentialFile | None = None
    try:
        # the Planner's profile (its disk line measured here), and the disk's limit file, written through once
        served = served_model(engines[TIERS[0]])
        profile, planner_note = planner_profile(profile_path, work, served, quick=quick)
        for engine in engines.values():
            engine.live = live_planner(engine, profile)
        tool, limit_chunks = limit
        disk = SequentialFile(os.path.join(work, "disk-limit"), model.block_bytes, limit_chunks, tool)
        measured = DiskLimit(disk.tool, disk.direct, model.block_bytes, disk.nbytes, disk.note)
        warm = prompt_tokens(0, prefixes[0])  # one untimed round: first files, NIXL's first transfers
        for engine in engines.values():
            store_round(engine, "warm", warm)
            evict(engine)
            ask_again(engine.rig, "warm-again", warm)
            reset(engine)
        for length in prefixes:
            for r in range(repeats):
                prompt = prompt_tokens(length * 1000 + r + 1, length)
                order.reverse()  # in turn, the order alternating
                for tier in order:
                    store_round(engines[tier], f"s{length}-{r}", prompt)
                measured.write_gbps.append(disk.write_gbps())  # beside the cascades it is compared with
                for tier in order:
                    evict(engines[tier])
                for tier in order:
                    promote_round(engines[tier], f"a{length}-{r}", prompt)
                measured.read_gbps.append(disk.read_gbps())  # beside the promotions
    finally:
        if disk is not None:
            disk.close()
        for engine in engines.values():
            engine.rig.close()
    restart: dict[str, Any] = {}
    for tier in TIERS:
        engine = make_engine(tier, os.path.join(work, tier.replace(" ", "-")), model, prefix_max, bytes_to_use)
        counts = {"loaded": 0, "chunks": 0, "wrong": 0}
        try:
            drop_page_cache(engine.rig, engine.directory)
            for length in prefixes:
                prompt = prompt_tokens(length * 1000 + 1, length)
                asked = ask_again(engine.rig, f"r{length}", prompt)
                counts["loaded"] += asked.loaded
                counts["wrong"] += asked.wrong
                counts["chunks"] += length // BLOCK_TOKENS
        finally:
            engine.rig.close()
        restart[tier] = counts
    return engines, restart, measured, planner_note


def reset(engine: Engine) -> None:
    """Forgets the warm-up's samples."""
    engine.cascade_gbps.clear()
    engine.promotion_s.clear()
    engine.promotion_gbps.clear()
    engine.predicted_s.clear()
    engine.prediction_error.clear()
    engine.prediction_error_seen.clear()
    engine.request_s.clear()
    engine.request_steps.clear()
    engine.sched_s = {"store": 0.0, "promote": 0.0}
    engine.sched_steps = {"store": 0, "promote": 0}
    engine.spy.by_method = dict.fromkeys(SCHEDULER_METHODS, 0.0)
    engine.requests = 0
    engine.loaded = engine.expected = engine.wrong = 0


def limit_how(limit: DiskLimit) -> str:
    """How the disk's limit was taken, in words."""
    cold = "O_DIRECT" if limit.direct else "through the page cache, dropped before each read"
    tool = "fio" if limit.tool == "fio" else "no fio: the bench's own os.pwrite / os.preadv loop"
    return (
        f"{tool}; {limit.block_bytes}-byte requests one at a time, {cold}, {limit.pass_bytes >> 20} MiB a "
        f"pass, writes synced at the end" + (f"; {limit.note}" if limit.note else "")
    )


def rows_of(
    engines: dict[str, Engine], restart: dict[str, Any], behaviours: list[Behaviour], limit: DiskLimit
) -> list[dict]:
    rows: list[dict] = []

    def add(kind: str, tier: str, metric: str, value: float, unit: str, samples: int, **extra: Any) -> None:
        rows.append({"kind": kind, "tier": tier, "metric": metric, "value": value, "unit": unit, "samples": samples,
                     "prefix_tokens": extra.get("prefix", ""), "note": extra.get("note", "")})  # fmt: skip

    write_limit, read_limit = percentile(limit.write_gbps, 50), percentile(limit.read_gbps, 50)
    how = limit_how(limit)
    add("disk", "disk", "write_gbps_median", write_limit, "GB/s", len(limit.write_gbps), note=how)
    add("disk", "disk", "read_gbps_median", read_limit, "GB/s", len(limit.read_gbps), note=how)
    for tier, e in engines.items():
        for length in sorted(e.request_s):
            cascade = e.cascade_gbps[length]
            add("timed", tier, "cascade_gbps_median", statistics.median(cascade), "GB/s", len(cascade), prefix=length)
            of_limit = statistics.median(cascade) / write_limit
            add("timed", tier, "cascade_x_write_limit", of_limit, "x", len(cascade), prefix=length)
            promotion = e.promotion_s.get(length, [])
            for q in (50, 90):
                add(
                    "timed",
                    tier,
                    f"promotion_p{q}",
                    percentile(promotion, q) * 1e3,
                    "ms",
                    len(promotion),
                    prefix=length,
                )
            gbps = e.promotion_gbps.get(length, [])
            add("timed", tier, "promotion_gbps_median", percentile(gbps, 50), "GB/s", len(gbps), prefix=length)
            of_limit = percentile(gbps, 50) / read_limit
            add("timed", tier, "promotion_x_read_limit", of_limit, "x", len(gbps), prefix=length)
            predicted = e.predicted_s.get(length, [])
            median_ms = percentile(predicted, 50) * 1e3
            add("timed", tier, "promotion_predicted_ms_median", median_ms, "ms", len(predicted), prefix=length)
            for name, errors in (
                ("prediction_error", e.prediction_error),
                ("prediction_error_seen", e.prediction_error_seen),
            ):
                for q in (50, 90):
                    got = errors.get(length, [])
                    add("timed", tier, f"{name}_p{q}", percentile(got, q), "|p/m-1|", len(got), prefix=length)
            for q in (50, 90):
                request = e.request_s[length]
                add("timed", tier, f"request_p{q}", percentile(request, q) * 1e3, "ms", len(request), prefix=length)
            steps = e.request_steps[length]
            add("timed", tier, "request_steps_median", statistics.median(steps), "steps", len(steps), prefix=length)
        for name, errors in (
            ("prediction_error", e.prediction_error),
            ("prediction_error_seen", e.prediction_error_seen),
        ):
            every = [error for by_prefix in errors.values() for error in by_prefix]
            for q in (50, 90):
                add("timed", tier, f"{name}_p{q}", percentile(every, q), "|p/m-1|", len(every), note="every promotion")
        for phase in ("store", "promote"):
            steps = e.sched_steps[phase]
            add("timed", tier, f"sched_ms_per_step_{phase}", e.sched_s[phase] / max(steps, 1) * 1e3, "ms", steps)
        for phase in ("store", "promote"):
            per_request = e.sched_s[phase] / max(e.requests, 1) * 1e3
            add("timed", tier, f"sched_ms_per_request_{phase}", per_request, "ms", e.requests)
        steps = sum(e.sched_steps.values())
        for name, seconds in e.spy.by_method.items():
            add("timed", tier, f"sched_ms_per_step: {name}", seconds / max(steps, 1) * 1e3, "ms", steps)
        add("timed", tier, "chunks_loaded", e.loaded, "chunks", e.expected, note="of those asked, cold")
        add("timed", tier, "chunks_wrong", e.wrong, "chunks", e.loaded, note="loaded, not bitwise the stored KV")
        counts = restart[tier]
        add("restart", tier, "chunks_loaded", counts["loaded"], "chunks", counts["chunks"], note="a new engine")
        add("restart", tier, "chunks_wrong", counts["wrong"], "chunks", counts["loaded"])
    for b in behaviours:
        add("behaviour", b.tier, f"{b.case}: loaded", b.loaded, "chunks", b.chunks, note=b.note)
        add("behaviour", b.tier, f"{b.case}: wrong", b.wrong, "chunks", b.loaded)
        if b.case.startswith("SIGKILL"):
            add("behaviour", b.tier, f"{b.case}: lost", b.lost, "chunks", b.reported, note="reported cascaded")
    return rows


def report(rows: list[dict], header: str, engines: dict[str, Engine]) -> str:
    """The TXT: the header, the disk's limit, the timed table (each tier, and kvcopy's against vLLM's as a
    ratio), the behaviour."""
    lines = [header, ""]
    by = {(r["tier"], r["metric"], r["prefix_tokens"], r["kind"]): r for r in rows}
    write, read = by[("disk", "write_gbps_median", "", "disk")], by[("disk", "read_gbps_median", "", "disk")]
    lines.append(
        f"the disk's limit, on the same directory, a pass each round (median of {write['samples']}): sequential "
        f"write {write['value']:.3f} GB/s, read {read['value']:.3f} GB/s ({write['note']})"
    )
    lines.append("")
    fs, kv = TIERS
    lines.append(f"{'metric':<38} {'prefix':>6} {fs:>12} {kv:>12} {'ratio kv/fs':>11} {'samples':>7}")
    for r in rows:
        if r["kind"] != "timed" or r["tier"] != fs:
            continue
        other = by[(kv, r["metric"], r["prefix_tokens"], "timed")]
        ratio = other["value"] / r["value"] if r["value"] else float("nan")
        lines.append(
            f"{r['metric']:<38} {r['prefix_tokens']!s:>6} {r['value']:>12.3f} {other['value']:>12.3f} "
            f"{ratio:>11.2f} {r['samples']:>7}"
        )
    lines.append("")
    lines.append(f"{'what happened':<38} {'tier':<12} {'chunks':>7} {'of':>6}  note")
    for r in rows:
        if r["kind"] in ("restart", "behaviour"):
            what = f"restart: {r['metric']}" if r["kind"] == "restart" else r["metric"]
            lines.append(f"{what:<38} {r['tier']:<12} {r['value']:>7} {r['samples']:>6}  {r['note']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk under test (default: a temporary one)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 prefixes, one round, 2 kill points")
    parser.add_argument("--layers", type=int, help=f"the model's layers ({FULL['layers']})")
    parser.add_argument("--kv-heads", type=int, help=f"KV heads ({FULL['kv_heads']})")
    parser.add_argument("--head-dim", type=int, help=f"head size ({FULL['head_dim']})")
    parser.add_argument("--prefixes", help=f"prompt lengths in tokens, comma-separated ({FULL['prefixes']})")
    parser.add_argument("--repeats", type=int, help=f"rounds per prefix length ({FULL['repeats']})")
    parser.add_argument("--crash-points", type=int, help=f"SIGKILL points per tier ({FULL['crash_points']})")
    parser.add_argument("--crash-prefix", type=int, help=f"the crash prompts' tokens ({FULL['crash_prefix']})")
    parser.add_argument(
        "--profile", help="the Planner's profile (default: kvcopy's default profile, else this CPU calibrated)"
    )
    parser.add_argument(
        "--disk-limit", choices=TOOLS, default="auto", help="what times the disk's limit (auto: fio if installed)"
    )
    parser.add_argument("--limit-mib", type=int, help=f"MiB a pass of the disk's limit ({FULL['limit_mib']})")
    parser.add_argument("--csv", help="also write the rows here")
    parser.add_argument("--txt", help="also write the report here")
    args = parser.parse_args()
    preset = QUICK if args.quick else FULL
    model = Model(
        args.layers or preset["layers"], args.kv_heads or preset["kv_heads"], args.head_dim or preset["head_dim"]
    )
    prefixes = sorted(int(p) for p in (args.prefixes or preset["prefixes"]).split(","))
    repeats = args.repeats or preset["repeats"]
    crash_points = preset["crash_points"] if args.crash_points is None else args.crash_points
    crash_prefix = args.crash_prefix or preset["crash_prefix"]
    if any(p % BLOCK_TOKENS or p < BLOCK_TOKENS * (FLIP_CHUNK + 2) for p in [*prefixes, crash_prefix]):
        least = BLOCK_TOKENS * (FLIP_CHUNK + 2)
        parser.error(f"--prefixes, --crash-prefix: whole blocks of {BLOCK_TOKENS} tokens, at least {least}")
    limit_mib = args.limit_mib or preset["limit_mib"]
    if limit_mib < 1:
        parser.error(f"--limit-mib: at least 1, got {limit_mib}")
    if args.profile is not None and not os.path.isfile(args.profile):
        parser.error(f"--profile: no profile at {args.profile!r} (write one with `kvcopy calibrate`)")
    if args.disk_limit == "fio" and shutil.which("fio") is None:
        parser.error("--disk-limit: fio asked for, and there is no fio on PATH")
    limit = (args.disk_limit, max(1, (limit_mib << 20) // model.block_bytes))
    directory = args.dir or tempfile.mkdtemp(prefix="kvcopy-bench-vllm-tiers-", dir=os.getcwd())
    os.makedirs(directory, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=directory)
    identity = machine_identity(torch.device("cpu"))
    filesystem = filesystem_of(work)
    # Crash children fork from a server that imported the rig once (a new interpreter per kill point would
    # spend 10 s of a 2-core machine on imports each).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["helpers.vllm_tiers", "kvcopy.integrations.vllm"])
    try:
        engines, restart, disk, planner_note = timed_rounds(
            os.path.join(work, "timed"),
            model,
            prefixes,
            repeats,
            limit=limit,
            profile_path=args.profile,
            quick=args.quick,
        )
        behaviours: list[Behaviour] = []
        prompt = prompt_tokens(424242, prefixes[0])
        points = kill_points(crash_points)
        for tier in TIERS:
            name = tier.replace(" ", "-")
            bytes_to_use = (prefixes[0] // BLOCK_TOKENS + 8) * model.block_bytes
            behaviours.append(rope_case(tier, os.path.join(work, f"rope-{name}"), model, prompt, bytes_to_use))
            behaviours.append(flip_case(tier, os.path.join(work, f"flip-{name}"), model, prompt, bytes_to_use))
        for tier in TIERS:
            if points:
                crash_work = os.path.join(work, f"crash-{tier.replace(' ', '-')}")
                behaviours.append(crash_case(tier, crash_work, model, crash_prefix, points, context))
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = rows_of(engines, restart, behaviours, disk)
    cold = ", ".join(
        f"{tier}: {'O_DIRECT' if engines[tier].direct else 'page cache dropped before each request'}" for tier in TIERS
    )
    header = (
        f"vLLM's fs tier and kvcopy's disk tier under vLLM {vllm_version()}'s TieringOffloadingSpec (CPU stand-in "
        f"worker), on {identity.get('host_cpu')} ({identity.get('host_cores')} cores), {filesystem}, "
        f"{identity.get('date')}\n"
        f"model: {model.layers} layers x {model.kv_heads} KV heads x {model.head_dim} dims, fp32, {BLOCK_TOKENS} "
        f"tokens a block, one block a chunk: {model.block_bytes} bytes a chunk; prefixes {prefixes} tokens, "
        f"{repeats} rounds each, both tiers in the same rounds, in turn; cold reads ({cold})\n"
        "cascade: bytes cascaded / (first submit_store -> last cascade seen done); promotion: submit_load -> "
        "seen done; request: arrival -> end of the step computing the tokens after the prefix; sched ms/step: "
        "time in the tier's methods on the scheduler thread / steps of the phase (per request: / requests)\n"
        "tiers at their defaults: vLLM's fs 16 read and 16 write threads; kvcopy's one IO thread, NIXL POSIX "
        f"({engines[TIERS[1]].queue}), checksums checked, data synced before its commit; restart: a new engine "
        "(rig) in this process on the same directory asks for the first prompt of each prefix length\n"
        "x_write_limit, x_read_limit: the tier's median GB/s over the disk's (below); prediction_error: "
        "|predicted / measured - 1| per promotion job, the Planner's predicted read scored and learned as kvcopy's "
        "tiering manager does (its tier_prediction_error histogram), measured by the tier's transfer_time (kvcopy's "
        "from the job's posting; vLLM's fs tier's from when a pool thread took the job's one task); _seen: "
        "measured from submit_load until seen done\n"
        f"the Planner's profile: {planner_note}"
    )
    text = report(rows, header, engines)
    print(text)
    if args.txt:
        Path(args.txt).write_text(text + "\n")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*IDENTITY_COLUMNS, "filesystem", "chunk_bytes", *COLUMNS])
            writer.writeheader()
            for r in rows:
                ident = {k: identity.get(k, "") for k in IDENTITY_COLUMNS}
                writer.writerow({**ident, "filesystem": filesystem, "chunk_bytes": model.block_bytes, **r})
    return 0


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
