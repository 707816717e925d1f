"""Reload / layer-wise / split / recompute for large models on an H200-like machine, from PUBLISHED figures,
and fetch-or-recompute when the prefix is held by another node over a published network link.

Nothing here is measured: the profile below is built from public numbers for
an H200 behind PCIe Gen5 (sources in the constants' comments), so that the
Planner's decisions for models this project's machines cannot run can be read
and checked. Replace it with `kvcopy calibrate`'s profile on the real machine.

    python benchmarks/decision_table.py [--out results/decisions_h200_published.md]
"""

from __future__ import annotations

import argparse
import sys

import kvcopy
from kvcopy.profile import REMOTE_DIRECTION, CostLine, MethodProfile, PrefillProfile, Profile

# PCIe Gen5 x16, pinned host memory, per direction: 50-57 GB/s achieved (H100/H200).
DMA_BYTES_PER_S = 55e9
# One batched copy-engine submission: a few microseconds per call (cudaMemcpyAsync 2-7 us).
DMA_ALPHA_S = 10e-6
# An SM kernel pulling from host memory over PCIe: about 35 GB/s on an H100; one launch, 2-5 us.
SM_BYTES_PER_S = 35e9
SM_ALPHA_S = 4e-6
# bf16 dense peak about 990 TFLOP/s; prefill sustains 40-60% of it.
PREFILL_FLOPS_PER_S = 0.5 * 990e12
# HBM3e 4.8 TB/s; a forward streams its weights at about 80% of it.
WEIGHT_BYTES_PER_S = 0.8 * 4.8e12
# The fixed cost of one layer's forward (kernel launches without CUDA graphs).
PREFILL_ALPHA_PER_LAYER_S = 20e-6

# Links to a peer holding the prefix (a NIXL read per fetch, RDMA underneath): one 400 Gb/s InfiniBand NDR port
# per GPU (ConnectX-7) moves about 45 GB/s of RDMA reads; 100 Gb/s Ethernet (RoCE) about 11.5 GB/s. A read's
# fixed cost: descriptor preparation and posting in NIXL plus an RDMA round trip, some tens of microseconds.
NETWORKS = {"400G IB": (30e-6, 45e9), "100G Ethernet": (30e-6, 11.5e9)}

MODELS = [("llama-3.1-8b", 1), ("llama-3.1-70b", 4), ("llama-3.1-70b", 8), ("deepseek-v3", 8)]
PREFIXES = (128, 1024, 4096, 16384, 65536)
NEW_TOKENS = 64


def _fit(alpha: float, beta: float) -> MethodProfile:
    return MethodProfile(CostLine(alpha_s=alpha, beta_bytes_per_s=beta, r2=1.0, max_abs_residual=0.1))


def published_profile(reference: kvcopy.ModelSpec, network: str | None = None) -> Profile:
    """The H200 profile; with ``network`` (a NETWORKS name), also the link to a peer (direction r2h)."""
    links = {"h2d": {"copy_engine": _fit(DMA_ALPHA_S, DMA_BYTES_PER_S), "cuda": _fit(SM_ALPHA_S, SM_BYTES_PER_S)}}
    if network is not None:
        links[REMOTE_DIRECTION] = {"nixl": _fit(*NETWORKS[network])}
    return Profile(
        hardware={"device_name": "H200 + PCIe Gen5 (published figures, NOT MEASURED)"},
        directions=links,
        prefill=PrefillProfile(
            model=reference.name,
            alpha_s=PREFILL_ALPHA_PER_LAYER_S * reference.num_layers,
            flops_per_s=PREFILL_FLOPS_PER_S,
            r2=1.0,
            weight_bytes_per_s=WEIGHT_BYTES_PER_S,
            num_layers=reference.num_layers,
        ),
    )


