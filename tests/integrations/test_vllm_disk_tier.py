"""KVCopyDiskTier on its own, built as vLLM's SecondaryTierFactory builds an out-of-tree tier and driven with
the jobs vLLM's tiering manager makes: rows of a primary tier (an mmap, as vLLM's shared region) stored and
loaded back bitwise; lookups from the committed index (a chunk whose cascade is queued or in flight is a MISS);
a promotion posted before the cascades queued ahead of it; a new tier of the same identity finding what was
stored, and one whose only change is rope scaling, the KV-cache dtype or the model's own config.json finding
nothing; a flipped byte refused and dropped while the chunks around it load; eviction within ``bytes_to_use``;
engines starting together on one path never counting the same room; every bad key named at build; and the
primary tier's memory let go at shutdown (the mmap then closes)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")
pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")
from vllm.config import set_current_vllm_config
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext

from kvcopy.integrations.vllm import KVCopyDiskTier
from kvcopy.integrations.vllm.tiers.disk import PROMOTION_LATENCY, store_hash
from kvcopy.integrations.vllm.tiers.stores import PATH_LOCK, stores_nbytes
from kvcopy.storage.files import DATA

from helpers import HANG_TIMEOUT_S
from helpers.disk_tier import (
    NUM_ROWS,
    ROW_BYTES,
    engine_config,
    job,
    key,
    make_tier,
    model_dir,
    offloading_spec,
    primary,
    run,
    tier_of,
)
from helpers.exit_status import assert_ucx_modules_chosen_for_this_machine, run_python

CHUNKS = 4
REQUEST = ReqContext("r")


def stored(tier, rows_of, n: int = CHUNKS) -> list[bytes]:
    """Fills rows 0..n-1 with distinct bytes and stores them as chunks 0..n-1; returns the bytes."""
    data = [rows_of.fill(i, seed=100 + i) for i in range(n)]
    result = run(tier, job([key(i) for i in range(n)], list(range(n)), promotion=False))
    assert result.success
    return data


def promoted(tier, rows_of) -> list[bytes]:
    """Promotes chunks 0..CHUNKS-1 into rows 4..7 (asserting the job succeeded); returns those rows' bytes."""
    assert run(tier, job([key(i) for i in range(CHUNKS)], [4, 5, 6, 7], promotion=True)).success
    return [rows_of.rows[4 + i].tobytes() for i in range(CHUNKS)]


class HeldIO:
    """The tier's IO thread, watched and held through its store: each job it posts is recorded in order
    (``posted``: ("cascade" | "promotion", the job's store hashes)); its first put waits for ``release_put``
    (``put_entered`` says it is there); NIXL reports every transfer of the store in flight, so nothing is
    committed, until ``release_done`` (``polled`` says the IO thread has polled a put it posted).
    ``release()`` lets everything go."""

    def __init__(self, tier, monkeypatch) -> None:
        store = tier.store
        self.posted: list[tuple[str, list[str]]] = []
        self.put_entered, self.release_put = threading.Event(), threading.Event()
        self.polled, self.release_done = threading.Event(), threading.Event()
        real_put, real_match, real_state = store.put, store.match, store._agent.check_xfer_state

        def put(block_hashes, pool, pool_ids):
            self.posted.append(("cascade", list(block_hashes)))
            if len(self.posted) == 1:
                self.put_entered.set()
                assert self.release_put.wait(HANG_TIMEOUT_S)
            return _PolledTransfer(real_put(block_hashes, pool, pool_ids), self.polled)

        def match(block_hashes):  # (the IO thread's first call for a promotion)
            self.posted.append(("promotion", list(block_hashes)))
            return real_match(block_hashes)

        def state(handle):
            return real_state(handle) if self.release_done.is_set() else "PROC"

        monkeypatch.setattr(store, "put", put)
        monkeypatch.setattr(store, "match", match)
        monkeypatch.setattr(store._agent, "check_xfer_state", state)

    def release(self) -> None:
        self.release_put.set()
        self.release_done.set()


class _PolledTransfer:
    """A put's transfer that says when the IO thread polls it."""

    def __init__(self, transfer, polled: threading.Event) -> None:
        self._transfer, self._polled = transfer, polled

    def done(self) -> bool:
        self._polled.set()
        return self._transfer.done()


