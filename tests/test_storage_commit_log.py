"""The disk store's commit log (kvcopy/storage/_commit_log.py): replayed as committed, a torn tail cut off at
every byte, compaction invisible, and a writer killed with SIGKILL at many points never leaves a log that
fails to open or forgets a commit it reported."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from kvcopy.storage._commit_log import COMPACT_FACTOR, MAGIC, RECORD_BYTES, CommitLog, Entry


def h(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def state(log: CommitLog) -> dict[int, tuple[str, int]]:
    return {slot: (log.get(e.block_hash).block_hash, e.checksum) for slot, e in log._by_slot.items()}


def test_commits_and_frees_survive_a_reopen(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 8)
    log.commit([Entry(0, h(0), 11), Entry(3, h(3), 33)])
    log.free([0])
    log.commit([Entry(5, h(5), 55)])
    before = state(log)
    log.close()
    again = CommitLog(path, 8)
    assert state(again) == before == {3: (h(3), 33), 5: (h(5), 55)}
    assert again.get(h(0)) is None and again.get(h(3)).slot == 3
    again.close()


def test_a_torn_last_record_is_cut_off_at_every_byte(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 4)
    log.commit([Entry(0, h(0), 1)])
    log.commit([Entry(1, h(1), 2)])
    log.close()
    whole = path.read_bytes()
    assert len(whole) == len(MAGIC) + 2 * RECORD_BYTES
    for cut in range(len(whole) - RECORD_BYTES, len(whole)):
        path.write_bytes(whole[:cut])
        log = CommitLog(path, 4)
        assert state(log) == {0: (h(0), 1)}
        assert path.stat().st_size == len(MAGIC) + RECORD_BYTES  # truncated to the record boundary
        log.commit([Entry(2, h(2), 3)])  # appends start on a boundary
        log.close()
        assert state(CommitLog(path, 4)) == {0: (h(0), 1), 2: (h(2), 3)}


def test_a_corrupt_record_ends_the_replay_there(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 4)
    for i in range(3):
        log.commit([Entry(i, h(i), i)])
    log.close()
    data = bytearray(path.read_bytes())
    data[len(MAGIC) + RECORD_BYTES + 10] ^= 0xFF  # the second record
    path.write_bytes(bytes(data))
    assert state(CommitLog(path, 4)) == {0: (h(0), 0)}  # never a record that does not check


def test_compaction_keeps_the_state_and_bounds_the_file(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 4)
    for i in range(COMPACT_FACTOR * 4 * 3):
        log.commit([Entry(i % 4, h(i), i)])
    before = state(log)
    assert path.stat().st_size <= len(MAGIC) + (COMPACT_FACTOR * 4 + 1) * RECORD_BYTES
    log.close()
    assert state(CommitLog(path, 4)) == before
    assert not (tmp_path / "index.log.compact").exists()


def test_the_same_hash_committed_again_moves_to_its_new_slot(tmp_path):
    log = CommitLog(tmp_path / "index.log", 4)
    log.commit([Entry(0, h(7), 1)])
    log.commit([Entry(2, h(7), 2)])
    assert state(log) == {2: (h(7), 2)}
    log.close()
    assert state(CommitLog(tmp_path / "index.log", 4)) == {2: (h(7), 2)}


def test_least_recent_follows_use(tmp_path):
    log = CommitLog(tmp_path / "index.log", 4)
    log.commit([Entry(s, h(s), 0) for s in range(4)])
    log.touch([0, 2])
    assert log.least_recent(2) == [1, 3]
    assert log.least_recent(3, keep={1}) == [3, 0, 2]


def test_another_file_is_refused(tmp_path):
    path = tmp_path / "index.log"
    path.write_bytes(b"not a log at all, longer than the magic")
    with pytest.raises(ValueError, match="not a kvcopy disk-store log"):
        CommitLog(path, 4)


def test_bad_hashes_are_value_errors(tmp_path):
    log = CommitLog(tmp_path / "index.log", 4)
    with pytest.raises(ValueError, match="block_hashes: expected SHA-256 hex digests"):
        log.commit([Entry(0, "abcd", 0)])


WRITER = """
import hashlib, sys
from kvcopy.storage._commit_log import CommitLog, Entry
log = CommitLog(sys.argv[1], 64)
for i in range(100000):
    slot = i % 64
    log.free([slot])
    log.commit([Entry(slot, hashlib.sha256(str(i).encode()).hexdigest(), i)])
    print(i, flush=True)
"""


@pytest.mark.parametrize("delay_s", [0.05, 0.1, 0.2, 0.3, 0.5, 0.8])
def test_a_writer_killed_mid_append_leaves_every_reported_commit(tmp_path, delay_s):
    path = tmp_path / "index.log"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    first = child.stdout.readline()  # it has started appending (importing kvcopy takes a while)
    time.sleep(delay_s)
    os.kill(child.pid, signal.SIGKILL)
    reported = [int(first), *(int(line) for line in child.communicate()[0].split())]
    assert len(reported) > 1  # killed in the middle of its appends, not before them
    log = CommitLog(path, 64)  # never raises
    last = reported[-1] if reported else -1
    # the latest reported commit of every slot but the one the child was reusing (its FREE may be durable)
    for i in range(max(0, last - 62), last + 1):
        entry = log.get(h(i))
        assert entry is not None and entry.slot == i % 64 and entry.checksum == i
    for entry in log._by_slot.values():  # nothing it had not at least begun: one commit past the last reported
        assert entry.checksum <= last + 1
