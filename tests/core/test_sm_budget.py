"""What a user can set and see of the GPU paths, checked on the CPU with stand-ins where a GPU would answer.

- ``num_ctas`` (copy_blocks and TransferEngine): validated, and passed to the kernels that use SMs.
- A GPU whose kernels cannot read registered host memory by its host address
  (cudaDevAttrCanUseHostPointerForRegisteredMem = 0) gets no SM-kernel method
  for host pairs, with a message saying why and what to use.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvcopy
from kvcopy import _ext, dispatch, methods
from kvcopy.methods import builtin, choice, cta_budget, pairs

from helpers.copies import make_layout


def _pair():
    gen = torch.Generator().manual_seed(0)
    kv = make_layout("vllm", 6, torch.bfloat16, gen, num_layers=1)
    return kv, kvcopy.HostKVPool(kv, 4, pin_memory=False)


@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError), ("4", TypeError)]
)
def test_bad_num_ctas_is_refused_before_copying(value, error):
    kv, pool = _pair()
    before = pool.buffer.clone()
    with pytest.raises(error, match="num_ctas"):
        kvcopy.copy_blocks(kv, [1], pool, [0], num_ctas=value)
    assert torch.equal(pool.buffer, before)
    with pytest.raises(error, match="num_ctas"):
        kvcopy.TransferEngine(kv, pool, num_ctas=value)


def test_num_ctas_reaches_the_kernel_launch(monkeypatch):
    """The budget goes to the SM kernel as given; None gives the host-memory default (4), or 0 (a full wave)
    for device-to-device copies. Checked at the boundary to the compiled code, which needs a GPU to run."""
    host = SimpleNamespace(device=torch.device("cpu"))
    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    assert cta_budget.cta_budget(gpu, host, None) == cta_budget.HOST_MEMORY_CTA_BUDGET
    assert cta_budget.cta_budget(gpu, gpu, None) == 0
    assert cta_budget.cta_budget(gpu, host, 24) == 24
    seen = []
    monkeypatch.setattr(
        dispatch, "run", lambda method, src, src_ids, dst, dst_ids, num_ctas=None: seen.append(num_ctas)
    )
    kv, pool = _pair()
    kvcopy.copy_blocks(kv, [1], pool, [0], num_ctas=8)
    with kvcopy.TransferEngine(kv, pool, num_ctas=12) as engine:
        engine.offload([2], [1]).wait()
    assert seen == [8, 12]


def test_without_host_pointer_reads_the_sm_kernels_are_not_offered(monkeypatch):
    host = SimpleNamespace(device=torch.device("cpu"), is_pinned=True, plane_block_nbytes=(4096,))
    gpu = SimpleNamespace(device=torch.device("cuda", 0), plane_block_nbytes=(4096,))
    for module in (builtin, pairs):  # a stand-in: a GPU and a pinned pool
        monkeypatch.setattr(module, "pair_problem", lambda src, dst: None)
    monkeypatch.setattr(choice, "as_paged", lambda kv, name: kv)  # the stand-ins are not PagedKVs
    monkeypatch.setattr(_ext, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(_ext, "triton_available", lambda: True)
    monkeypatch.setattr(_ext, "TRITON_INTERPRET", False)
    monkeypatch.setattr(_ext, "kernels_read_host_pointers", lambda device: True)
    assert methods.available_methods(host, gpu) == ["torch", "triton", "cuda", "copy_engine"]
    monkeypatch.setattr(_ext, "kernels_read_host_pointers", lambda device: False)  # the attribute is 0 here
    assert methods.available_methods(host, gpu) == ["torch", "copy_engine"]
    assert methods.available_methods(gpu, gpu) == ["torch", "triton", "cuda", "copy_engine"]  # no host side
    for method in ("cuda", "triton"):
        reason = methods.unavailable_reason(method, host, gpu)
        assert "cudaDevAttrCanUseHostPointerForRegisteredMem" in reason and "'copy_engine'" in reason
    # "auto" copies small plane-blocks with the copy engines there, not the slow torch loop.
    assert methods.choose_method(host, gpu, methods.available_methods(host, gpu), host_ids=True) == "copy_engine"