def test_chunks_stored_and_loaded_back_are_bitwise_the_rows(tmp_path):
    rows = primary()
    with tier_of(tmp_path / "tier", rows) as tier:
        assert isinstance(tier, KVCopyDiskTier) and tier.medium is Medium.STORAGE
        data = stored(tier, rows)
        assert [tier.lookup(key(i), REQUEST) for i in range(CHUNKS + 1)] == [LookupResult.HIT] * CHUNKS + [
            LookupResult.MISS
        ]
        rows.rows[:] = 0
        into = [7, 5, 4, 6]
        result = run(tier, job([key(i) for i in range(CHUNKS)], into, promotion=True))
        assert result.success and result.successful_keys is None
        assert result.transfer_bytes == CHUNKS * ROW_BYTES
        for i, row in enumerate(into):
            assert rows.rows[row].tobytes() == data[i], i
        assert not rows.rows[:4].any()  # nothing else written
        stats = tier.get_stats()
        values = stats.metric_sections()[1]
        total = {
            name: sum(v for v in by_label.values() if not isinstance(v, list)) for name, by_label in values.items()
        }
        prefix = "vllm:kv_offload_kvcopy_disk_"
        assert total[f"{prefix}stored_blocks"] == CHUNKS and total[f"{prefix}stored_bytes"] == CHUNKS * ROW_BYTES
        assert total[f"{prefix}loaded_blocks"] == CHUNKS and total[f"{prefix}loaded_bytes"] == CHUNKS * ROW_BYTES
        assert len(values[PROMOTION_LATENCY][("KVCopyDiskTier",)]) == 1
        assert tier.get_stats() is None  # taken: nothing new since
    rows.close()  # the tier let go of every view of it


def test_a_chunk_is_a_miss_until_its_cascade_is_committed(tmp_path, monkeypatch):
    """``lookup`` answers from what the store has committed: a chunk whose cascade is queued behind another, or
    whose put is in flight, is a MISS (a HIT would have vLLM count it stored, and promote a chunk the disk does
    not hold yet); a HIT once the put is committed."""
    rows = primary()
    with tier_of(tmp_path / "tier", rows) as tier:
        io = HeldIO(tier, monkeypatch)
        first, second = [key(0), key(1)], [key(2), key(3)]
        data = [rows.fill(i, seed=200 + i) for i in range(4)]
        jobs = [job(first, [0, 1], promotion=False), job(second, [2, 3], promotion=False)]
        try:
            tier.submit_store(jobs[0])
            assert io.put_entered.wait(HANG_TIMEOUT_S)  # the IO thread posts the first cascade...
            tier.submit_store(jobs[1])  # ... and the second waits in the queue behind it
            assert [tier.lookup(k, REQUEST) for k in first + second] == [LookupResult.MISS] * 4
            io.release_put.set()
            assert io.polled.wait(HANG_TIMEOUT_S)  # the first put in flight, not done: nothing committed
            assert [tier.lookup(k, REQUEST) for k in first + second] == [LookupResult.MISS] * 4
        finally:
            io.release()
        tier.drain_jobs()
        assert all(r.success for r in tier.get_finished_jobs())
        assert [tier.lookup(k, REQUEST) for k in first + second] == [LookupResult.HIT] * 4
        rows.rows[:] = 0
        assert promoted(tier, rows) == data
    rows.close()


def test_a_promotion_queued_behind_cascades_is_posted_before_them(tmp_path, monkeypatch):
    """A resumed request waits on its promotion, nobody on a cascade: the IO thread posts a queued promotion
    before the cascades queued ahead of it."""
    rows = primary()
    with tier_of(tmp_path / "tier", rows) as tier:
        data = stored(tier, rows, n=2)
        io = HeldIO(tier, monkeypatch)
        for i in (2, 3, 4):
            rows.fill(i, seed=300 + i)
        promotion = job([key(0), key(1)], [6, 7], promotion=True)
        try:
            tier.submit_store(job([key(2)], [2], promotion=False))
            assert io.put_entered.wait(HANG_TIMEOUT_S)  # the IO thread busy with a cascade...
            tier.submit_store(job([key(3)], [3], promotion=False))  # ... a backlog of cascades queued...
            tier.submit_store(job([key(4)], [4], promotion=False))
            tier.submit_load(promotion)  # ... and a promotion behind them
        finally:
            io.release()
        tier.drain_jobs()
        hashes = [store_hash(key(i)) for i in range(5)]
        assert io.posted == [
            ("cascade", [hashes[2]]),
            ("promotion", hashes[:2]),
            ("cascade", [hashes[3]]),
            ("cascade", [hashes[4]]),
        ]
        results = {r.job_id: r for r in tier.get_finished_jobs()}
        assert len(results) == 4 and all(r.success for r in results.values())
        assert [rows.rows[6].tobytes(), rows.rows[7].tobytes()] == data
    rows.close()


