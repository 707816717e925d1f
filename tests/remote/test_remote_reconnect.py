"""kvcopy.remote's quarantine across reconnects, against a fake NIXL agent whose network the test drives
(tests/helpers/fake_nixl.py): a block is let go only when its bytes can no longer change. A reconnect (or a
connect made anew) never makes NIXL forget a transfer still in flight; one that fails keeps the pool for a
retry and says "unreachable"; NIXL's own exceptions never escape a read; connect() reaps first."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from kvcopy.remote import KVPeer, RemoteTransferError, RemoteTransferTimeout

from helpers.fake_nixl import install, nixlBackendError
from helpers.remote import make_pool

BLOCKS = 16


def _block(pool, i: int) -> torch.Tensor:
    """Page-first block ``i`` of ``pool``: one contiguous run of its buffer."""
    size = pool.nbytes_per_block
    return pool.buffer[i * size : (i + 1) * size]


@pytest.fixture
def network(monkeypatch):
    return install(monkeypatch)


@pytest.fixture
def pair(network):
    """("reader", "holder") peers on the fake network, the reader connected to the holder: (peer, pool)."""
    with (
        KVPeer(make_pool("bf16", BLOCKS, "page_first", seed=1), "reader") as reader,
        KVPeer(make_pool("bf16", BLOCKS, "page_first", seed=2), "holder") as holder,
    ):
        yield reader, holder, reader.connect(holder.descriptor())


def _drop_a_read(reader, pool, local: list[int]) -> None:
    """A read of the holder's blocks 0.. into ``local`` that times out and is dropped by its caller."""
    transfer = reader.read(pool, list(range(len(local))), local)
    with pytest.raises(RemoteTransferTimeout):
        transfer.wait(0)
    del transfer


def test_reconnect_never_frees_blocks_a_dropped_read_still_writes(network, pair):
    """The issue's run: a dropped read, a reconnect at once and again (link still down), reuse of only what
    quarantined() releases, and the old read landing after. Every reused block keeps what the user wrote."""
    reader, _holder, pool = pair
    local = list(range(4, 12))
    _drop_a_read(reader, pool, local)
    for _ in range(2):
        with contextlib.suppress(ValueError):  # refused while the read is in flight (asserted below)
            pool = reader.reconnect(pool)
    free = [i for i in local if i not in reader.quarantined().get("local", [])]
    pattern = torch.full_like(_block(reader.pool, 0), 0xA5)
    for i in free:
        _block(reader.pool, i).copy_(pattern)
    assert network.land() == 1  # the old read arrives, as UCX's did once the link was back
    for i in free:
        assert torch.equal(_block(reader.pool, i), pattern), f"reused block {i} was overwritten by the old read"


def test_reconnect_is_refused_while_a_transfer_to_the_peer_is_unfinished_and_changes_nothing(network, pair):
    reader, holder, pool = pair
    local = list(range(4, 12))
    _drop_a_read(reader, pool, local)
    with pytest.raises(ValueError, match=r"agent 'holder' cannot be made anew while transfers to it are unfinished"):
        reader.reconnect(pool)
    initialize = reader._agent.initialize_xfer
    reader._agent.initialize_xfer = lambda *args: (_ for _ in ()).throw(nixlBackendError("NIXL_ERR_BACKEND"))
    with pytest.raises(RemoteTransferError, match="failed to start"):
        reader.read(pool, [13], [13])  # the connection broke: connect with the same descriptor makes it anew ...
    reader._agent.initialize_xfer = initialize
    with pytest.raises(ValueError, match=r"\{'local': \[4, 5, 6, 7, 8, 9, 10, 11\]\}"):
        reader.connect(holder.descriptor())  # ... and is refused likewise
    assert reader.quarantined() == {"local": local}
    assert reader.read(pool, [0], [0]) is not None  # the pool is still this peer's, its connection intact
    network.land()
    assert reader.quarantined() == {}  # NIXL reported the dropped read done: its blocks are free
    for i, block in zip(local, range(len(local)), strict=True):
        assert torch.equal(_block(reader.pool, i), _block(holder.pool, block))
    again = reader.reconnect(pool)
    assert again is not pool
    reader.read(again, [13], [14])
    network.land()
    assert torch.equal(_block(reader.pool, 14), _block(holder.pool, 13))


