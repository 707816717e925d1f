"""torch.ops.kvcopy: schemas, registered kernels, opcheck, torch.compile tracing."""

from __future__ import annotations

import pytest
import torch

import kvcopy

from helpers.copies import (
    assert_same_bytes,
    byte_rows,
    dst_bytes,
    fill_random_,
    make_layout,
    random_tensor,
    reference_copy,
)

OPS = ("copy_blocks", "copy_blocks_dma")
ALL_OPS = (*OPS, "check_block_ids")


def _op(name):
    return getattr(torch.ops.kvcopy, name).default


def _op_args(name, src, src_ids, dst, dst_ids):
    args = (list(src), src_ids, list(dst), dst_ids)
    return (*args, 0) if name == "copy_blocks" else args


# --------------------------------------------------------------------------- registration


def test_ops_exist():
    assert kvcopy.build_info()["extension_loaded"], kvcopy.build_info()["extension_error"]
    for name in ALL_OPS:
        assert hasattr(torch.ops.kvcopy, name)


@pytest.mark.parametrize("name", ALL_OPS)
def test_cpu_kernels_registered(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvcopy::{name}", "CPU")


@pytest.mark.parametrize("name", OPS)
def test_cuda_kernels_registered_when_built(name):
    has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(f"kvcopy::{name}", "CUDA")
    assert has_cuda_kernel == kvcopy.build_info()["cuda_kernels"]


@pytest.mark.parametrize("name", OPS)
def test_schema_marks_dst_mutated(name):
    schema = _op(name)._schema
    args = {a.name: a for a in schema.arguments}
    expected = ["src", "src_ids", "dst", "dst_ids"] + (["num_ctas"] if name == "copy_blocks" else [])
    assert [a.name for a in schema.arguments] == expected
    assert args["dst"].alias_info is not None and args["dst"].alias_info.is_write
    for other in ("src", "src_ids", "dst_ids"):
        assert args[other].alias_info is None or not args[other].alias_info.is_write
    assert str(args["src"].type) == "List[Tensor]"
    assert str(args["dst"].type) == "List[Tensor]"
    assert str(args["src_ids"].type) == "Tensor"
    if name == "copy_blocks":
        assert str(args["num_ctas"].type) == "int"
    assert len(schema.returns) == 0


# --------------------------------------------------------------------------- calling the ops directly


def _planes_pair(gen):
    src = [
        random_tensor((6, 3, 5), torch.float32, gen),
        random_tensor((6, 4), torch.bfloat16, gen),
        random_tensor((6, 7), torch.float8_e4m3fn, gen),
    ]
    dst = [
        random_tensor((5, 3, 5), torch.float32, gen),
        random_tensor((5, 4), torch.bfloat16, gen),
        random_tensor((5, 7), torch.float8_e4m3fn, gen),
    ]
    return src, dst


@pytest.mark.parametrize("name", OPS)
def test_op_on_cpu_matches_reference(name, gen):
    src, dst = _planes_pair(gen)
    src_ids = torch.tensor([0, 2, 5, 5], dtype=torch.int64)
    dst_ids = torch.tensor([4, 0, 1, 3], dtype=torch.int64)
    expected = reference_copy(kvcopy.PagedKV.from_planes(src), src_ids, kvcopy.PagedKV.from_planes(dst), dst_ids)
    _op(name)(*_op_args(name, src, src_ids, dst, dst_ids))
    assert_same_bytes([byte_rows(p) for p in dst], expected)


@pytest.mark.parametrize("name", OPS)
def test_op_with_strided_planes(name, gen):
    src_kv = make_layout("flashinfer", 6, torch.float16, gen)
    dst_kv = make_layout("flashinfer", 6, torch.float16, gen)
    src_ids = torch.tensor([1, 2, 3, 0], dtype=torch.int64)
    dst_ids = torch.tensor([2, 3, 4, 5], dtype=torch.int64)
    expected = reference_copy(src_kv, src_ids, dst_kv, dst_ids)
    _op(name)(*_op_args(name, src_kv.planes, src_ids, dst_kv.planes, dst_ids))
    assert_same_bytes(dst_bytes(dst_kv), expected)


@pytest.mark.parametrize("name", OPS)
def test_op_rejects_non_int64_ids(name, gen):
    src, dst = _planes_pair(gen)
    before = [byte_rows(p).clone() for p in dst]
    for bad in (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([[0, 1]]), torch.tensor([0, 1, 2, 3])[::2]):
        with pytest.raises(RuntimeError):
            _op(name)(*_op_args(name, src, bad, dst, torch.tensor([2, 3])))
    with pytest.raises(ValueError, match=r"dst_ids: expected as many ids as src_ids \(2\), got 1"):
        _op(name)(*_op_args(name, src, torch.tensor([0, 1]), dst, torch.tensor([2])))
    assert_same_bytes([byte_rows(p) for p in dst], before)


# --------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("layout", ["planes", "flashinfer"])
def test_opcheck(name, layout, gen):
    src_kv = make_layout(layout, 6, torch.bfloat16, gen)
    dst_kv = make_layout(layout, 7, torch.bfloat16, gen)
    src_ids = torch.tensor([5, 0, 1, 1], dtype=torch.int64)
    dst_ids = torch.tensor([6, 2, 3, 0], dtype=torch.int64)
    args = _op_args(name, src_kv.planes, src_ids, dst_kv.planes, dst_ids)
    result = torch.library.opcheck(_op(name), args, raise_exception=False)
    failures = {test: outcome for test, outcome in result.items() if outcome != "SUCCESS"}
    assert not failures, failures


# --------------------------------------------------------------------------- torch.compile


def _compiled_case(gen, dst_kind):
    src = make_layout("vllm", 6, torch.bfloat16, gen)
    if dst_kind == "pool":
        dst = kvcopy.HostKVPool(src, 5, pin_memory=False)
        fill_random_(dst, gen)
    else:
        dst = make_layout("vllm", 5, torch.bfloat16, gen)
    return src, dst


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("method", ["cpu", "auto"])
@pytest.mark.parametrize("dst_kind", ["paged", "pool"])
def test_torch_compile_fullgraph(backend, method, dst_kind, gen):
    torch._dynamo.reset()
    src, dst = _compiled_case(gen, dst_kind)

    def copy(src_ids, dst_ids):
        kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method)

    compiled = torch.compile(copy, fullgraph=True, backend=backend)
    for src_ids, dst_ids in (([0, 2, 5, 5], [4, 0, 1, 3]), ([1, 3, 4], [2, 3, 0]), ([2, 3, 4, 5, 0], [0, 1, 2, 3, 4])):
        s = torch.tensor(src_ids, dtype=torch.int64)
        d = torch.tensor(dst_ids, dtype=torch.int64)
        expected = reference_copy(src, s, dst, d)
        compiled(s, d)
        assert_same_bytes(dst_bytes(dst), expected)