def test_a_chunk_stored_again_keeps_the_bytes_first_stored(tmp_path):
    rows = primary()
    with tier_of(tmp_path / "tier", rows) as tier:
        data = stored(tier, rows)
        tier.get_stats()
        rows.fill(0, seed=999)  # other bytes under the same key: vLLM's keys name the bytes, the first are kept
        assert run(tier, job([key(0)], [0], promotion=False)).success
        assert tier.get_stats() is None  # nothing new stored
        assert run(tier, job([key(0)], [7], promotion=True)).success
        assert rows.rows[7].tobytes() == data[0]
    rows.close()


def test_a_new_tier_of_the_same_identity_finds_what_was_stored(tmp_path):
    model = model_dir(tmp_path)
    rows = primary()
    with tier_of(tmp_path / "tier", rows, engine_config(model)) as tier:
        data = stored(tier, rows)
    rows.rows[:] = 0
    with tier_of(tmp_path / "tier", rows, engine_config(model)) as tier:
        assert all(tier.lookup(key(i), REQUEST) is LookupResult.HIT for i in range(CHUNKS))
        assert promoted(tier, rows) == data
        stats = tier.get_stats()
        assert "vllm:kv_offload_kvcopy_disk_identity_refusals" not in stats.metric_sections()[1]


@pytest.mark.parametrize(
    "changed",
    [{"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}}, {"cache_dtype": "fp8"}],
    ids=["rope_scaling", "kv_cache_dtype"],
)
def test_a_tier_whose_only_change_is_rope_scaling_or_the_kv_dtype_finds_nothing(tmp_path, changed, caplog):
    model = model_dir(tmp_path)
    rows = primary()
    with tier_of(tmp_path / "tier", rows, engine_config(model)) as tier:
        stored(tier, rows)
    with (
        caplog.at_level("WARNING", logger="kvcopy.integrations.vllm"),
        tier_of(tmp_path / "tier", rows, engine_config(model, **changed)) as tier,
    ):
        assert all(tier.lookup(key(i), REQUEST) is LookupResult.MISS for i in range(CHUNKS))
        values = tier.get_stats().metric_sections()[1]
        assert values["vllm:kv_offload_kvcopy_disk_identity_refusals"] == {("KVCopyDiskTier",): 1}
    said = [r.getMessage() for r in caplog.records if "another identity" in r.getMessage()]
    assert len(said) == 1
    assert ("rope" if "hf_overrides" in changed else "cache_dtype") in said[0]
    # the old identity's store is kept: the new one takes room only as it fills (tests/integrations/
    # test_vllm_disk_tier_budget.py)
    assert len([n for n in os.listdir(tmp_path / "tier") if n.startswith("kvcopy-")]) == 2


@pytest.mark.parametrize(("entry", "value"), [("rope_theta", 500000.0), ("num_hidden_layers", 3)])
def test_a_tier_whose_only_change_is_the_models_own_config_json_finds_nothing(tmp_path, entry, value, caplog):
    """The model's config.json edited in place (same path, no hf_overrides): the config vLLM resolves is part
    of the identity, so the chunks stored before are not served; unchanged, they are."""
    model = model_dir(tmp_path)
    rows = primary()
    with tier_of(tmp_path / "tier", rows, engine_config(model)) as tier:
        stored(tier, rows)
    with tier_of(tmp_path / "tier", rows, engine_config(model)) as tier:  # the same config: served
        assert all(tier.lookup(key(i), REQUEST) is LookupResult.HIT for i in range(CHUNKS))
    config_path = os.path.join(model, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    assert config.get(entry) != value
    with open(config_path, "w") as f:
        json.dump({**config, entry: value}, f)
    with (
        caplog.at_level("WARNING", logger="kvcopy.integrations.vllm"),
        tier_of(tmp_path / "tier", rows, engine_config(model)) as tier,
    ):
        assert all(tier.lookup(key(i), REQUEST) is LookupResult.MISS for i in range(CHUNKS))
    said = [r.getMessage() for r in caplog.records if "another identity" in r.getMessage()]
    assert len(said) == 1 and "engine.hf_config." in said[0] and entry in said[0]
    rows.close()


def test_a_flipped_byte_is_refused_and_dropped_while_the_other_chunks_load(tmp_path):
    rows = primary()
    with tier_of(tmp_path / "tier", rows) as tier:
        data = stored(tier, rows)
        slot = tier.store.match([store_hash(key(2))])[0]
        with open(os.path.join(tier.store.path, DATA), "r+b") as f:
            f.seek(slot * ROW_BYTES + 100)
            byte = f.read(1)
            f.seek(slot * ROW_BYTES + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        tier.store.drop_page_cache()
        rows.rows[:] = 0
        keys = [key(i) for i in range(CHUNKS)]
        result = run(tier, job(keys, [4, 5, 6, 7], promotion=True))
        assert not result.success
        assert list(result.successful_keys) == [keys[0], keys[1], keys[3]]
        assert [rows.rows[4].tobytes(), rows.rows[5].tobytes(), rows.rows[7].tobytes()] == [data[0], data[1], data[3]]
        assert tier.lookup(keys[2], REQUEST) is LookupResult.MISS  # dropped from the store
        values = tier.get_stats().metric_sections()[1]
        assert values["vllm:kv_offload_kvcopy_disk_corrupt_blocks"] == {("KVCopyDiskTier",): 1}
        assert values["vllm:kv_offload_kvcopy_disk_loaded_blocks"] == {("KVCopyDiskTier",): 3}
    rows.close()


def test_the_store_keeps_the_most_recently_used_chunks_within_bytes_to_use(tmp_path):
    rows = primary()
    with tier_of(tmp_path / "tier", rows, bytes_to_use=3 * ROW_BYTES + ROW_BYTES // 2) as tier:
        assert tier.store.num_blocks == 3
        stored(tier, rows, n=3)
        tier.touch([key(0)], REQUEST)
        rows.fill(3, seed=7)
        assert run(tier, job([key(3)], [3], promotion=False)).success
        assert [tier.lookup(key(i), REQUEST) is LookupResult.HIT for i in range(4)] == [True, False, True, True]
        # a promotion of a chunk evicted since its lookup: its prefix loads, the rest fails
        result = run(tier, job([key(0), key(1)], [6, 7], promotion=True))
        assert not result.success and list(result.successful_keys) == [key(0)]
    rows.close()


@pytest.mark.parametrize(
    ("keys", "error", "message"),
    [
        ({"path": None}, ValueError, "path: required"),
        ({"path": 5}, TypeError, "path"),
        ({"bytes_to_use": None}, ValueError, "bytes_to_use: required"),
        ({"bytes_to_use": 0}, ValueError, "bytes_to_use"),
        ({"bytes_to_use": -1}, ValueError, "bytes_to_use"),
        ({"bytes_to_use": 1.5e9}, TypeError, "bytes_to_use"),
        ({"bytes_to_use": "8GB"}, TypeError, "bytes_to_use"),
        ({"bytes_to_use": 10**18}, ValueError, "bytes_to_use: .* has room for"),
        ({"bytes_to_use": ROW_BYTES - 1}, ValueError, "bytes_to_use: .* hold no row"),
        ({"backend": "nvme"}, ValueError, "backend: expected one of"),
        ({"backend": 1}, TypeError, "backend"),
        ({"cache_key_extra": 3}, TypeError, "cache_key_extra"),
        ({"byte_to_use": 1}, ValueError, "byte_to_use: not a key of KVCopyDiskTier .*did you mean 'bytes_to_use'"),
    ],
)
def test_each_bad_key_is_named_when_the_tier_is_built(tmp_path, keys, error, message):
    rows = primary()
    config = {"path": str(tmp_path / "tier"), "bytes_to_use": NUM_ROWS * ROW_BYTES, **keys}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(error, match=message):
        make_tier(rows, **config)
    made = [p for p in (tmp_path / "tier").glob("kvcopy-*") if p.is_dir()]
    assert not [p for p in made if os.listdir(p) not in ([], ["lock"])]  # no store made
    rows.close()  # nothing of a refused tier holds the memory


def test_a_path_that_is_a_file_or_cannot_be_made_is_refused(tmp_path):
    rows = primary()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"path: .* exists and is not a directory"):
        make_tier(rows, path=str(tmp_path / "file"), bytes_to_use=ROW_BYTES)
    with pytest.raises(ValueError, match=r"path: .* is not a directory that can be made"):
        make_tier(rows, path=str(tmp_path / "file" / "below"), bytes_to_use=ROW_BYTES)
    rows.close()


def test_two_engines_of_one_identity_cannot_share_a_store(tmp_path):
    rows, other = primary(), primary()
    config = engine_config(model_dir(tmp_path))
    with (
        tier_of(tmp_path / "tier", rows, config),
        pytest.raises(ValueError, match="another engine of the same identity"),
        set_current_vllm_config(config),
    ):
        make_tier(other, path=str(tmp_path / "tier"), bytes_to_use=NUM_ROWS * ROW_BYTES, spec=offloading_spec())
    rows.close()
    other.close()


def test_data_parallel_replicas_on_one_path_each_take_their_share(tmp_path):
    """vLLM's data-parallel replicas each run a scheduler, so a tier (an identity) each: bytes_to_use is shared."""
    rows, other = primary(), primary()
    config = engine_config(model_dir(tmp_path))
    replicas = [offloading_spec(data_parallel=(index, 2)) for index in range(2)]
    with (
        tier_of(tmp_path / "tier", rows, config, spec=replicas[0]) as first,
        tier_of(tmp_path / "tier", other, config, spec=replicas[1]) as second,
    ):
        assert first.store.num_blocks == second.store.num_blocks == NUM_ROWS // 2
        data = stored(second, other)
        assert first.lookup(key(0), REQUEST) is LookupResult.MISS  # a store each
        other.rows[:] = 0
        assert promoted(second, other) == data
    rows.close()
    other.close()


def test_a_raised_budget_lets_the_store_grow_on_with_its_chunks(tmp_path):
    """A store made under a smaller budget keeps its chunks when the budget is raised: its data file gets the
    new budget's blocks (holes), and it grows into them as it fills."""
    model = model_dir(tmp_path)
    rows = primary()
    with tier_of(tmp_path / "tier", rows, engine_config(model), bytes_to_use=3 * ROW_BYTES) as tier:
        data = stored(tier, rows, n=2)
        assert tier.store.num_blocks == 3
    rows.rows[:] = 0
    with tier_of(tmp_path / "tier", rows, engine_config(model)) as tier:  # bytes_to_use: NUM_ROWS rows now
        assert tier.store.num_blocks == NUM_ROWS and tier.store.room == 2
        assert run(tier, job([key(0), key(1)], [6, 7], promotion=True)).success
        assert [rows.rows[6].tobytes(), rows.rows[7].tobytes()] == data
        more = [rows.fill(i, seed=50 + i) for i in range(NUM_ROWS - 2)]
        assert run(tier, job([key(i) for i in range(2, NUM_ROWS)], list(range(NUM_ROWS - 2)), promotion=False)).success
        assert tier.store.room == NUM_ROWS
        assert [tier.lookup(key(i), REQUEST) for i in range(NUM_ROWS)] == [LookupResult.HIT] * NUM_ROWS
        rows.rows[:] = 0
        assert run(tier, job([key(i) for i in range(2, NUM_ROWS)], list(range(NUM_ROWS - 2)), promotion=True)).success
        assert [rows.rows[i].tobytes() for i in range(NUM_ROWS - 2)] == more
    rows.close()


def test_engines_starting_together_on_one_path_decide_one_after_the_other(tmp_path):
    """While one engine sizes, removes and opens stores under path (holding its PATH_LOCK), another waits."""
    rows = primary()
    (tmp_path / "tier").mkdir()
    fd = os.open(tmp_path / "tier" / PATH_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # an engine deciding
    built: list = []
    starting = threading.Thread(
        target=lambda: built.append(make_tier(rows, path=str(tmp_path / "tier"), bytes_to_use=NUM_ROWS * ROW_BYTES))
    )
    try:
        starting.start()
        starting.join(0.5)
        assert starting.is_alive() and not built  # waiting for the engine that decides
        assert not list((tmp_path / "tier").glob("kvcopy-*"))  # and nothing made meanwhile
    finally:
        os.close(fd)
        starting.join(HANG_TIMEOUT_S)
    assert len(built) == 1 and built[0].store.num_blocks == NUM_ROWS
    built[0].shutdown()
    rows.close()


def test_two_engines_starting_at_once_on_one_path_never_count_the_same_room(tmp_path, monkeypatch):
    """Two engines of different identities start together on one path, each cascading a budget's worth of
    chunks: whichever decides second does so only once the first has taken its room (the path's lock is
    exclusive), so together they never hold more than ``bytes_to_use``, in chunks served or in bytes on the
    disk. The first is held as it takes room on the disk (the first fallocate, after it counted the room, under
    the path's lock, which it then holds alone) until the second is seen blocked on a lock, or has ended."""
    budget = NUM_ROWS * ROW_BYTES
    primaries = [primary(), primary()]
    first_taking, release_first, second_blocked_or_ended = threading.Event(), threading.Event(), threading.Event()
    engines: list[threading.Thread] = []
    real_fallocate, real_flock = os.posix_fallocate, fcntl.flock

    def fallocate(fd: int, offset: int, length: int) -> None:
        if not first_taking.is_set():  # the first room taken: the first engine's (the second is not started)
            first_taking.set()
            assert release_first.wait(HANG_TIMEOUT_S)
        real_fallocate(fd, offset, length)

    def flock(fd: int, operation: int) -> None:
        if first_taking.is_set() and not release_first.is_set() and not operation & (fcntl.LOCK_NB | fcntl.LOCK_UN):
            second_blocked_or_ended.set()  # (the first engine is held) the second is about to wait for a lock
        real_flock(fd, operation)

    outcomes: list[object] = [None, None]  # each engine's tier, or the error that refused it
    cascade_errors: list[BaseException] = []

    def start(index: int) -> None:
        """An engine's tier, started; then a cascade of a budget's worth of chunks into it."""
        try:
            tier = make_tier(primaries[index], path=str(tmp_path / "tier"), bytes_to_use=budget,
                             cache_key_extra=f"engine {index}")  # fmt: skip
        except Exception as err:
            err.__traceback__ = None  # (its frames hold the primary's view, which could then not be closed)
            outcomes[index] = err
        else:
            outcomes[index] = tier
            try:
                for row in range(NUM_ROWS):
                    primaries[index].fill(row, seed=1000 * index + row)
                run(tier, job([key(i) for i in range(NUM_ROWS)], list(range(NUM_ROWS)), promotion=False))
            except BaseException as err:  # (said by the test's thread)
                cascade_errors.append(err)
        finally:
            (first_taking if index == 0 else second_blocked_or_ended).set()  # (ended: no wait for it hangs)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr(fcntl, "flock", flock)
    engines.extend(threading.Thread(target=start, args=(i,)) for i in range(2))
    try:
        engines[0].start()
        assert first_taking.wait(HANG_TIMEOUT_S) and engines[0].is_alive(), outcomes  # held taking its room
        probe = os.open(tmp_path / "tier" / PATH_LOCK, os.O_RDWR)
        try:  # it holds the path's lock: does anyone else (a reader, even) get it meanwhile?
            real_flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            shared = True
        except BlockingIOError:
            shared = False
        finally:
            os.close(probe)  # (and the probe's lock, if it got it)
        engines[1].start()
        assert second_blocked_or_ended.wait(HANG_TIMEOUT_S)
    finally:
        release_first.set()
        for engine in engines:
            if engine.ident is not None:  # (started)
                engine.join(HANG_TIMEOUT_S)
    monkeypatch.undo()
    started = [tier for tier in outcomes if isinstance(tier, KVCopyDiskTier)]
    try:
        assert started and not cascade_errors, (outcomes, cascade_errors)
        for refused in (o for o in outcomes if not isinstance(o, KVCopyDiskTier)):
            assert isinstance(refused, ValueError) and "bytes_to_use" in str(refused), refused
        served = sum(tier.lookup(key(i), REQUEST) is LookupResult.HIT for tier in started for i in range(NUM_ROWS))
        assert 0 < served * ROW_BYTES <= budget
        assert stores_nbytes(str(tmp_path / "tier")) <= budget
        assert not shared, "the path's lock was shared while an engine held it to take room"
    finally:
        for tier in started:
            tier.shutdown()
    for rows in primaries:
        rows.close()


def test_a_tier_that_fails_after_opening_its_store_lets_go_of_it(tmp_path, monkeypatch):
    """vLLM never gets a tier whose constructor raised, so never shuts it down: the tier closes its store (and
    lets go of its lock and of the primary tier's memory) itself."""
    rows = primary()
    config = engine_config(model_dir(tmp_path))

    def fail() -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr("kvcopy.integrations.vllm.tiers.disk._warn_if_hashes_change_per_process", fail)
    with pytest.raises(RuntimeError, match="injected"), set_current_vllm_config(config):
        make_tier(rows, path=str(tmp_path / "tier"), bytes_to_use=NUM_ROWS * ROW_BYTES)
    monkeypatch.undo()
    with tier_of(tmp_path / "tier", rows, config) as tier:  # the same identity: its store is free to open
        assert tier.store.num_blocks == NUM_ROWS
    rows.close()


def test_a_path_on_a_filesystem_without_locks_is_a_value_error_naming_it(tmp_path, monkeypatch):
    """NFS without lockd answers flock with ENOLCK: the tier cannot keep its store its own there."""
    rows = primary()

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr("kvcopy.integrations.vllm.tiers.stores.fcntl.flock", no_locks)
    with pytest.raises(ValueError, match=r"path: .* cannot take a lock"):
        make_tier(rows, path=str(tmp_path / "tier"), bytes_to_use=NUM_ROWS * ROW_BYTES)
    rows.close()  # nothing of the refused tier holds the memory


def test_the_engines_config_is_found_where_vllms_connector_holds_it(tmp_path, caplog):
    """In vLLM's scheduler process no VllmConfig is current: the tier takes the one the connector that builds it
    was given (a caller's ``vllm_config``), so the model's config is in the identity all the same."""
    rows = primary()
    config = engine_config(model_dir(tmp_path), hf_overrides={"rope_theta": 50000.0})

    def connector_scheduler(vllm_config):  # as vLLM's OffloadingConnectorScheduler holds it, not current
        return make_tier(rows, path=str(tmp_path / "tier"), bytes_to_use=NUM_ROWS * ROW_BYTES)

    with caplog.at_level("WARNING", logger="kvcopy.integrations.vllm"):
        tier = connector_scheduler(config)
    try:
        assert not [r for r in caplog.records if "VllmConfig was not found" in r.getMessage()]
        identity = json.loads(
            (tmp_path / "tier" / os.path.basename(tier._tier_store.folder) / "identity.json").read_text()
        )
        assert identity["engine"]["hf_overrides"] == {"rope_theta": 50000}  # the engine's own, found
    finally:
        tier.shutdown()
    rows.close()


def test_a_hash_that_changes_with_each_process_is_said_once(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    config = engine_config(model_dir(tmp_path))
    config.cache_config.prefix_caching_hash_algo = "xxhash"
    rows = primary()
    with caplog.at_level("WARNING", logger="kvcopy.integrations.vllm"), tier_of(tmp_path / "tier", rows, config):
        pass
    said = [r.getMessage() for r in caplog.records if "cannot hit across restarts" in r.getMessage()]
    assert len(said) == 1 and "PYTHONHASHSEED" in said[0]
    rows.close()


@pytest.mark.slow
def test_a_process_that_used_the_tier_exits_with_status_0(tmp_path):
    code = f"""
        from helpers.disk_tier import job, key, primary, run, tier_of
        rows = primary()
        with tier_of({str(tmp_path / "tier")!r}, rows) as tier:
            data = [rows.fill(i, seed=100 + i) for i in range(2)]
            stored = run(tier, job([key(0), key(1)], [0, 1], promotion=False)).success
            rows.rows[:] = 0
            loaded = run(tier, job([key(0), key(1)], [3, 2], promotion=True)).success
            back = [rows.rows[3].tobytes(), rows.rows[2].tobytes()]
            print("stored and loaded back:", stored and loaded and back == data)
        rows.close()
    """
    result = run_python(code)
    assert result.returncode == 0, result.described
    assert "stored and loaded back: True" in result.stdout, result.described
    assert_ucx_modules_chosen_for_this_machine(result)
