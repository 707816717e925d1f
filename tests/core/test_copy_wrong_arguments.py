"""Every argument of copy_blocks, gather and scatter, wrong: a TypeError naming it for a wrong type, a ValueError
for a wrong value, an IndexError for ids out of range, and no byte of either side changed (issue #32, "a wrong
type is a TypeError everywhere"). One table, run through each entry point and each method that runs here."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import kvcopy

from helpers import CPU_METHODS
from helpers.copies import assert_same_bytes, fill_random_, make_layout, snapshot

NUM_BLOCKS = 6
GOOD_SRC_IDS, GOOD_DST_IDS = [0, 1], [2, 3]


@dataclass(frozen=True)
class Case:
    """One wrong call: what replaces the good argument(s), and the error it must raise."""

    changes: dict[str, Any]
    error: type[Exception]
    names: str  # the argument the message names, as copy_blocks calls it
    ids: tuple[Any, ...] = field(default=())  # wrong ids: for src_ids, or for (src_ids, dst_ids)
    # Where a method chosen by name cannot run for the pair at all, its own reason comes first (naming method).
    method_first: bool = False


def _ids(values) -> dict[str, Any]:
    return {"src_ids": values}


CASES: dict[str, Case] = {
    # method
    "method_int": Case({"method": 1}, TypeError, "method"),
    "method_none": Case({"method": None}, TypeError, "method"),
    "method_bytes": Case({"method": b"cpu"}, TypeError, "method"),
    "method_list": Case({"method": ["cpu"]}, TypeError, "method"),  # unhashable: no internal error either
    "method_unknown": Case({"method": "fastest"}, ValueError, "method"),
    # num_ctas
    "num_ctas_str": Case({"num_ctas": "4"}, TypeError, "num_ctas"),
    "num_ctas_bool": Case({"num_ctas": True}, TypeError, "num_ctas"),
    "num_ctas_float": Case({"num_ctas": 4.0}, TypeError, "num_ctas"),
    "num_ctas_list": Case({"num_ctas": [4]}, TypeError, "num_ctas"),
    "num_ctas_zero": Case({"num_ctas": 0}, ValueError, "num_ctas"),
    "num_ctas_negative": Case({"num_ctas": -3}, ValueError, "num_ctas"),
    "num_ctas_beyond_c_int": Case({"num_ctas": 2**31}, ValueError, "num_ctas"),
    # stream
    "stream_str": Case({"stream": "x"}, TypeError, "stream"),
    "stream_int": Case({"stream": 0}, TypeError, "stream"),
    # the caches
    "src_str": Case({"src": "x"}, TypeError, "src"),
    "src_none": Case({"src": None}, TypeError, "src"),
    "src_tensor": Case({"src": "a plane"}, TypeError, "src"),
    "dst_str": Case({"dst": "x"}, TypeError, "dst"),
    "dst_int": Case({"dst": 5}, TypeError, "dst"),
    "src_meta": Case({"src": "meta"}, ValueError, "src", method_first=True),
    "dst_other_layout": Case({"dst": "other layout"}, ValueError, "dst"),
    # ids: types
    "ids_float_list": Case({}, TypeError, "", ids=([0.0, 1.0],)),
    "ids_str_list": Case({}, TypeError, "", ids=(["0", "1"],)),
    "ids_bool_list": Case({}, TypeError, "", ids=([True, False],)),
    "ids_none": Case({}, TypeError, "", ids=(None,)),
    "ids_str": Case({}, TypeError, "", ids=("01",)),
    "ids_bytes": Case({}, TypeError, "", ids=(b"\x00\x01",)),
    "ids_set": Case({}, TypeError, "", ids=({0, 1},)),
    "ids_dict": Case({}, TypeError, "", ids=({0: 1, 1: 2},)),
    "ids_int": Case({}, TypeError, "", ids=(0,)),
    "ids_float_tensor": Case({}, TypeError, "", ids=(torch.tensor([0.0, 1.0]),)),
    "ids_bool_tensor": Case({}, TypeError, "", ids=(torch.tensor([True, False]),)),
    "ids_uint8_tensor": Case({}, TypeError, "", ids=(torch.tensor([0, 1], dtype=torch.uint8),)),
    "ids_sparse_tensor": Case({}, TypeError, "", ids=(torch.tensor([0, 1]).to_sparse(),)),
    "ids_float_numpy": Case({}, TypeError, "", ids=(np.array([0.0, 1.0]),)),
    "ids_object_numpy": Case({}, TypeError, "", ids=(np.array([0, 1], dtype=object),)),
    "ids_0d_tensors_in_list": Case({}, TypeError, "", ids=([torch.tensor(0), torch.tensor(1)],)),
    # ids: values
    "ids_nested_list": Case({}, ValueError, "", ids=([[0], [1]],)),
    "ids_2d_tensor": Case({}, ValueError, "", ids=(torch.tensor([[0, 1]]),)),
    "ids_0d_tensor": Case({}, ValueError, "", ids=(torch.tensor(0),)),
    "ids_0d_numpy": Case({}, ValueError, "", ids=(np.array(0),)),
    "ids_on_meta": Case({}, ValueError, "", ids=(torch.tensor([0, 1], device="meta"),)),
    "ids_length": Case({}, ValueError, "dst_ids", ids=([0, 1, 2], [2, 3])),
    "ids_repeated_dst": Case({}, ValueError, "dst_ids", ids=([0, 1], [3, 3])),
    # ids: range
    "ids_past_the_end": Case({}, IndexError, "", ids=([0, NUM_BLOCKS],)),
    "ids_negative": Case({}, IndexError, "", ids=([-1, 0],)),
    "ids_beyond_int64": Case({}, IndexError, "", ids=([0, 2**64],)),
    "ids_past_the_end_tensor": Case({}, IndexError, "", ids=(torch.tensor([0, NUM_BLOCKS]),)),
}

# The entry points, each called as copy_blocks(src, src_ids, dst, dst_ids, **kw), with its own argument names.
ENTRY_POINTS: dict[str, tuple[Callable, dict[str, str]]] = {
    "copy_blocks": (kvcopy.copy_blocks, {}),
    "gather": (kvcopy.gather, {"src": "kv", "src_ids": "block_ids", "dst": "host", "dst_ids": "host_ids"}),
    "scatter": (kvcopy.scatter, {"src": "host", "src_ids": "host_ids", "dst": "kv", "dst_ids": "block_ids"}),
}
# The sides where gather and scatter take a HostKVPool only (a meta cache there is the TypeError of any PagedKV).
POOL_SIDES = {("gather", "dst"), ("scatter", "src")}


@pytest.fixture
def caches(gen):
    kv = make_layout("vllm", NUM_BLOCKS, torch.bfloat16, gen)
    pool = kvcopy.HostKVPool(kv, NUM_BLOCKS, pin_memory=False)
    fill_random_(pool, gen)
    other = kvcopy.HostKVPool(make_layout("vllm", NUM_BLOCKS, torch.bfloat16, gen, head_dim=6), 4, pin_memory=False)
    meta = kvcopy.PagedKV.from_planes([p.to("meta") for p in kv.planes], planes_per_layer=2)
    return kv, pool, other, meta


def _argument(value: Any, kv, pool, other, meta, side: str) -> Any:
    """The stand-ins a table entry names, made from this test's caches."""
    if value == "a plane":
        return kv.planes[0]
    if value == "meta":
        return meta if side == "src" else pool
    if value == "other layout":
        return other if side == "dst" else kv
    return value