def _guarded_planes(num_blocks, spare, gen):
    """Planes that are the first num_blocks blocks of larger tensors, so an unchecked
    out-of-range id touches memory we own (and can inspect) rather than the heap."""
    bases = [random_tensor((num_blocks + spare, 3, 5), torch.bfloat16, gen) for _ in range(2)]
    return kvcopy.PagedKV.from_planes([b[:num_blocks] for b in bases]), bases


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "exc"),
    [
        ([0, 7], [1, 2], IndexError),  # src id past the end
        ([0, 1], [1, 6], IndexError),  # dst id past the end
        ([0, 1], [2, 2], ValueError),  # repeated destination
    ],
    ids=["src_out_of_range", "dst_out_of_range", "repeated_dst"],
)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_torch_compile_still_validates_ids(src_ids, dst_ids, exc, backend, gen):
    """Bad ids must not reach the kernels under torch.compile either (contract: error before any byte moves)."""
    torch._dynamo.reset()
    src, _ = _guarded_planes(4, 6, gen)
    dst, dst_bases = _guarded_planes(4, 6, gen)
    before = [b.clone() for b in dst_bases]

    def copy(s, d):
        kvcopy.copy_blocks(src, s, dst, d, method="cpu")

    compiled = torch.compile(copy, fullgraph=True, backend=backend)
    compiled(torch.tensor([0, 1]), torch.tensor([2, 3]))  # a valid call first
    before = [b.clone() for b in dst_bases]
    with pytest.raises(exc):
        compiled(torch.tensor(src_ids), torch.tensor(dst_ids))
    for b, e in zip(dst_bases, before, strict=True):
        assert torch.equal(byte_rows(b), byte_rows(e)), "dst (or memory past it) was written"


# --------------------------------------------------------------------------- check_block_ids


def _check_ids(src_ids, dst_ids, src_num_blocks=6, dst_num_blocks=7):
    return torch.ops.kvcopy.check_block_ids(
        torch.tensor(src_ids, dtype=torch.int64),
        torch.tensor(dst_ids, dtype=torch.int64),
        src_num_blocks,
        dst_num_blocks,
    )


