"""Paged block copies on the CPU, side by side with what a user would write instead.

Workloads (--workload), each into (gather) and out of (scatter) a page-first
host pool, with random or sequential block ids (--ids):
- llama8b-16 (shared/DESIGN.md §4, the default): 32 layers x K/V = 64 planes,
  16 tokens x 8 KV heads x 128 dims bf16 = 32 KiB per plane-block;
- llama70b-tp4-16: 80 layers x K/V, 2 KV heads per rank = 8 KiB plane-blocks;
- deepseek-v3-mla-64: 61 MLA layers, 64 tokens x 576 bf16 = 72 KiB;
- llama8b-fp8-16: fp8 K/V (16 KiB) plus their per-block fp32 scale planes.

Rows, all in one run: kvcopy's "cpu" and "torch" methods; a per-layer
index_select / index_copy_ loop; a per-block copy_ loop (vLLM's old
swap_blocks shape); and one contiguous copy_ of the same bytes (the limit).
Ratios are against those rows. A sweep of small calls gives the fixed cost
per call (alpha of t = alpha + bytes / beta, least squares).

    python benchmarks/bench_copy.py [--workload llama8b-16] [--ids random] [--blocks 256] [--repeats 7] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import platform
from collections.abc import Callable

import numpy as np
import torch

import kvcopy
from kvcopy.timing import Timing, measure

HEAD_DIM = 128
LLAMA8B_LAYERS, LLAMA70B_LAYERS, DEEPSEEK_LAYERS = 32, 80, 61
MLA_WIDTH = 512 + 64  # DeepSeek-V3: kv_lora_rank + qk_rope_head_dim


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def _vllm(layers: int, num_blocks: int, tokens: int, heads: int, dtype: torch.dtype) -> kvcopy.PagedKV:
    return kvcopy.PagedKV.from_vllm([_random((2, num_blocks, tokens, heads, HEAD_DIM), dtype) for _ in range(layers)])


def _fp8_with_scales(num_blocks: int) -> kvcopy.PagedKV:
    """Per layer: K and V in fp8, then a float32 scale per (token, head) for each: 4 planes."""
    planes = []
    for _ in range(LLAMA8B_LAYERS):
        planes += [_random((num_blocks, 16, 8, HEAD_DIM), torch.float8_e4m3fn) for _ in range(2)]
        planes += [torch.rand(num_blocks, 16, 8) for _ in range(2)]
    return kvcopy.PagedKV.from_planes(planes, planes_per_layer=4)


WORKLOADS: dict[str, Callable[[int], kvcopy.PagedKV]] = {
    "llama8b-16": lambda n: _vllm(LLAMA8B_LAYERS, n, 16, 8, torch.bfloat16),
    "llama70b-tp4-16": lambda n: _vllm(LLAMA70B_LAYERS, n, 16, 2, torch.bfloat16),
    "deepseek-v3-mla-64": lambda n: kvcopy.PagedKV.from_mla(
        [_random((n, 64, MLA_WIDTH), torch.bfloat16) for _ in range(DEEPSEEK_LAYERS)]
    ),
    "llama8b-fp8-16": _fp8_with_scales,
}


def make_cache(num_blocks: int) -> list[torch.Tensor]:
    """The llama8b-16 layers (vLLM layout), for callers that build their own PagedKV."""
    return [_random((2, num_blocks, 16, 8, HEAD_DIM), torch.bfloat16) for _ in range(LLAMA8B_LAYERS)]


def _words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer-word views of a plane pair: what a user copying fp8 (or any dtype) bitwise would index."""
    from kvcopy._torch_copy import word_views

    return word_views(src, dst)


def per_layer_loop(src: kvcopy.PagedKV, src_ids: torch.Tensor, dst: kvcopy.PagedKV, dst_ids: torch.Tensor) -> None:
    for s, d in zip(src.planes, dst.planes):
        s_words, d_words = _words(s, d)
        d_words.index_copy_(0, dst_ids, s_words.index_select(0, src_ids))


def per_block_loop(src: kvcopy.PagedKV, src_ids: list[int], dst: kvcopy.PagedKV, dst_ids: list[int]) -> None:
    pairs = [_words(s, d) for s, d in zip(src.planes, dst.planes)]
    for i, j in zip(src_ids, dst_ids):
        for s, d in pairs:
            d[j].copy_(s[i])


def check_output(name: str, fn: Callable[[], object], src: kvcopy.PagedKV, src_ids: torch.Tensor,
                 dst: kvcopy.PagedKV, dst_ids: torch.Tensor) -> None:
    """Clears the destination blocks, runs ``fn`` once and compares their bytes with plain indexing of the source."""
    for s, d in zip(src.planes, dst.planes):
        _words(s, d)[1][dst_ids] = 0
    fn()
    for p, (s, d) in enumerate(zip(src.planes, dst.planes)):
        s_words, d_words = _words(s, d)
        if not torch.equal(d_words[dst_ids], s_words[src_ids]):
            raise AssertionError(f"{name}: plane {p} differs from the reference")


