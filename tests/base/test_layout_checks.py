"""PagedKV's own arguments, planes that share memory, and layout_difference (issue #32)."""

from __future__ import annotations

import pytest
import torch

import kvcopy
from kvcopy.layout import layout_difference


@pytest.mark.parametrize(
    ("planes", "planes_per_layer", "error", "name"),
    [
        pytest.param(torch.zeros(4, 8), 1, TypeError, "planes", id="one-tensor"),  # its rows would be planes
        pytest.param("ab", 1, TypeError, "planes", id="str"),
        pytest.param(5, 1, TypeError, "planes", id="int"),
        pytest.param([torch.zeros(4, 8)], 1.0, TypeError, "planes_per_layer", id="ppl-float"),
        pytest.param([torch.zeros(4, 8)], True, TypeError, "planes_per_layer", id="ppl-bool"),
        pytest.param([torch.zeros(4, 8)], "1", TypeError, "planes_per_layer", id="ppl-str"),
        pytest.param([torch.zeros(4, 8)], 0, ValueError, "planes_per_layer", id="ppl-zero"),
        pytest.param([torch.zeros(4, 8)] * 3, 2, ValueError, "planes_per_layer", id="ppl-not-a-divisor"),
        pytest.param([torch.zeros(4, 2).to_sparse()], 1, TypeError, r"planes\[0\]", id="sparse"),
    ],
)
def test_paged_kv_arguments(planes, planes_per_layer, error, name):
    with pytest.raises(error, match=f"^{name}"):
        kvcopy.PagedKV(planes, planes_per_layer=planes_per_layer)


@pytest.mark.parametrize(("index", "error"), [("0", TypeError), (True, TypeError), (0.0, TypeError), (2, IndexError)])
def test_layer_index(index, error):
    kv = kvcopy.PagedKV.from_planes([torch.zeros(4, 8), torch.zeros(4, 8)])
    with pytest.raises(error, match=r"^layer"):
        kv.layer(index)


def test_planes_that_share_memory_are_refused():
    """A copy into a cache whose planes share bytes would write them twice, from two sources."""
    base = torch.zeros(10, 8)
    with pytest.raises(ValueError, match=r"^planes\[1\]: shares memory with planes\[0\]"):
        kvcopy.PagedKV.from_planes([base[0:5], base[1:6]])  # plane 1's block b is plane 0's block b + 1
    with pytest.raises(ValueError, match=r"^planes\[2\]: shares memory with planes\[0\]"):
        kvcopy.PagedKV.from_planes([base[0:4], base[5:9], base[0:4]])
    wide = torch.zeros(4, 16)
    with pytest.raises(ValueError, match=r"^planes\[1\]: shares memory with planes\[0\]"):  # different strides
        kvcopy.PagedKV.from_planes([wide[:, :8], wide.view(8, 8)[0:4]])
    # Interleaved planes that share no byte (FlashInfer's K and V, a page_first pool's planes) are fine.
    interleaved = torch.zeros(4, 2, 8)
    kvcopy.PagedKV.from_planes([interleaved[:, 0], interleaved[:, 1]])
    kvcopy.PagedKV.from_planes([base[0:5], base[5:10]])


def test_layout_difference_names_the_field():
    mine = {"layout": "page_first", "planes": [[30, "bfloat16"], [30, "bfloat16"]], "nbytes_per_block": 60}
    other = {"layout": "page_first", "planes": [[30, "bfloat16"], [30, "float16"]], "nbytes_per_block": 60}
    assert layout_difference(mine, mine) is None
    assert layout_difference(mine, other) == "planes[1][1]: expected 'bfloat16', got 'float16'"
    assert layout_difference({"a": [1, 2]}, {"a": (1, 2)}) is None  # JSON lists against tuples: the same
    assert layout_difference({"a": True}, {"a": 1}) == "a: expected True, got 1"
    assert layout_difference({"a": 1}, {"a": 1, "b": 2}) == "layout: expected no field 'b', got 2"
    assert layout_difference({"a": 1, "b": 2}, {"a": 1}) == "layout: expected a field 'b' (= 2), got none"
    assert layout_difference([1, 2], [1]) == "layout: expected 2 entries, got 1"
    assert layout_difference("page_first", "layer_first") == "layout: expected 'page_first', got 'layer_first'"
