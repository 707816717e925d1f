"""What torch.compile meets on the way to a CUDA copy, shown without a GPU.

Dynamo traces ``copy_blocks`` before anything runs, with fake tensors: the
capture query must not be asked inside the graph (it returns a Python bool,
and on a machine without a driver it cannot even run), and ids must be
staged for the GPU without pinning (fake tensors cannot be pinned).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from kvcopy import dispatch
from kvcopy.methods import staging

from helpers.copies import make_layout


def test_capture_query_is_not_traced(monkeypatch):
    kv = make_layout("vllm", 4, torch.bfloat16, torch.Generator().manual_seed(0), num_layers=1)
    monkeypatch.setattr(dispatch, "uses_cuda", lambda src, dst: True)  # a stand-in for a cache on a GPU

    def traced(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if dispatch.capturing(kv, kv) else x * 2

    out = torch.compile(traced, fullgraph=True, backend="eager")(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))  # chosen as outside a capture


def test_host_ids_are_staged_for_the_gpu_without_pinning_while_tracing():
    with FakeTensorMode(allow_non_fake_inputs=True):
        src_ids = torch.tensor([1, 2], dtype=torch.int64)
        dst_ids = torch.tensor([3, 4], dtype=torch.int64)
        with pytest.raises(AssertionError, match="pin_memory"):  # what fake tensors say to pinning
            src_ids.pin_memory()
        with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
            src_on, dst_on = staging.ids_on(src_ids, dst_ids, torch.device("cuda", 0))
    assert isinstance(src_on, FakeTensor) and src_on.device == torch.device("cuda", 0)
    assert dst_on.shape == (2,) and dst_on.device == torch.device("cuda", 0)


def test_pinned_ids_are_copied_before_the_asynchronous_copy(monkeypatch):
    """A caller's pinned ids are not handed to the asynchronous copy as they are: kvcopy stages its own."""
    staged: list[torch.Tensor] = []
    ids = torch.tensor([5, 6], dtype=torch.int64)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self is ids)  # a stand-in: "already pinned"
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: staged.append(self) or self)
    out = staging.staged(ids)
    assert staged and staged[0] is not ids and torch.equal(staged[0], ids)
    assert out is not ids