def table() -> str:
    reference = kvcopy.ModelSpec.preset("llama-3.1-8b")
    profile = published_profile(reference)
    lines = [
        "# Decisions on an H200-like machine, from published figures (NOT MEASURED)",
        "",
        f"Profile: PCIe Gen5 loads at {DMA_BYTES_PER_S / 1e9:.0f} GB/s (copy engines, {DMA_ALPHA_S * 1e6:.0f} us a "
        f"call) or {SM_BYTES_PER_S / 1e9:.0f} GB/s (SM kernel, {SM_ALPHA_S * 1e6:.0f} us); prefill "
        f"{PREFILL_FLOPS_PER_S / 1e12:.0f} TFLOP/s, weights read at {WEIGHT_BYTES_PER_S / 1e12:.2f} TB/s, "
        f"{PREFILL_ALPHA_PER_LAYER_S * 1e6:.0f} us per layer-forward. Made by `benchmarks/decision_table.py`; "
        f"every figure is a public one (see its comments), none was measured here. {NEW_TOKENS} new tokens after "
        f"each prefix; the engine reloads layer by layer.",
        "",
        "| model | prefix | reload ms | layer-wise ms | split ms | recompute ms | decision |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    thresholds = []
    for name, tp in MODELS:
        planner = kvcopy.Planner.from_profile(profile, kvcopy.ModelSpec.preset(name), tp=tp, layerwise=True)
        label = name if tp == 1 else f"{name} tp {tp}"
        for prefix in PREFIXES:
            d = planner.decide(prefix, NEW_TOKENS)
            split = f"{d.t_split * 1e3:.2f}" if d.t_split is not None else "-"
            lines.append(
                f"| {label} | {prefix} | {d.t_reload * 1e3:.2f} | {d.t_layerwise * 1e3:.2f} | {split} | "
                f"{d.t_recompute * 1e3:.2f} | {d.action} |"
            )
        threshold = planner.threshold_tokens(NEW_TOKENS)
        thresholds.append(
            f"- {label}: "
            + (
                "recompute wins at the context length"
                if threshold is None
                else f"keeping a cached prefix pays from {threshold} tokens"
            )
        )
    return (
        "\n".join(
            [
                *lines,
                "",
                "Thresholds (smallest prefix from which keeping pays up to the context length):",
                "",
                *thresholds,
                *fetch_table(reference),
            ]
        )
        + "\n"
    )


def fetch_table(reference: kvcopy.ModelSpec) -> list[str]:
    """The same models when the prefix is held by another node: fetch (network read, then reload, pipelined)
    or recompute, over each of NETWORKS."""
    nets = list(NETWORKS)
    lines = [
        "",
        "## The prefix on another node: fetch or recompute (NOT MEASURED)",
        "",
        "Links: "
        + "; ".join(f"{n} {b / 1e9:.1f} GB/s with {a * 1e6:.0f} us per read" for n, (a, b) in NETWORKS.items())
        + " (published figures: see `NETWORKS` in the script). A fetch reads the prefix's page-first blocks over "
        "the network into the host pool and reloads them, the two pipelined in chunks; split computes the "
        f"front while the rest is fetched. {NEW_TOKENS} new tokens after each prefix.",
        "",
        "| model | prefix | "
        + " | ".join(f"{n}: fetch ms | {n}: split ms | {n}: decision" for n in nets)
        + " | recompute ms |",
        "|---|---:|" + "---:|---:|---|" * len(nets) + "---:|",
    ]
    planners = {
        (name, tp): [
            kvcopy.Planner.from_profile(published_profile(reference, n), kvcopy.ModelSpec.preset(name), tp=tp)
            for n in nets
        ]
        for name, tp in MODELS
    }
    thresholds = []
    for (name, tp), mine in planners.items():
        label = name if tp == 1 else f"{name} tp {tp}"
        for prefix in PREFIXES:
            ds = [p.decide(prefix, NEW_TOKENS, source="peer") for p in mine]
            cells = [
                f"{d.t_fetch * 1e3:.2f} | {'-' if d.t_split is None else f'{d.t_split * 1e3:.2f}'} | {d.action}"
                for d in ds
            ]
            lines.append(f"| {label} | {prefix} | " + " | ".join(cells) + f" | {ds[0].t_recompute * 1e3:.2f} |")
        said = [p.threshold_tokens(NEW_TOKENS, source="peer") for p in mine]
        thresholds.append(
            f"- {label}: "
            + "; ".join(
                f"over {n}, "
                + ("recompute wins at the context length" if t is None else f"fetching pays from {t} tokens")
                for n, t in zip(nets, said, strict=True)
            )
        )
    return [*lines, "", "Thresholds for fetching:", "", *thresholds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    text = table()
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
