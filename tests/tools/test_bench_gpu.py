"""The benchmark's GPU baselines copy exactly what they claim, and the GPU benchmark runs every row.

Every test here needs a CUDA GPU and is skipped without one.
"""

from __future__ import annotations

import pytest
import torch

import kvcopy
from kvcopy.tools.bench import BenchConfig, run_benchmarks
from kvcopy.tools.bench.baselines import DMA_BASELINES, dma_baseline, per_block_copy_loop, per_layer_index_loop

from helpers import gpu, requires_gpu
from helpers.copies import assert_same_bytes, dst_bytes, make_layout, reference_copy, snapshot

pytestmark = [gpu, requires_gpu]

SRC_IDS, DST_IDS = [0, 3, 4, 5, 9, 9], [7, 1, 2, 3, 0, 4]  # adjacent runs and a repeated source


def _sides(direction, layout, dtype, gen):
    kv = make_layout(layout, 10, dtype, gen, device="cuda")
    pool = kvcopy.HostKVPool(kv, 8)
    if direction == "d2h":
        return kv, torch.tensor(SRC_IDS), pool.paged, torch.tensor(DST_IDS)
    pool.buffer.view(torch.uint8).random_(generator=gen)
    return pool.paged, torch.tensor(DST_IDS), kv, torch.tensor([*SRC_IDS[:4], 6, 8])


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize(
    ("layout", "dtype"), [("vllm", torch.bfloat16), ("flashinfer", torch.float8_e4m3fn), ("mla", torch.float16)]
)
@pytest.mark.parametrize("baseline", [*DMA_BASELINES, "per-layer index loop", "per-block copy_ loop"])
def test_gpu_baselines_match_reference(baseline, layout, dtype, direction):
    src, src_ids, dst, dst_ids = _sides(direction, layout, dtype, torch.Generator().manual_seed(3))
    torch.cuda.synchronize()
    expected = reference_copy(src, src_ids, dst, dst_ids)
    src_before = snapshot(src)
    device = torch.device("cuda", torch.cuda.current_device())
    if baseline in DMA_BASELINES:
        dma_baseline(baseline, src, src_ids, dst, dst_ids, device)()
    elif baseline == "per-layer index loop":
        per_layer_index_loop(src, src_ids.to(src.device), dst, dst_ids.to(dst.device))
    else:
        per_block_copy_loop(src, src_ids.tolist(), dst, dst_ids.tolist())
    torch.cuda.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)
    assert_same_bytes(snapshot(src), src_before)


def test_gpu_benchmark_runs_every_method_and_baseline():
    config = BenchConfig.default("cuda", quick=True, workloads=("llama70b-tp4-16",), counts=(1, 8), block_tokens=(1,))
    rows = run_benchmarks(config)  # each row is checked against plain indexing before it is timed
    for direction in ("gather", "scatter"):
        methods = {r.method for r in rows if r.direction == direction and r.suite == "workloads"}
        assert {
            "contiguous copy (limit)",
            "kvcopy cuda",
            "kvcopy copy_engine",
            "kvcopy triton",
            *DMA_BASELINES,
            "per-layer index loop",
            "per-block copy_ loop",
        } <= methods
    assert all(r.median_s > 0 for r in rows)
