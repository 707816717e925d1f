"""The NIXL layer remote and storage share (kvcopy/nixl): NIXL imported only when an agent is made, with an
error naming the extra without it; what a cache registers with an agent (the memory under its planes, each
byte once)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="kvcopy.nixl needs the nixl extra (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy.remote import KVPeer

from helpers.remote import make_pool


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


def test_an_engine_cache_registers_the_memory_under_its_planes_once():
    from kvcopy.nixl.registration import registration_of

    # Two layers of one allocation with a gap between them; in each, K and V as its halves (their spans
    # touch) or interleaved per block (their spans overlap): one region per layer either way.
    memory = torch.zeros(3, 8, 2, 16, 64, dtype=torch.bfloat16)
    first, third = memory[0], memory[2]
    kv = kvcopy.PagedKV.from_planes([first[:, 0], first[:, 1], third[:, 0], third[:, 1]], planes_per_layer=2)
    registration = registration_of(kv)
    assert (registration.layout, registration.memory, registration.device_id) == ("paged", "DRAM", 0)
    assert registration.regions == (
        (first.data_ptr(), first.nbytes, 0, ""),
        (third.data_ptr(), third.nbytes, 0, ""),
    )
    halves = torch.zeros(2, 8, 16, 64, dtype=torch.bfloat16)
    assert registration_of(kvcopy.PagedKV.from_planes([halves[0], halves[1]])).regions == (
        (halves.data_ptr(), halves.nbytes, 0, ""),
    )
    pool = make_pool("bf16", 4, "page_first", seed=20)
    assert registration_of(pool).regions == ((pool.buffer.data_ptr(), pool.nbytes, 0, ""),)
    with pytest.raises(TypeError, match="pool: expected a HostKVPool or a PagedKV, got Tensor"):
        KVPeer(halves, "local-tensor")
