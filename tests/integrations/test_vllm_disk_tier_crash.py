"""A KVCopyDiskTier killed with SIGKILL mid-cascade, at many points: a new tier of the same identity then serves
only chunks bitwise equal to what was stored, and every chunk whose cascade was reported done and not evicted
since.

The child cascades chunk after chunk (chunk i's bytes are a function of i), up to NUM_ROWS in flight, each
through a primary row no job in flight uses (as vLLM pins a row for its job), and prints each job's submission
and end; the test kills it after the k-th submission, for k across the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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

TESTS = str(Path(__file__).resolve().parents[1])
CHUNKS = 120  # cascaded by the child, more than the store holds: it evicts as it goes
STORE_ROWS = 48
KILL_AFTER = (1, 3, 6, 10, 15, 21, 28, 36, 45, 55, 66, 78)  # submissions before SIGKILL

CHILD = """
import sys
sys.path.insert(0, {tests!r})
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
        code = CHILD.format(tests=TESTS, path=path, model=model, budget=STORE_ROWS * ROW_BYTES, chunks=CHUNKS)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        posted, done = 0, []
        for line in child.stdout:
            words = line.split()
            if words[:1] == ["posted"]:
                posted += 1
                if posted == kill_after:
                    os.kill(child.pid, signal.SIGKILL)
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
