"""kvcopy.remote: blocks between two processes over NIXL (UCX on loopback), bitwise equal to plain indexing
of the peer's pool; coalesced descriptors; refused layouts and contexts; bad ids before anything moves;
a peer that disappears ends in an exception, not a hang."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="kvcopy.remote needs the nixl extra (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy.remote import KVPeer, RemoteTransferError, RemoteTransferTimeout

from helpers import HANG_TIMEOUT_S, gpu, requires_gpu
from helpers.remote import make_pool, planes_of, remote_peer, storage_bytes

# Only a hang reaches it: a loopback transfer of a few MB takes milliseconds; a loaded CI machine, seconds.
WAIT_S = HANG_TIMEOUT_S


def _replica(kind, num_blocks, host_layout, seed, data=None):
    """The remote pool's contents, rebuilt here: the same seed gives the same bytes (or ``data`` given)."""
    pool = make_pool(kind, num_blocks, host_layout, seed)
    if data is not None:
        storage_bytes(pool).copy_(data)
    return pool


def _blocks(pool, ids):
    """Plain indexing: each plane's rows at ``ids``, as bytes."""
    index = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.int64)
    return [plane[index].contiguous().view(torch.uint8).flatten() for plane in planes_of(pool)]


def _assert_same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


@pytest.mark.slow
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "paged"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-scales"])
def test_read_and_write_are_bitwise_plain_indexing(kind, host_layout):
    """Host pools of both layouts, and engine caches (PagedKV, registered as the memory under their planes)."""
    with remote_peer(kind, 96, host_layout, seed=3) as remote:
        local = make_pool(kind, 64, host_layout, seed=4)
        with KVPeer(local, "local-rw") as peer:
            pool = peer.connect(remote.descriptor)
            assert remote.ask("connect", peer.descriptor()) == "connected"
            g = torch.Generator().manual_seed(5)
            remote_ids = torch.randperm(96, generator=g)[:20]
            local_ids = torch.randperm(64, generator=g)[:20]
            peer.read(pool, remote_ids, local_ids).wait(WAIT_S)
            _assert_same(_blocks(local, local_ids), _blocks(_replica(kind, 96, host_layout, 3), remote_ids))
            sequential = list(range(40, 56))  # a run of adjacent blocks on both sides
            peer.read(pool, sequential, sequential).wait(WAIT_S)
            _assert_same(_blocks(local, sequential), _blocks(_replica(kind, 96, host_layout, 3), sequential))
            # Write back: local blocks land in the remote pool, and nothing else there changes.
            targets = [90, 2, 57, 11]
            peer.write([0, 1, 2, 3], pool, targets).wait(WAIT_S)
            after = _replica(kind, 96, host_layout, 3, remote.pool_bytes())
            _assert_same(_blocks(after, targets), _blocks(local, [0, 1, 2, 3]))
            untouched = [i for i in range(96) if i not in targets]
            _assert_same(_blocks(after, untouched), _blocks(_replica(kind, 96, host_layout, 3), untouched))


@pytest.mark.slow
def test_adjacent_page_first_blocks_are_one_descriptor():
    with remote_peer("bf16", 96, "page_first", seed=6) as remote:
        local = make_pool("bf16", 96, "page_first", seed=7)
        with KVPeer(local, "local-coalesce") as peer:
            pool = peer.connect(remote.descriptor)
            remote.ask("connect", peer.descriptor())
            run = peer.read(pool, range(10, 74), range(20, 84))  # 64 adjacent blocks on both sides
            run.wait(WAIT_S)
            assert run.num_descriptors == 1 and run.nbytes == 64 * local.nbytes_per_block
            scattered = peer.read(pool, [1, 5, 9], [0, 2, 4])
            scattered.wait(WAIT_S)
            assert scattered.num_descriptors == 3
            _assert_same(_blocks(local, range(20, 84)), _blocks(_replica("bf16", 96, "page_first", 6), range(10, 74)))


