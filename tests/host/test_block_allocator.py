"""BlockAllocator (standalone and as HostKVPool's allocate/free/num_free): order, errors, all-or-nothing, threads."""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
import pytest
import torch

import kvcopy

from helpers import HANG_TIMEOUT_S
from helpers.engines import run_threads

NUM_BLOCKS = 16


def _pool(num_blocks: int) -> kvcopy.HostKVPool:
    like = kvcopy.PagedKV.from_planes([torch.zeros(2, 3, dtype=torch.float16)])
    return kvcopy.HostKVPool(like, num_blocks, pin_memory=False)


# The same behaviour through both front ends: the standalone allocator and a pool's own methods.
FACTORIES = {
    "allocator": kvcopy.BlockAllocator,
    "pool": _pool,
}


@pytest.fixture(params=sorted(FACTORIES))
def make(request):
    return FACTORIES[request.param]


def _ids(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.tolist()]


# --------------------------------------------------------------------------- allocate


def test_allocate_returns_int64_ids_lowest_first(make):
    a = make(NUM_BLOCKS)
    assert a.num_free == NUM_BLOCKS
    first = a.allocate(3)
    assert isinstance(first, torch.Tensor)
    assert first.dtype == torch.int64
    assert first.dim() == 1
    assert first.device == torch.device("cpu")
    assert _ids(first) == [0, 1, 2]
    assert a.num_free == NUM_BLOCKS - 3
    assert _ids(a.allocate(2)) == [3, 4]
    a.free([1, 3])
    assert a.num_free == NUM_BLOCKS - 3
    # Freed ids come back lowest first, before never-used higher ones.
    assert _ids(a.allocate(3)) == [1, 3, 5]


def test_allocate_all_then_none_left(make):
    a = make(NUM_BLOCKS)
    assert _ids(a.allocate(NUM_BLOCKS)) == list(range(NUM_BLOCKS))
    assert a.num_free == 0
    with pytest.raises(ValueError):
        a.allocate(1)
    assert a.num_free == 0


def test_allocate_zero_is_empty(make):
    a = make(NUM_BLOCKS)
    empty = a.allocate(0)
    assert isinstance(empty, torch.Tensor)
    assert empty.dtype == torch.int64
    assert empty.shape == (0,)
    assert a.num_free == NUM_BLOCKS


def test_allocate_more_than_free_is_a_value_error_and_changes_nothing(make):
    a = make(NUM_BLOCKS)
    a.allocate(10)
    with pytest.raises(ValueError):
        a.allocate(7)
    assert a.num_free == 6
    assert _ids(a.allocate(6)) == list(range(10, 16))  # nothing was taken by the failed call


@pytest.mark.parametrize("n", [-1, 1.0, "2", None, True])
def test_allocate_bad_count(make, n):
    a = make(NUM_BLOCKS)
    with pytest.raises((ValueError, TypeError)):
        a.allocate(n)
    assert a.num_free == NUM_BLOCKS


# --------------------------------------------------------------------------- free


@pytest.mark.parametrize("kind", ["list", "tensor", "int32 tensor", "numpy"])
def test_free_accepts_id_sequences(make, kind):
    a = make(NUM_BLOCKS)
    ids = a.allocate(4)
    if kind == "list":
        a.free(_ids(ids))
    elif kind == "tensor":
        a.free(ids)
    elif kind == "int32 tensor":
        a.free(ids.to(torch.int32))
    else:
        a.free(ids.numpy())
    assert a.num_free == NUM_BLOCKS


def test_double_free_is_a_value_error(make):
    a = make(NUM_BLOCKS)
    ids = a.allocate(3)
    a.free(ids[:1])
    with pytest.raises(ValueError):
        a.free(ids[:1])
    assert a.num_free == NUM_BLOCKS - 2


def test_free_of_never_allocated_id_is_a_value_error(make):
    a = make(NUM_BLOCKS)
    a.allocate(2)
    with pytest.raises(ValueError):
        a.free([5])
    assert a.num_free == NUM_BLOCKS - 2


@pytest.mark.parametrize("foreign", [NUM_BLOCKS, NUM_BLOCKS + 100, -1])
def test_foreign_id_is_a_value_error(make, foreign):
    a = make(NUM_BLOCKS)
    a.allocate(NUM_BLOCKS)
    with pytest.raises(ValueError):
        a.free([foreign])
    assert a.num_free == 0