@pytest.mark.parametrize("method", [*CPU_METHODS, "auto"])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case_name", list(CASES))
def test_wrong_argument_is_refused_before_any_byte_moves(caches, entry, case_name, method):
    kv, pool, other, meta = caches
    case = CASES[case_name]
    call, names = ENTRY_POINTS[entry]
    src, dst = (kv, pool) if entry != "scatter" else (pool, kv)
    kwargs: dict[str, Any] = {"method": method}
    args = {"src": src, "src_ids": GOOD_SRC_IDS, "dst": dst, "dst_ids": GOOD_DST_IDS}
    for key, value in case.changes.items():
        if key not in args:
            kwargs[key] = value
            continue
        if (entry, key) in POOL_SIDES and value == "meta":
            pytest.skip(f"{entry} takes a HostKVPool as {names[key]}: a meta PagedKV is its TypeError, tested above")
        args[key] = _argument(value, kv, pool, other, meta, key)
    if len(case.ids) == 1:
        args["src_ids"] = case.ids[0]
    elif case.ids:
        args["src_ids"], args["dst_ids"] = case.ids
    named = case.names or "src_ids"
    if case.method_first and method in ("cpu", "triton"):  # host-only methods: a meta side is not the host
        named = "method"
    expected_name = names.get(named, named)  # as this entry point calls the argument
    watched = (kv, pool, other)
    before = [snapshot(c) for c in watched]
    with pytest.raises(case.error) as info:
        call(args["src"], args["src_ids"], args["dst"], args["dst_ids"], **kwargs)
    assert type(info.value) is case.error, f"{type(info.value).__name__}, not {case.error.__name__}: {info.value}"
    assert re.match(rf"{expected_name}\b", str(info.value)), f"{info.value!r} does not begin with {expected_name}"
    for cache, shot in zip(watched, before, strict=True):
        assert_same_bytes(snapshot(cache), shot)


def test_the_same_wrong_ids_on_the_destination_side(caches):
    """The id cases again, on dst_ids: named dst_ids, and nothing written."""
    kv, pool, _, _ = caches
    for name, case in CASES.items():
        if len(case.ids) != 1:
            continue
        before = snapshot(pool)
        with pytest.raises(case.error, match="dst_ids"):
            kvcopy.copy_blocks(kv, GOOD_SRC_IDS, pool, case.ids[0], method="cpu")
        assert_same_bytes(snapshot(pool), before), name


def test_a_pool_of_another_layout_says_what_differs(caches):
    """Not two layouts printed side by side: the plane, its block bytes, and what was expected."""
    kv, _, other, _ = caches
    with pytest.raises(ValueError) as info:
        kvcopy.gather(kv, [0], other, [1])
    expected_bytes, got_bytes = kv.plane_block_nbytes[0], other.paged.plane_block_nbytes[0]
    assert str(info.value) == f"host: plane 0 blocks are {got_bytes} bytes, expected {expected_bytes} like kv"
    with pytest.raises(ValueError) as info:
        kvcopy.TransferEngine(kv, other)
    assert str(info.value) == f"host: plane 0 blocks are {got_bytes} bytes, expected {expected_bytes} like kv"
    with pytest.raises(ValueError) as info:
        kvcopy.copy_blocks(kv, [0], other, [1])
    assert str(info.value) == f"dst: plane 0 blocks are {got_bytes} bytes, expected {expected_bytes} like src"
