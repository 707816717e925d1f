"""HostKVPool given wrong arguments: a TypeError for a wrong type (a truthy "no" is not True), a ValueError for a
wrong value, an IndexError for a block out of range; the pool and its allocator unchanged (issue #32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcopy


def _cache() -> kvcopy.PagedKV:
    return kvcopy.PagedKV.from_planes([torch.zeros(4, 8)])


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        pytest.param({"pin_memory": "no"}, TypeError, "pin_memory", id="pin-str"),
        pytest.param({"pin_memory": 0}, TypeError, "pin_memory", id="pin-int"),
        pytest.param({"layout": 1}, TypeError, "layout", id="layout-int"),
        pytest.param({"layout": None}, TypeError, "layout", id="layout-none"),
        pytest.param({"layout": "pages"}, ValueError, "layout", id="layout-unknown"),
        pytest.param({"num_blocks": 4.0}, TypeError, "num_blocks", id="blocks-float"),
        pytest.param({"num_blocks": 0}, ValueError, "num_blocks", id="blocks-zero"),
        pytest.param({"numa_node": "0"}, TypeError, "numa_node", id="numa-str"),
    ],
)
def test_pool_arguments(kwargs, error, name):
    with pytest.raises(error, match=f"^{name}"):
        kvcopy.HostKVPool(_cache(), **{"num_blocks": 4, "pin_memory": False, **kwargs})


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        pytest.param(5, TypeError, id="int"),
        pytest.param(None, TypeError, id="none"),
        pytest.param("01", TypeError, id="str"),
        pytest.param([0.5], TypeError, id="float"),
        pytest.param(np.array(0), ValueError, id="0-d-numpy"),
        pytest.param(torch.tensor([0], device="meta"), ValueError, id="meta"),
        pytest.param([0, 0], ValueError, id="repeat"),
        pytest.param([9], ValueError, id="foreign"),
        pytest.param([3], ValueError, id="not-allocated"),
    ],
)
def test_free_refuses_wrong_ids_and_frees_nothing(ids, error):
    pool = kvcopy.HostKVPool(_cache(), 4, pin_memory=False)
    pool.allocate(2)
    with pytest.raises(error, match=r"^ids"):
        pool.free(ids)
    assert pool.num_free == 2
    pool.free([0, 1])
    assert pool.num_free == 4


@pytest.mark.parametrize(
    ("block_id", "error"),
    [("0", TypeError), (True, TypeError), (1.0, TypeError), (None, TypeError), (-1, IndexError), (4, IndexError)],
)
def test_block_bytes_refuses_wrong_ids(block_id, error):
    pool = kvcopy.HostKVPool(_cache(), 4, pin_memory=False)
    with pytest.raises(error, match=r"^block_id"):
        pool.block_bytes(block_id)
    assert pool.block_bytes(np.int64(3)).numel() == pool.nbytes_per_block