def test_repeated_id_in_one_free_is_a_value_error(make):
    a = make(NUM_BLOCKS)
    a.allocate(4)
    with pytest.raises(ValueError):
        a.free([2, 2])
    assert a.num_free == NUM_BLOCKS - 4
    a.free([2])  # still allocated: the failed call freed nothing
    assert a.num_free == NUM_BLOCKS - 3


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([0, 1, NUM_BLOCKS], id="foreign"),
        pytest.param([0, 1, 9], id="not-allocated"),
        pytest.param([0, 1, 0], id="repeated"),
    ],
)
def test_free_is_all_or_nothing(make, bad):
    a = make(NUM_BLOCKS)
    a.allocate(4)  # 0..3
    with pytest.raises(ValueError):
        a.free(bad)
    assert a.num_free == NUM_BLOCKS - 4
    # 0 and 1 are still allocated: the next allocation does not hand them out, and freeing them works.
    assert _ids(a.allocate(1)) == [4]
    a.free([0, 1])
    assert a.num_free == NUM_BLOCKS - 3
    assert _ids(a.allocate(2)) == [0, 1]


def test_free_empty_is_a_no_op(make):
    a = make(NUM_BLOCKS)
    a.allocate(2)
    a.free([])
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.num_free == NUM_BLOCKS - 2


@pytest.mark.parametrize("bad", [[0.0], ["1"], [[0, 1]], torch.zeros(2, 1, dtype=torch.int64), torch.zeros(1)])
def test_free_bad_id_types(make, bad):
    a = make(NUM_BLOCKS)
    a.allocate(2)
    with pytest.raises((ValueError, TypeError)):
        a.free(bad)
    assert a.num_free == NUM_BLOCKS - 2


def test_standalone_allocator_reports_its_size():
    a = kvcopy.BlockAllocator(7)
    assert a.num_blocks == 7
    assert a.num_free == 7


def test_pool_allocator_covers_the_pool():
    pool = _pool(5)
    assert pool.num_free == 5
    assert _ids(pool.allocate(5)) == list(range(5))
    with pytest.raises(ValueError):
        pool.allocate(1)
    with pytest.raises(ValueError):
        pool.free([5])


# --------------------------------------------------------------------------- threads


@pytest.fixture
def fast_switching():
    """Switch threads very often, so that unlocked read-modify-write sequences would interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.usefixtures("fast_switching")
def test_concurrent_allocate_and_free_are_consistent(make):
    num_threads, rounds, max_held = 4, 400, 12
    num_blocks = num_threads * max_held + 4  # never runs out, so every allocate must succeed
    a = make(num_blocks)
    owned: dict[int, int] = {}  # id -> thread that holds it
    owned_lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(num_threads)

    def worker(index: int) -> None:
        rng = random.Random(index)
        held: list[int] = []
        try:
            start.wait()
            for _ in range(rounds):
                if held and (len(held) >= max_held or rng.random() < 0.5):
                    rng.shuffle(held)
                    k = rng.randint(1, len(held))
                    give_back, held = held[:k], held[k:]
                    with owned_lock:
                        for i in give_back:
                            assert owned.pop(i) == index
                    a.free(give_back)
                else:
                    k = rng.randint(0, max_held - len(held))
                    got = _ids(a.allocate(k))
                    assert len(got) == k and len(set(got)) == k
                    with owned_lock:
                        for i in got:
                            assert i not in owned, f"block {i} handed out twice (held by thread {owned.get(i)})"
                            owned[i] = index
                    held += got
            with owned_lock:
                for i in held:
                    assert owned.pop(i) == index
            a.free(held)
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    run_threads(worker, num_threads)
    assert not errors, errors[0]
    assert not owned
    assert a.num_free == num_blocks
    # Every id came back exactly once: all can be allocated again, lowest first.
    assert _ids(a.allocate(num_blocks)) == list(range(num_blocks))
    assert a.num_free == 0


@pytest.mark.usefixtures("fast_switching")
def test_concurrent_double_free_is_caught_once(make):
    """Several threads free the same ids at once: exactly one wins per id, the others get ValueError."""
    num_threads = 4
    for _ in range(20):
        a = make(NUM_BLOCKS)
        ids = a.allocate(NUM_BLOCKS)
        results: list[str] = []
        lock = threading.Lock()
        start = threading.Barrier(num_threads)

        def worker(a=a, ids=ids, start=start, lock=lock, results=results) -> None:  # this round's, bound
            start.wait()
            try:
                a.free(ids)
                outcome = "freed"
            except ValueError:
                outcome = "refused"
            with lock:
                results.append(outcome)

        run_threads(lambda _: worker(), num_threads, timeout=HANG_TIMEOUT_S)
        assert sorted(results) == ["freed"] + ["refused"] * (num_threads - 1)
        assert a.num_free == NUM_BLOCKS
        assert np.array_equal(a.allocate(NUM_BLOCKS).numpy(), np.arange(NUM_BLOCKS))