@pytest.mark.slow
def test_every_transfer_handle_is_released_once_when_it_ends_even_when_dropped_unfinished():
    import gc

    with (
        remote_peer("bf16", 32, "page_first", seed=23) as remote,
        KVPeer(make_pool("bf16", 32, "page_first", seed=24), "local-release") as peer,
    ):
        pool = peer.connect(remote.descriptor)
        released = []
        release = peer._agent.release_xfer_handle
        peer._agent.release_xfer_handle = lambda handle: (released.append(handle), release(handle))
        finished = peer.read(pool, [0, 1], [2, 3])
        finished.wait(WAIT_S)
        assert len(released) == 1
        del finished
        dropped = peer.read(pool, list(range(32)), list(range(32)))  # never waited for
        del dropped
        gc.collect()  # the peer holds it until NIXL reports it ended: releasing it would not stop its writes
        deadline = time.monotonic() + WAIT_S
        while peer.quarantined() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.quarantined() == {}
        assert len(released) == 2 and released[0] is not released[1]
        peer.read(pool, [0], [0]).wait(WAIT_S)  # its blocks are free again
        assert len(released) == 3


@pytest.mark.slow
def test_blocks_of_an_unfinished_transfer_are_quarantined_until_it_ends():
    with (
        remote_peer("bf16", 64, "page_first", seed=31) as remote,
        KVPeer(make_pool("bf16", 64, "page_first", seed=32), "local-quarantine") as peer,
    ):
        pool = peer.connect(remote.descriptor)
        check = peer._agent.check_xfer_state
        held = [True]  # NIXL's answer held at "PROC" (a transfer still crossing a slow link) while set
        peer._agent.check_xfer_state = lambda handle: "PROC" if held[0] else check(handle)
        reading = peer.read(pool, list(range(8)), list(range(16, 24)))
        writing = peer.write(list(range(40, 48)), pool, list(range(48, 56)))
        with pytest.raises(RemoteTransferTimeout):
            reading.wait(0.01)
        assert peer.quarantined() == {"local": list(range(16, 24)), pool.agent: list(range(48, 56))}
        with pytest.raises(ValueError, match=r"local_ids: blocks \[20, 21\] are in use by an unfinished read"):
            peer.read(pool, [30, 31], [20, 21])
        with pytest.raises(ValueError, match=r"local_ids: blocks \[17\] are in use by an unfinished read"):
            peer.write([17], pool, [0])  # it would send a block the read is overwriting
        with pytest.raises(ValueError, match=r"remote_ids: blocks \[50\] are in use by an unfinished write"):
            peer.read(pool, [50], [60])
        with pytest.raises(ValueError, match=r"local_ids: blocks \[41\] are in use by an unfinished write"):
            peer.read(pool, [0], [41])  # it would overwrite a block the write is sending
        held[0] = False
        for transfer in (reading, writing):
            transfer.wait(WAIT_S)
        assert peer.quarantined() == {}
        peer.read(pool, [30, 31], [20, 21]).wait(WAIT_S)  # refused while held, free once ended
        _assert_same(_blocks(peer.pool, [20, 21]), _blocks(_replica("bf16", 64, "page_first", 31), [30, 31]))
        # What never clashes: two writes sending the same local block, two reads of the same remote one.
        both = [peer.write([40], pool, [1]), peer.write([40], pool, [2]), peer.read(pool, [5], [3]),
                peer.read(pool, [5], [4])]  # fmt: skip
        for transfer in both:
            transfer.wait(WAIT_S)
        _assert_same(_blocks(peer.pool, [3, 4]), _blocks(_replica("bf16", 64, "page_first", 31), [5, 5]))


@pytest.mark.slow
def test_connecting_again_returns_the_pool_or_replaces_a_restarted_peer():
    local = make_pool("bf16", 16, "page_first", seed=28)
    with KVPeer(local, "local-reconnect") as peer:
        with remote_peer("bf16", 16, "page_first", seed=29) as first:
            pool = peer.connect(first.descriptor)
            assert peer.connect(first.descriptor) is pool  # the same descriptor: the same pool
            peer.read(pool, [1], [1]).wait(WAIT_S)
        with remote_peer("bf16", 16, "page_first", seed=29) as restarted:  # the same agent name, a new process
            again = peer.connect(restarted.descriptor)
            assert again is not pool
            peer.read(again, [2, 3], [4, 5]).wait(WAIT_S)
            _assert_same(_blocks(local, [4, 5]), _blocks(_replica("bf16", 16, "page_first", 29), [2, 3]))
            with pytest.raises(ValueError, match="a later connect or reconnect to that agent replaced it"):
                peer.read(pool, [0], [0])
    with pytest.raises(ValueError, match="'local-reconnect' is closed"):
        peer.read(again, [0], [0])