def test_a_transfer_nixl_lost_keeps_its_blocks_and_fails_every_wait(network, pair):
    """NIXL's agent removed under a transfer (not by kvcopy): NIXL answers NOT_FOUND, which is no end."""
    reader, _holder, pool = pair
    transfer = reader.read(pool, [0, 1], [2, 3])
    reader._agent.remove_remote_agent("holder")  # NIXL dropped it
    for _ in range(2):
        with pytest.raises(RemoteTransferError, match="NIXL lost track of it") as lost:
            transfer.wait(1)
        assert not isinstance(lost.value, RemoteTransferTimeout)
        with pytest.raises(RemoteTransferError, match="NIXL lost track of it"):
            transfer.done()
    assert reader.quarantined() == {"local": [2, 3]}
    assert not transfer._agent.released  # its handle is not released while it may still run
    fresh = reader.reconnect(pool)  # a lost transfer does not hold the reconnect back ...
    assert reader.quarantined() == {"local": [2, 3]}  # ... nor is it let go by it
    with pytest.raises(ValueError, match=r"local_ids: blocks \[3\] are in use by an unfinished read"):
        reader.read(fresh, [5], [3])


def test_a_failed_reconnect_says_unreachable_and_can_be_retried(network, pair):
    reader, holder, pool = pair
    network.unreachable.add("holder")
    with pytest.raises(ConnectionError, match="agent 'holder' is unreachable") as failed:
        reader.reconnect(pool)
    assert "garbled" not in str(failed.value) and "nixl" not in type(failed.value).__module__
    with pytest.raises(ConnectionError, match="unreachable"):
        reader.reconnect(pool)  # the old pool is still this peer's: retried, not "not this peer's to use"
    with pytest.raises(RemoteTransferError, match="read failed to start"):
        reader.read(pool, [0], [0])  # NIXL has no agent for it meanwhile: a clear error, nothing posted
    network.unreachable.clear()
    again = reader.reconnect(pool)
    reader.read(again, [7], [8])
    network.land()
    assert torch.equal(_block(reader.pool, 8), _block(holder.pool, 7))
    assert reader.connect(holder.descriptor()) is again


def test_connect_after_a_failed_reconnect_is_made_anew(network, pair):
    reader, holder, pool = pair
    network.unreachable.add("holder")
    with pytest.raises(ConnectionError):
        reader.reconnect(pool)
    network.unreachable.clear()
    again = reader.connect(holder.descriptor())
    assert again is not pool
    reader.read(again, [1], [2])
    network.land()
    assert torch.equal(_block(reader.pool, 2), _block(holder.pool, 1))


def test_initialize_xfer_errors_are_remote_transfer_errors_and_connect_makes_the_pool_anew(network, pair):
    reader, holder, pool = pair
    reader._agent.remotes.clear()  # NIXL dropped the agent: initialize_xfer raises NIXL's NOT_FOUND
    before = reader.pool.buffer.clone()
    with pytest.raises(RemoteTransferError, match=r"read failed to start \(nixlNotFoundError") as failed:
        reader.read(pool, [0, 1], [2, 3])
    assert (failed.value.side, failed.value.block_ids) == ("local", [2, 3])
    assert reader.quarantined() == {} and not network.xfers
    assert torch.equal(reader.pool.buffer, before)
    again = reader.connect(holder.descriptor())  # the same descriptor after a failure: made anew
    assert again is not pool
    reader.read(again, [0], [2])
    network.land()
    assert torch.equal(_block(reader.pool, 2), _block(holder.pool, 0))


def test_connect_reaps_a_transfer_that_started_and_failed_first(network, pair):
    reader, holder, pool = pair
    transfer = reader.read(pool, [0, 1], [2, 3])
    network.fail()  # NIXL reports it failed: the connection it used is broken
    with pytest.raises(RemoteTransferError, match="read failed"):
        transfer.wait(1)
    again = reader.connect(holder.descriptor())
    assert again is not pool  # made anew, not the broken pool returned
    assert reader.quarantined() == {}


@pytest.mark.parametrize(
    ("timeout", "error"),
    [(-1, ValueError), (math.nan, ValueError), (math.inf, ValueError), ("x", TypeError), (True, TypeError)],
)
def test_a_wait_with_a_wrong_timeout_changes_nothing(network, pair, timeout, error):
    reader, holder, pool = pair
    transfer = reader.read(pool, [0, 1], [2, 3])
    with pytest.raises(error, match="timeout: expected a finite number >= 0"):
        transfer.wait(timeout)
    assert reader.quarantined() == {"local": [2, 3]}  # still in flight, still held
    network.land()
    transfer.wait(1)
    assert transfer.done()
    assert torch.equal(_block(reader.pool, 2), _block(holder.pool, 0))


def test_a_failed_transfer_raises_on_every_later_wait_and_done(network, pair):
    reader, _holder, pool = pair
    transfer = reader.read(pool, [0], [1])
    network.fail()
    for _ in range(3):
        with pytest.raises(RemoteTransferError, match="read failed"):
            transfer.wait()
        with pytest.raises(RemoteTransferError, match="read failed"):
            transfer.done()
        with pytest.raises(TypeError):
            transfer.wait("x")  # an argument error, and the failure is still there after it
