"""kvcopy.remote: blocks between two processes over NIXL (UCX on loopback), bitwise equal to plain indexing
of the peer's pool; coalesced descriptors; refused layouts and contexts; bad ids before anything moves;
a peer that disappears ends in an exception, not a hang."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="kvcopy.remote needs the nixl extra (pip install 'kvcopy[nixl]')")

import kvcopy  # noqa: E402
from kvcopy.remote import KVPeer, RemoteTransferError  # noqa: E402

from remote_helpers import make_pool, remote_peer  # noqa: E402

# Generous: a loopback transfer of a few MB takes milliseconds; a loaded CI machine may take seconds.
WAIT_S = 60


def _replica(kind, num_blocks, host_layout, seed, data=None):
    """The remote pool's contents, rebuilt here: the same seed gives the same bytes (or ``data`` given)."""
    pool = make_pool(kind, num_blocks, host_layout, seed)
    if data is not None:
        pool.buffer.copy_(data)
    return pool


def _blocks(pool, ids):
    """Plain indexing: each plane's rows at ``ids``, as bytes."""
    index = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.int64)
    return [plane[index].contiguous().view(torch.uint8).flatten() for plane in pool.paged.planes]


def _assert_same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-scales"])
def test_read_and_write_are_bitwise_plain_indexing(kind, host_layout):
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


def test_mismatched_layouts_and_contexts_are_refused():
    key = kvcopy.CacheKey(kvcopy.ModelSpec.preset("llama-3.1-8b"), weights_id="org/model@abc", block_tokens=16)
    with remote_peer("wide", 8, "page_first", seed=8) as wide, remote_peer("bf16", 8, "layer_first", seed=9) as lf:
        with KVPeer(make_pool("bf16", 8, "page_first", seed=10), "local-mismatch", cache_key=key) as peer:
            with pytest.raises(ValueError, match="laid out"):
                peer.connect(wide.descriptor)  # other plane-block bytes
            with pytest.raises(ValueError, match="laid out"):
                peer.connect(lf.descriptor)  # layer-first against page-first
    with remote_peer("bf16", 8, "page_first", seed=11, context="org/model@other") as other:
        with KVPeer(make_pool("bf16", 8, "page_first", seed=12), "local-context", cache_key=key) as peer:
            with pytest.raises(ValueError, match="CacheKey context"):
                peer.connect(other.descriptor)
        with KVPeer(make_pool("bf16", 8, "page_first", seed=13), "local-nokey") as peer:
            with pytest.raises(ValueError, match="CacheKey context"):
                peer.connect(other.descriptor)  # a keyed pool is not read by a peer without the key
    with pytest.raises(ValueError, match="not a KVPeer descriptor"):
        KVPeer(make_pool("bf16", 8, "page_first", seed=14), "local-junk").connect(b"not a descriptor at all")


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
            with pytest.raises((RemoteTransferError, TimeoutError), match="local blocks"):
                peer.read(pool, list(range(64)), list(range(64))).wait(timeout=10)
            assert time.monotonic() - started < WAIT_S


def test_without_nixl_the_error_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_nixl(name, *args, **kwargs):
        if name.startswith("nixl_cu13"):
            raise ImportError("No module named 'nixl_cu13'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    with pytest.raises(ImportError, match=r"kvcopy\[nixl\]"):
        KVPeer(make_pool("bf16", 4, "page_first", seed=19), "local-no-nixl")