@pytest.mark.slow
def test_after_a_failed_transfer_connect_or_reconnect_makes_the_connection_anew():
    local = make_pool("bf16", 16, "page_first", seed=33)
    with KVPeer(local, "local-broken") as peer, remote_peer("bf16", 16, "page_first", seed=34) as remote:
        pool = peer.connect(remote.descriptor)
        transfer = peer._agent.transfer
        peer._agent.transfer = lambda handle: (_ for _ in ()).throw(RuntimeError("NIXL_ERR_REMOTE_DISCONNECT"))
        with pytest.raises(RemoteTransferError, match="read failed to start") as failed:
            peer.read(pool, [1, 2], [3, 4])
        assert (failed.value.side, failed.value.block_ids) == ("local", [3, 4])
        peer._agent.transfer = transfer
        added = []
        add = peer._agent.add_remote_agent
        peer._agent.add_remote_agent = lambda metadata: (added.append(metadata), add(metadata))[1]
        again = peer.connect(remote.descriptor)  # the same descriptor, after a failure: made anew
        assert again is not pool and len(added) == 1
        assert peer.connect(remote.descriptor) is again  # and then the same pool again, as before the failure
        with pytest.raises(ValueError, match="a later connect or reconnect to that agent replaced it"):
            peer.read(pool, [0], [0])
        peer.read(again, [1, 2], [3, 4]).wait(WAIT_S)
        _assert_same(_blocks(local, [3, 4]), _blocks(_replica("bf16", 16, "page_first", 34), [1, 2]))
        fresh = peer.reconnect(again)  # one call, also without a failure
        assert fresh is not again and len(added) == 2
        peer.read(fresh, [5], [6]).wait(WAIT_S)
        _assert_same(_blocks(local, [6]), _blocks(_replica("bf16", 16, "page_first", 34), [5]))


@pytest.mark.slow
def test_mismatched_layouts_and_contexts_are_refused():
    """A refusal is made on the descriptor alone, before anything crosses: the refused peers are agents of this
    process, without NIXL's busy-polling progress thread (a process each cost seconds of the 2 cores, and no
    transfer ever starts to reach one)."""
    key = kvcopy.CacheKey(kvcopy.ModelSpec.preset("llama-3.1-8b"), weights_id="org/model@abc", block_tokens=16)
    other_key = kvcopy.CacheKey(kvcopy.ModelSpec.preset("llama-3.1-8b"), weights_id="org/model@other", block_tokens=16)
    with (
        KVPeer(make_pool("wide", 8, "page_first", seed=8), "remote-wide", progress_thread=False) as wide,
        KVPeer(make_pool("bf16", 8, "layer_first", seed=9), "remote-layer-first", progress_thread=False) as lf,
        KVPeer(make_pool("bf16", 8, "page_first", seed=10), "local-mismatch", cache_key=key) as peer,
    ):
        with pytest.raises(ValueError, match="laid out"):
            peer.connect(wide.descriptor())  # other plane-block bytes
        with pytest.raises(ValueError, match="laid out"):
            peer.connect(lf.descriptor())  # layer-first against page-first
    other_pool = make_pool("bf16", 8, "page_first", seed=11)
    with KVPeer(other_pool, "remote-other", cache_key=other_key, progress_thread=False) as other:
        with (
            KVPeer(make_pool("bf16", 8, "page_first", seed=12), "local-context", cache_key=key) as peer,
            pytest.raises(ValueError, match="CacheKey context"),
        ):
            peer.connect(other.descriptor())
        with (
            KVPeer(make_pool("bf16", 8, "page_first", seed=13), "local-nokey") as peer,
            pytest.raises(ValueError, match="CacheKey context"),
        ):
            peer.connect(other.descriptor())  # a keyed pool is not read by a peer without the key
    with pytest.raises(kvcopy.FileFormatError, match="remote_descriptor: header: expected a KVPeer descriptor"):
        KVPeer(make_pool("bf16", 8, "page_first", seed=14), "local-junk").connect(b"not a descriptor at all")


