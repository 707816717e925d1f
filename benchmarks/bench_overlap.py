"""Copies beside compute: how much does an offload/reload stream slow "decode" down?

GPU: a bf16 GEMM loop on the compute stream stands in for decode. It runs
solo, then while a TransferEngine offloads and reloads llama8b-16 blocks
(64 planes x 32 KiB plane-blocks, random ids) with each method. Reported: the
GEMM's throughput as a fraction of solo, and the copies' GB/s against the
contiguous pinned-copy peak measured in the same run. Target (docs/measurements.md):
>= 98% of solo GEMM throughput while "copy_engine" moves >= 90% of peak.

CPU: the same question on the worker pool: a float32 matmul loop on the main
thread, solo and while the engine's workers copy; and the copies' GB/s solo
and beside the matmuls.

    python benchmarks/bench_overlap.py [--blocks 256] [--rounds 4] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import threading
import time

import torch

import kvcopy
from kvcopy.calibration.machine import machine_identity
from kvcopy.calibration.timing import measure
from kvcopy.tools.bench import IDENTITY_COLUMNS, WORKLOADS

GEMM_SIZE_GPU = 8192  # 8192^3 bf16: ~1.1 TFLOP per GEMM, milliseconds on an H100/H200
GEMM_SIZE_CPU = 512


def make_pair(num_blocks: int, host_blocks: int, device: str) -> tuple[kvcopy.PagedKV, kvcopy.HostKVPool]:
    """A llama8b-16 cache (kvcopy bench's workload) of random bytes, and a host pool for it."""
    kv = WORKLOADS["llama8b-16"].build(num_blocks, torch.device(device))
    return kv, kvcopy.HostKVPool(kv, host_blocks)


def transfer_rounds(engine: kvcopy.TransferEngine, blocks: int, rounds: int) -> list[kvcopy.Transfer]:
    """``rounds`` offloads and reloads over disjoint random blocks, all submitted at once."""
    device_ids = torch.randperm(engine.kv.num_blocks)
    transfers = []
    for r in range(rounds):
        out = device_ids[(2 * r) * blocks % engine.kv.num_blocks :][:blocks]
        back = device_ids[(2 * r + 1) * blocks % engine.kv.num_blocks :][:blocks]
        host_out = torch.arange(blocks)
        host_back = torch.arange(blocks, 2 * blocks)
        transfers.append(engine.offload(out, host_out))
        transfers.append(engine.reload(host_back, back))
    return transfers


def copy_gbps(transfers: list[kvcopy.Transfer]) -> float:
    """Bytes over busy seconds, per direction (each direction is one stream / worker), summed."""
    # Each transfer's own elapsed (the engine's stamps around its copy), not measure: the copies run beside compute.
    total = 0.0
    for direction in ("offload", "reload"):
        mine = [t for t in transfers if t.direction == direction]
        seconds = sum(t.elapsed or 0.0 for t in mine)
        total += sum(t.nbytes for t in mine) / seconds / 1e9 if seconds else 0.0
    return total / 2  # mean of the two directions


def run_gpu(args: argparse.Namespace) -> list[list[object]]:
    device = torch.device("cuda")
    kv, host = make_pair(4 * args.blocks, 2 * args.blocks, "cuda")
    nbytes = args.blocks * kv.nbytes_per_block
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = host.buffer[:nbytes]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        peak_d2h = measure(lambda: pinned.copy_(src, non_blocking=True), device=device).gbps(nbytes)
        peak_h2d = measure(lambda: src.copy_(pinned, non_blocking=True), device=device).gbps(nbytes)
    peak = (peak_d2h + peak_h2d) / 2

    a = torch.randn(GEMM_SIZE_GPU, GEMM_SIZE_GPU, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    flops = 2 * GEMM_SIZE_GPU**3

    def gemm_tflops(iters: int) -> float:
        """TFLOP/s of ``iters`` GEMMs on the current (compute) stream, timed with its events as one sample."""
        per_gemm = measure(lambda: torch.mm(a, b), warmup=0, repeats=1, inner=iters, device=device).median
        return flops / per_gemm / 1e12

    gemm_tflops(3)
    solo = gemm_tflops(args.gemm_iters)
    rows = [["gpu", "solo", f"{solo:.1f}", "1.000", "", f"{peak:.1f}", ""]]
    print(
        f"contiguous pinned peak {peak:.1f} GB/s (d2h {peak_d2h:.1f}, h2d {peak_h2d:.1f}); solo GEMM {solo:.1f} TFLOP/s"
    )
    for method in ("copy_engine", "cuda", "triton"):
        if method not in kvcopy.available_methods(kv, host):
            continue
        with kvcopy.TransferEngine(kv, host, method=method) as engine:
            for t in transfer_rounds(engine, args.blocks, 1):
                t.wait()
            # Copies first (they wait only for work already queued), then the GEMMs beside them.
            transfers = transfer_rounds(engine, args.blocks, args.rounds)
            beside = gemm_tflops(args.gemm_iters)
            for t in transfers:
                t.wait()
            gbps = copy_gbps(transfers)
        rows.append(
            ["gpu", method, f"{beside:.1f}", f"{beside / solo:.3f}", f"{gbps:.1f}", f"{peak:.1f}", f"{gbps / peak:.3f}"]
        )
        print(
            f"{method:<12} GEMM {beside:6.1f} TFLOP/s ({beside / solo:6.1%} of solo); copies {gbps:5.1f} GB/s "
            f"({gbps / peak:6.1%} of peak)"
        )
    return rows


def run_cpu(args: argparse.Namespace) -> list[list[object]]:
    kv, host = make_pair(4 * args.blocks, 2 * args.blocks, "cpu")
    a = torch.randn(GEMM_SIZE_CPU, GEMM_SIZE_CPU)
    b = torch.randn_like(a)
    flops = 2 * GEMM_SIZE_CPU**3

    def matmul_gflops(stop: threading.Event) -> float:
        # Not measure: matmuls until told to stop (1 s solo; beside copies, until they end), a rate over that span.
        done, began = 0, time.perf_counter()
        while not stop.is_set():
            torch.mm(a, b)
            done += 1
        return done * flops / (time.perf_counter() - began) / 1e9

    stop_solo = threading.Event()
    threading.Timer(1.0, stop_solo.set).start()
    solo = matmul_gflops(stop_solo)
    with kvcopy.TransferEngine(kv, host) as engine:
        for t in transfer_rounds(engine, args.blocks, 1):  # warm-up: first touches of the host pages
            t.wait()
        transfers = transfer_rounds(engine, args.blocks, args.rounds)
        for t in transfers:
            t.wait()
        copies_solo = copy_gbps(transfers)
        # The same copies again, with the matmul loop running on another thread meanwhile.
        stop, result = threading.Event(), {}
        compute = threading.Thread(target=lambda: result.setdefault("gflops", matmul_gflops(stop)))
        compute.start()
        transfers = transfer_rounds(engine, args.blocks, args.rounds)
        for t in transfers:
            t.wait()
        stop.set()
        compute.join()
        copies_beside = copy_gbps(transfers)
    beside = result["gflops"]
    print(
        f"CPU ({torch.get_num_threads()} threads): matmul solo {solo:.1f} GFLOP/s, beside copies {beside:.1f} "
        f"({beside / solo:.1%}); copies solo {copies_solo:.1f} GB/s, beside the matmuls {copies_beside:.1f} GB/s"
    )
    return [
        ["cpu", "solo", f"{solo:.1f}", "1.000", f"{copies_solo:.1f}", "", ""],
        ["cpu", "cpu", f"{beside:.1f}", f"{beside / solo:.3f}", f"{copies_beside:.1f}", "", ""],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=256, help="blocks per transfer (256: 537 MB)")
    parser.add_argument("--rounds", type=int, default=4, help="offload+reload pairs in flight at once")
    parser.add_argument("--gemm-iters", type=int, default=50)
    parser.add_argument("--csv")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = run_gpu(args) if device == "cuda" else run_cpu(args)
    if args.csv:
        identity = machine_identity(device)
        machine = [identity.get(key, "") for key in IDENTITY_COLUMNS]
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(
                [
                    "machine",
                    "method",
                    "compute_throughput",
                    "x_solo",
                    "copy_gbps",
                    "peak_gbps",
                    "x_peak",
                    *IDENTITY_COLUMNS,
                ]
            )
            writer.writerows(row + machine for row in rows)


if __name__ == "__main__":
    main()
