"""Paged block copies on the CPU, side by side with what a user would write instead.

Workload llama8b-16 (shared/DESIGN.md §4): 32 layers x K/V = 64 planes, blocks
of 16 tokens x 8 KV heads x 128 dims in bf16 = 32 KiB per plane-block, random
block ids, into (gather) and out of (scatter) a page-first host pool.

Rows, all in one run: kvcopy's "cpu" and "torch" methods; a per-layer
index_select / index_copy_ loop; a per-block copy_ loop (vLLM's old
swap_blocks shape); and one contiguous copy_ of the same bytes (the limit).
Ratios are against those rows. A sweep of small calls gives the fixed cost
per call (alpha of t = alpha + bytes / beta, least squares).

    python benchmarks/bench_copy.py [--blocks 256] [--repeats 7] [--csv out.csv]
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

LAYERS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 32, 16, 8, 128  # llama8b-16
DTYPE = torch.bfloat16


def make_cache(num_blocks: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    return [torch.randn(shape).to(DTYPE) for _ in range(LAYERS)]


def per_layer_loop(src: kvcopy.PagedKV, src_ids: torch.Tensor, dst: kvcopy.PagedKV, dst_ids: torch.Tensor) -> None:
    for s, d in zip(src.planes, dst.planes):
        d.index_copy_(0, dst_ids, s.index_select(0, src_ids))


def per_block_loop(src: kvcopy.PagedKV, src_ids: list[int], dst: kvcopy.PagedKV, dst_ids: list[int]) -> None:
    for i, j in zip(src_ids, dst_ids):
        for s, d in zip(src.planes, dst.planes):
            d[j].copy_(s[i])


def check_output(name: str, fn: Callable[[], object], src: kvcopy.PagedKV, src_ids: torch.Tensor,
                 dst: kvcopy.PagedKV, dst_ids: torch.Tensor) -> None:
    """Clears the destination blocks, runs ``fn`` once and compares them with plain indexing of the source."""
    for plane in dst.planes:
        plane[dst_ids] = 0
    fn()
    for p, (s, d) in enumerate(zip(src.planes, dst.planes)):
        if not torch.equal(d[dst_ids], s[src_ids]):
            raise AssertionError(f"{name}: plane {p} differs from the reference")


def fixed_cost(repeats: int) -> tuple[float, float]:
    """alpha (s per call) of t = alpha + bytes / beta for "cpu" gathers of 1..16 blocks.

    Uses a cache with llama8b-16's 64 planes but one 128-dim token row per
    plane-block (256 B), so bytes are negligible and the intercept is the call's
    fixed cost: validation, dispatch, planning of 64 x n copies.
    """
    kv = kvcopy.PagedKV.from_vllm([torch.zeros(2, 64, 1, 1, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS)])
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
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved per call (default 256: 537 MB)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device_blocks = 4 * args.blocks
    kv = kvcopy.PagedKV.from_vllm(make_cache(device_blocks))
    host = kvcopy.HostKVPool(kv, args.blocks, layout="page_first")
    nbytes = args.blocks * kv.nbytes_per_block
    block_ids = torch.randperm(device_blocks)[: args.blocks]
    host_ids = torch.randperm(args.blocks)
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
    print(f"llama8b-16 on CPU: {args.blocks} random blocks x {kv.num_planes} planes = {nbytes / 1e6:.0f} MB per call, "
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