def fixed_cost(repeats: int) -> tuple[float, float]:
    """alpha (s per call) of t = alpha + bytes / beta for "cpu" gathers of 1..16 blocks.

    Uses a cache with llama8b-16's 64 planes but one 128-dim token row per
    plane-block (256 B), so bytes are negligible and the intercept is the call's
    fixed cost: validation, dispatch, planning of 64 x n copies.
    """
    kv = kvcopy.PagedKV.from_vllm([torch.zeros(2, 64, 1, 1, HEAD_DIM, dtype=torch.bfloat16)
                                   for _ in range(LLAMA8B_LAYERS)])
    host = kvcopy.HostKVPool(kv, 16)
    sizes, times = [], []
    for n in (1, 2, 4, 8, 16):
        ids = list(range(0, 4 * n, 4))  # not adjacent: no coalescing
        t = measure(lambda ids=ids, n=n: kvcopy.gather(kv, ids, host, range(n), method="cpu"), repeats=repeats,
                    inner=200)
        sizes.append(n * kv.nbytes_per_block)
        times.append(t.median)
    slope, intercept = np.polyfit(sizes, times, 1)
    return float(intercept), times[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="llama8b-16")
    parser.add_argument("--ids", choices=("random", "sequential"), default="random",
                        help="random block ids, or one run of adjacent ids on both sides")
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved per call (default 256)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device_blocks = 4 * args.blocks
    kv = WORKLOADS[args.workload](device_blocks)
    host = kvcopy.HostKVPool(kv, args.blocks, layout="page_first")
    nbytes = args.blocks * kv.nbytes_per_block
    if args.ids == "random":
        block_ids, host_ids = torch.randperm(device_blocks)[: args.blocks], torch.randperm(args.blocks)
    else:
        block_ids, host_ids = torch.arange(args.blocks, 2 * args.blocks), torch.arange(args.blocks)
    contiguous_src = torch.empty(nbytes, dtype=torch.uint8).random_()
    contiguous_dst = torch.empty(nbytes, dtype=torch.uint8)

    rows: list[tuple[str, str, Timing]] = []

    def run(direction: str, name: str, fn: Callable[[], object]) -> None:
        rows.append((direction, name, measure(fn, repeats=args.repeats, warmup=2)))

    run("both", "contiguous copy_ (limit)", lambda: contiguous_dst.copy_(contiguous_src))
    for direction, (src, s_ids, dst, d_ids) in {
        "gather": (kv, block_ids, host.paged, host_ids),
        "scatter": (host.paged, host_ids, kv, block_ids),
    }.items():
        lists = (src, s_ids.tolist(), dst, d_ids.tolist())
        for name, fn in {
            "kvcopy cpu": lambda a=(src, s_ids, dst, d_ids): kvcopy.copy_blocks(*a, method="cpu"),
            "kvcopy torch": lambda a=(src, s_ids, dst, d_ids): kvcopy.copy_blocks(*a, method="torch"),
            "per-layer index loop": lambda a=(src, s_ids, dst, d_ids): per_layer_loop(*a),
            "per-block copy_ loop": lambda a=lists: per_block_loop(*a),
        }.items():
            check_output(f"{direction} {name}", fn, src, s_ids, dst, d_ids)  # every row copies what it claims
            run(direction, name, fn)

    limit = rows[0][2].gbps(nbytes)
    by_name = {(d, n): t for d, n, t in rows}
    print(f"{args.workload} on CPU: {args.blocks} {args.ids} blocks x {kv.num_planes} planes = {nbytes / 1e6:.0f} MB per call, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    header = f"{'direction':<8} {'method':<26} {'GB/s':>7} {'p20-p80':>13} {'x limit':>8} {'x layer loop':>12} {'x block loop':>12}"
    print(header)
    print("-" * len(header))
    table = []
    for direction, name, t in rows:
        gbps = t.gbps(nbytes)
        layer = by_name.get((direction, "per-layer index loop"))
        block = by_name.get((direction, "per-block copy_ loop"))
        ratios = (gbps / limit, layer.median / t.median if layer else float("nan"),
                  block.median / t.median if block else float("nan"))
        spread = f"{nbytes / t.p80 / 1e9:.1f}-{nbytes / t.p20 / 1e9:.1f}"
        print(f"{direction:<8} {name:<26} {gbps:7.1f} {spread:>13} {ratios[0]:8.2f} {ratios[1]:12.2f} {ratios[2]:12.2f}")
        table.append([direction, name, nbytes, t.median, t.p20, t.p80, gbps, *ratios])

    alpha, tiny_one_block = fixed_cost(args.repeats)
    one_block = measure(lambda: kvcopy.gather(kv, [5], host, [args.blocks - 1], method="cpu"), repeats=args.repeats,
                        inner=50)
    print(f"\nfixed cost per call (cpu, 64 planes, fit over 1-16 tiny blocks): alpha = {alpha * 1e6:.1f} us; "
          f"1-block call of 256 B plane-blocks = {tiny_one_block * 1e6:.1f} us; "
          f"1-block llama8b-16 call ({kv.nbytes_per_block // 1024} KiB) = {one_block.median * 1e6:.1f} us")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["direction", "method", "bytes", "median_s", "p20_s", "p80_s", "gbps",
                             "x_limit", "x_layer_loop", "x_block_loop"])
            writer.writerows(table)
            writer.writerow(["fixed_cost", "kvcopy cpu", 0, alpha, "", "", "", "", "", ""])


if __name__ == "__main__":
    main()
