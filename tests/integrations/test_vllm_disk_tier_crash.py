"""A KVCopyDiskTier killed with SIGKILL mid-cascade, at many points: a new tier of the same identity then serves
only chunks bitwise equal to what was stored, and every chunk whose cascade was reported done and not evicted
since. And one killed while it takes room from another identity's store and grows its own, at each step of
that: both stores then serve only right chunks, within the budget.

The child cascades chunk after chunk (chunk i's bytes are a function of i), up to NUM_ROWS in flight, each
through a primary row no job in flight uses (as vLLM pins a row for its job), and prints each job's submission
and end; the test kills it after the k-th submission, for k across the run.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")
pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from helpers.disk_tier import (
    NUM_ROWS,
    ROW_BYTES,
    chunk_bytes,
    engine_config,
    job,
    key,
    model_dir,
    primary,
    run,
    tier_of,
)
from helpers.forked import Child

CHUNKS = 120  # cascaded by the child, more than the store holds: it evicts as it goes
STORE_ROWS = 48
# Submissions before SIGKILL: the first job, jobs in flight while the store fills (it holds STORE_ROWS), and
# jobs that evict as they go.
KILL_AFTER = (1, 6, 15, 36, 55, 78)
# ext4 counts an extent-tree block in a file's allocated bytes once it has more than four extents
METADATA_SLACK = 4096

CHILD = """
from helpers.disk_tier import chunk_bytes, engine_config, job, key, primary, tier_of, NUM_ROWS
rows = primary()
with tier_of({path!r}, rows, engine_config({model!r}), bytes_to_use={budget}) as tier:
    in_flight = {{}}  # job id -> (chunk, row)
    free = list(range(NUM_ROWS))
    for i in range({chunks}):
        while not free:
            for result in tier.get_finished_jobs():
                chunk, row = in_flight.pop(result.job_id)
                print("done", chunk, result.success, flush=True)
                free.append(row)
        row = free.pop()
        rows.rows[row] = chunk_bytes(i)
        cascade = job([key(i)], [row], promotion=False)
        in_flight[cascade.job_id] = (i, row)
        tier.submit_store(cascade)
        print("posted", i, flush=True)
"""


@pytest.mark.slow
def test_a_tier_killed_mid_cascade_serves_only_what_it_stored(tmp_path):
    model = model_dir(tmp_path)
    served_total = 0
    for kill_after in KILL_AFTER:
        path = str(tmp_path / f"tier-{kill_after}")  # a fresh path: each kill point is checked on its own
        code = CHILD.format(path=path, model=model, budget=STORE_ROWS * ROW_BYTES, chunks=CHUNKS)
        posted, done = 0, []
        with Child(code) as child:
            for line in child.lines():
                words = line.split()
                if words[:1] == ["posted"]:
                    posted += 1
                    if posted == kill_after:
                        child.kill()
                        break
                elif words[:1] == ["done"] and words[2] == "True":
                    done.append(int(words[1]))
            child.communicate()
        assert child.returncode == -signal.SIGKILL, f"the child ended before its kill ({child.returncode})"
        rows = primary()
        with tier_of(path, rows, engine_config(model), bytes_to_use=STORE_ROWS * ROW_BYTES) as tier:
            served = []
            for i in range(CHUNKS):
                if tier.lookup(key(i), ReqContext("check")) is not LookupResult.HIT:
                    continue
                assert run(tier, job([key(i)], [0], promotion=True)).success, i
                assert np.array_equal(rows.rows[0], chunk_bytes(i)), f"chunk {i} served with other bytes"
                served.append(i)
            # what was reported stored and is within the store's most recent rows is there
            recent = [i for i in done if i >= max(done, default=0) - (STORE_ROWS - NUM_ROWS) + 1]
            assert set(recent) <= set(served), (kill_after, sorted(set(recent) - set(served)))
            served_total += len(served)
        rows.close()
    assert served_total  # the restarts did serve chunks (the check above is not vacuous)


# A child of identity B cascades chunk after chunk into a path whose budget A's store fills: each cascade takes
# a chunk's room from A (A's least recently used chunk forgotten, its hole punched, A's header lowered) and grows
# B (the block backed). The child pauses before the n-th call of one of those steps, and is killed there. B's
# opening punches twice; A's, once (when B first takes from it: then kept open); then each cascade calls free
# (A's chunk forgotten), punch_hole (its hole), write_header (A's room), posix_fallocate (B's growth) and free
# (B's put, evicting nothing).
GROWTH_KILL_POINTS = (
    ("free", 1),  # nothing of the first give-back done yet
    ("punch_hole", 4),  # A's chunk forgotten, its hole not punched yet
    ("write_header", 1),  # A's chunk punched, A's header not lowered yet
    ("posix_fallocate", 1),  # A's header lowered, B not grown yet
    ("free", 2),  # B grown (its header not written: the open repairs it), its put not posted yet
    ("punch_hole", 6),  # A's chunk forgotten, two cascades on
    ("write_header", 3),  # A's chunk punched, two cascades on
)
GROWTH_CHUNKS = 6  # the child cascades chunks GROWTH_FIRST.. of identity B, fewer than the budget holds
GROWTH_FIRST = 100

GROWTH_CHILD = """
import os, time
import kvcopy.storage.room as room
from helpers.disk_tier import chunk_bytes, engine_config, job, key, primary, run, tier_of
point, at, calls = {point!r}, {at}, [0]
from kvcopy.storage.commit_log import CommitLog
owner = os if point == "posix_fallocate" else CommitLog if point == "free" else room
real = getattr(owner, point)
def paused(*args, **kwargs):
    calls[0] += 1
    if calls[0] == at:
        print("paused", point, at, flush=True)
        time.sleep(3600)  # killed here
    return real(*args, **kwargs)