@pytest.mark.slow
def test_bad_ids_are_refused_before_anything_moves():
    with remote_peer("bf16", 16, "page_first", seed=15) as remote:
        local = make_pool("bf16", 8, "page_first", seed=16)
        before = local.buffer.clone()
        with KVPeer(local, "local-ids") as peer:
            pool = peer.connect(remote.descriptor)
            with pytest.raises(IndexError, match=r"remote_ids: expected ids in \[0, 16\), got 16"):
                peer.read(pool, [16], [0])
            with pytest.raises(IndexError, match=r"local_ids: expected ids in \[0, 8\), got -1"):
                peer.read(pool, [0], [-1])
            with pytest.raises(ValueError, match="local_ids: expected distinct destination ids"):
                peer.read(pool, [0, 1], [3, 3])
            with pytest.raises(ValueError, match="remote_ids: expected distinct destination ids"):
                peer.write([0, 1], pool, [5, 5])
            with pytest.raises(ValueError, match="as many ids"):
                peer.read(pool, [0, 1], [3])
            with pytest.raises(TypeError, match="int32 or int64"):
                peer.read(pool, torch.tensor([0.0]), [1])
        assert torch.equal(local.buffer, before)
        assert torch.equal(remote.pool_bytes(), _replica("bf16", 16, "page_first", 15).buffer)


@pytest.mark.slow
def test_a_peer_that_disappears_is_an_exception_within_the_timeout():
    with remote_peer("bf16", 64, "page_first", seed=17) as remote:
        local = make_pool("bf16", 64, "page_first", seed=18)
        with KVPeer(local, "local-kill") as peer:
            pool = peer.connect(remote.descriptor)
            remote.ask("connect", peer.descriptor())
            peer.read(pool, [0], [0]).wait(WAIT_S)  # connected and working
            remote.process.kill()
            remote.process.join(WAIT_S)
            started = time.monotonic()
            with pytest.raises((RemoteTransferError, RemoteTransferTimeout), match="local blocks") as failed:
                peer.read(pool, list(range(64)), list(range(64))).wait(timeout=10)
            assert time.monotonic() - started < WAIT_S
            assert (failed.value.side, failed.value.block_ids) == ("local", list(range(64)))  # what is not valid


# A transfer big enough to be in flight when its peer is killed: one 256 MiB range, about 0.1 s over loopback.
KILL_BLOCKS = 16384  # of the "wide" kind's 16 KiB blocks
# When the peer is killed, after the reads start: well inside the first one.
KILL_AFTER_S = 0.02


@pytest.mark.slow
def test_a_peer_killed_mid_transfer_is_an_exception_within_the_timeout():
    with remote_peer("wide", KILL_BLOCKS, "page_first", seed=25) as remote:
        local = make_pool("wide", KILL_BLOCKS, "page_first", seed=26)
        with KVPeer(local, "local-kill-mid") as peer:
            pool = peer.connect(remote.descriptor)
            whole = torch.arange(KILL_BLOCKS)
            peer.read(pool, whole, whole).wait(WAIT_S)  # connected and working
            killer = threading.Timer(KILL_AFTER_S, remote.process.kill)
            started = time.monotonic()
            killer.start()
            with pytest.raises((RemoteTransferError, RemoteTransferTimeout), match="local blocks") as failed:
                while time.monotonic() - started < WAIT_S:  # the kill lands in the first read unless the machine
                    peer.read(pool, whole, whole).wait(timeout=10)  # is slow; then in a later one
            killer.join()
            assert time.monotonic() - started < WAIT_S
            assert (failed.value.side, failed.value.block_ids) == ("local", whole.tolist())


@gpu
@requires_gpu
def test_gpu_caches_exchange_blocks_between_two_agents():
    """GPU memory registered as NIXL VRAM: blocks move GPU to GPU, bitwise."""
    from kvcopy.nixl.registration import registration_of

    def cache(seed: int) -> kvcopy.PagedKV:
        g = torch.Generator(device="cuda").manual_seed(seed)
        planes = [
            torch.randint(0, 256, (32, 16, 2, 64), dtype=torch.uint8, device="cuda", generator=g) for _ in range(4)
        ]
        return kvcopy.PagedKV.from_planes([p.view(torch.bfloat16) for p in planes], planes_per_layer=2)

    mine, theirs = cache(21), cache(22)
    assert registration_of(mine).memory == "VRAM"
    assert registration_of(mine).device_id == torch.cuda.current_device()
    with KVPeer(mine, "gpu-local") as local, KVPeer(theirs, "gpu-remote") as remote:
        pool = local.connect(remote.descriptor())
        local.read(pool, [5, 0, 31], [1, 2, 3]).wait(WAIT_S)
        local.write([7], pool, [9]).wait(WAIT_S)
        torch.cuda.synchronize()
        for a, b in zip(mine.planes, theirs.planes, strict=True):
            assert torch.equal(a[[1, 2, 3]], b[[5, 0, 31]]) and torch.equal(b[9], a[7])