def test_check_block_ids_schema():
    schema = _op("check_block_ids")._schema
    assert [a.name for a in schema.arguments] == [
        "src_ids",
        "dst_ids",
        "src_num_blocks",
        "dst_num_blocks",
        "same_cache",
    ]
    assert all(a.alias_info is None for a in schema.arguments)  # mutates nothing
    assert len(schema.returns) == 0


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [([], []), ([5], [6]), ([0, 5, 5, 1], [6, 0, 1, 3]), (list(range(6)), list(range(6, 0, -1)))],
    ids=["empty", "single", "repeated_src", "all"],
)
def test_check_block_ids_accepts_good_ids(src_ids, dst_ids):
    s = torch.tensor(src_ids, dtype=torch.int64)
    d = torch.tensor(dst_ids, dtype=torch.int64)
    s_before, d_before = s.clone(), d.clone()
    assert torch.ops.kvcopy.check_block_ids(s, d, 6, 7) is None
    assert torch.equal(s, s_before) and torch.equal(d, d_before)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "exc", "match"),
    [
        ([0, 6], [1, 2], IndexError, "src_ids"),
        ([-1, 0], [1, 2], IndexError, "src_ids"),
        ([0, 1], [1, 7], IndexError, "dst_ids"),
        ([0, 1], [-3, 2], IndexError, "dst_ids"),
        ([0, 1], [2, 2], ValueError, "dst_ids"),
        ([0, 1, 2, 3], [6, 0, 5, 0], ValueError, "dst_ids"),
        ([0, 2**62], [0, 1], IndexError, "src_ids"),
    ],
    ids=["src_past_end", "src_negative", "dst_past_end", "dst_negative", "repeated_dst", "repeat_far_apart", "huge"],
)
def test_check_block_ids_rejects(src_ids, dst_ids, exc, match):
    with pytest.raises(exc, match=match):
        _check_ids(src_ids, dst_ids)


def test_check_block_ids_rejects_bad_id_tensors():
    good = torch.tensor([0, 1], dtype=torch.int64)
    for bad in (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([[0, 1]]), torch.tensor([0, 9, 1, 9])[::2]):
        with pytest.raises(RuntimeError):
            torch.ops.kvcopy.check_block_ids(bad, good, 6, 7)
        with pytest.raises(RuntimeError):
            torch.ops.kvcopy.check_block_ids(good, bad, 6, 7)
    with pytest.raises(ValueError, match="as many ids"):
        torch.ops.kvcopy.check_block_ids(good, torch.tensor([2]), 6, 7)


def test_check_block_ids_opcheck():
    args = (torch.tensor([5, 0, 1, 1]), torch.tensor([6, 2, 3, 0]), 6, 7)
    result = torch.library.opcheck(_op("check_block_ids"), args, raise_exception=False)
    failures = {test: outcome for test, outcome in result.items() if outcome != "SUCCESS"}
    assert not failures, failures


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_check_block_ids_survives_compile(backend):
    """The op returns nothing and mutates nothing: compiled graphs must keep it (registered side-effectful)."""
    torch._dynamo.reset()

    def check(s, d):
        torch.ops.kvcopy.check_block_ids(s, d, 6, 7)

    compiled = torch.compile(check, fullgraph=True, backend=backend)
    compiled(torch.tensor([0, 1]), torch.tensor([2, 3]))
    with pytest.raises(IndexError, match="src_ids"):
        compiled(torch.tensor([0, 6]), torch.tensor([2, 3]))
    with pytest.raises(IndexError, match="dst_ids"):
        compiled(torch.tensor([0, 1]), torch.tensor([2, 7]))
    with pytest.raises(ValueError, match="dst_ids"):
        compiled(torch.tensor([0, 1]), torch.tensor([3, 3]))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("method", ["cpu", "auto"])
def test_torch_compile_validates_ids_against_pools(backend, method, gen):
    """Compiled copies into a host pool (planes aliasing one buffer) still check ids before writing."""
    torch._dynamo.reset()
    src, dst = _compiled_case(gen, "pool")

    def copy(s, d):
        kvcopy.copy_blocks(src, s, dst, d, method=method)

    compiled = torch.compile(copy, fullgraph=True, backend=backend)
    s, d = torch.tensor([0, 5, 1]), torch.tensor([4, 0, 1])
    expected = reference_copy(src, s, dst, d)
    compiled(s, d)
    assert_same_bytes(dst_bytes(dst), expected)
    before = dst.buffer.clone()
    for bad_src, bad_dst, exc in (
        ([0, 6], [1, 2], IndexError),
        ([0, 1], [1, 5], IndexError),
        ([0, 1], [3, 3], ValueError),
    ):
        with pytest.raises(exc):
            compiled(torch.tensor(bad_src), torch.tensor(bad_dst))
        assert torch.equal(dst.buffer, before)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_rejects_same_cache_overlap(backend, gen):
    """README: under torch.compile the ops check host ids "with the same errors" as eager, which
    include the same-cache rule (no block both read and written)."""
    torch._dynamo.reset()
    kv = make_layout("vllm", 6, torch.bfloat16, gen)

    def copy(s, d):
        kvcopy.copy_blocks(kv, s, kv, d, method="cpu")

    compiled = torch.compile(copy, fullgraph=True, backend=backend)
    s, d = torch.tensor([0, 1]), torch.tensor([4, 5])
    expected = reference_copy(kv, s, kv, d)
    compiled(s, d)  # disjoint: fine
    assert_same_bytes(dst_bytes(kv), expected)
    before = dst_bytes(kv)
    with pytest.raises(ValueError, match="dst_ids"):
        compiled(torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert_same_bytes(dst_bytes(kv), before)