setattr(owner, point, paused)
rows = primary()
with tier_of({path!r}, rows, engine_config({model!r}), bytes_to_use={budget}, cache_key_extra="B") as tier:
    for i in range({first}, {first} + {chunks}):
        rows.rows[0] = chunk_bytes(i)
        print("done", i, run(tier, job([key(i)], [0], promotion=False)).success, flush=True)
"""


def _served_bitwise(tier, rows, chunks) -> list[int]:
    """The chunks of ``chunks`` the tier (over ``rows``) holds, each promoted into row 0 (asserting it loads, its
    bytes the chunk's)."""
    served = []
    for i in chunks:
        if tier.lookup(key(i), ReqContext("check")) is LookupResult.HIT:
            assert run(tier, job([key(i)], [0], promotion=True)).success, i
            assert np.array_equal(rows.rows[0], chunk_bytes(i)), f"chunk {i} served with other bytes"
            served.append(i)
    return served


@pytest.mark.slow
def test_a_tier_killed_while_it_takes_room_and_grows_serves_only_what_it_stored(tmp_path):
    """After each kill, both identities' stores serve only chunks bitwise equal to what was stored: B every chunk
    it reported cascaded, A the most recently used ones it kept; together they stay within the budget, and each
    data file takes no more of the disk than its room."""
    from kvcopy.storage.files import DATA, read_header

    model = model_dir(tmp_path)
    budget = NUM_ROWS * ROW_BYTES
    for point, at in GROWTH_KILL_POINTS:
        path = str(tmp_path / f"tier-{point}-{at}")
        rows = primary()
        with tier_of(path, rows, engine_config(model), bytes_to_use=budget, cache_key_extra="A") as tier:
            for i in range(NUM_ROWS):  # A fills the budget
                rows.rows[0] = chunk_bytes(i)
                assert run(tier, job([key(i)], [0], promotion=False)).success
        code = GROWTH_CHILD.format(
            point=point, at=at, path=path, model=model, budget=budget, first=GROWTH_FIRST,
            chunks=GROWTH_CHUNKS,
        )  # fmt: skip
        done, paused = [], False
        with Child(code) as child:
            for line in child.lines():
                words = line.split()
                if words[:1] == ["paused"]:
                    paused = True
                    child.kill()
                    break
                if words[:1] == ["done"] and words[2] == "True":
                    done.append(int(words[1]))
            child.communicate()
        assert paused and child.returncode == -signal.SIGKILL, (point, at, child.returncode)
        other = primary()
        with (
            tier_of(path, rows, engine_config(model), bytes_to_use=budget, cache_key_extra="B") as b,
            tier_of(path, other, engine_config(model), bytes_to_use=budget, cache_key_extra="A") as a,
        ):
            b_served = _served_bitwise(b, rows, range(GROWTH_FIRST, GROWTH_FIRST + GROWTH_CHUNKS))
            assert set(done) <= set(b_served), (point, at, done, b_served)
            a_served = _served_bitwise(a, other, range(NUM_ROWS))
            assert a_served == list(range(NUM_ROWS - len(a_served), NUM_ROWS)), (point, at)  # its least recent went
            assert (a.store.room + b.store.room) * ROW_BYTES <= budget, (point, at)
            for tier in (a, b):
                store = tier.store
                assert read_header(store.path)["room"] == store.room
                disk = os.stat(os.path.join(store.path, DATA)).st_blocks * 512
                assert disk <= store.room * ROW_BYTES + METADATA_SLACK, (point, at, disk, store.room)
        rows.close()
        other.close()
