"""Plots for the CLI: calibration fits, reload/recompute/split curves and benchmark results (matplotlib, Agg).

Each figure says what it shows on the figure itself: what the directions and curves mean, which points are
measured and which lines are fitted, and the workload and block count behind each panel."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcopy.planner.planner import Planner, Source
from kvcopy.profile import PER_SIZE_JUDGED_DIRECTIONS, CostLine, PrefillProfile, Profile

__all__ = ["DIRECTION_NAMES", "plot_bench", "plot_calibration", "plot_plan"]

# What each direction name means (docs/glossary.md).
DIRECTION_NAMES = {
    "h2h": "h2h: host to host",
    "h2d": "h2d: host to GPU (reload, scatter)",
    "d2h": "d2h: GPU to host (offload, gather)",
    "d2d": "d2d: GPU to GPU",
    "r2h": "r2h: a peer's pool to this host (NIXL read)",
}
# The bench's directions, from the cache's point of view.
_BENCH_DIRECTIONS = {"gather": "gather: cache -> host pool", "scatter": "scatter: host pool -> cache"}
# Sweeps drawn by plot_bench: suite -> (row field on the x axis, its scale to display units, axis label).
_SWEEP_AXES = {
    "size_sweep": ("plane_block_bytes", 1 / 1024, "KiB per plane-block"),
    "count_sweep": ("num_blocks", 1, "blocks per call"),
}
_PLANE_BLOCK_NOTE = (
    "plane-block: one block of one plane (e.g. one layer's K for one block of tokens); a block is all its "
    "planes. Dashed: one contiguous copy of the same bytes (the limit)."
)
_FIGURE_DPI = 120


def _pyplot() -> Any:  # matplotlib.pyplot
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("plots need matplotlib: pip install 'kvcopy[plot]'") from err
    return plt


def _save(fig: Any, path: str | os.PathLike[str], note: str) -> None:
    plt = _pyplot()
    fig.text(0.01, 0.005, note, fontsize=7.5, ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=_FIGURE_DPI)
    plt.close(fig)


def plot_calibration(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Per direction: measured copy time against bytes (medians, p20-p80 bars) and each method's fitted line;
    and the prefill panel: one layer's forward time against its FLOPs, with the fitted roofline."""
    plt = _pyplot()
    directions = sorted(profile.directions)
    panels = len(directions) + (profile.prefill is not None)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8), squeeze=False)
    for ax, direction in zip(axes[0], directions, strict=False):  # the prefill panel, if any, comes after
        if direction in PER_SIZE_JUDGED_DIRECTIONS:
            _per_size_panel(ax, profile, direction)
            continue
        for method, mp in sorted(profile.directions[direction].items()):
            if not mp.points:  # a profile written by hand: a fit without the points it came from
                continue
            label = f"{method}: alpha {mp.fit.alpha_s * 1e6:.1f} us, beta {mp.fit.beta_bytes_per_s / 1e9:.1f} GB/s"
            _points_and_fit(ax, np.array(mp.points), mp.fit, label)
        peak = profile.peaks.get(direction)
        title = DIRECTION_NAMES.get(direction, direction) + (f"\ncontiguous peak {peak / 1e9:.1f} GB/s" if peak else "")
        ax.set(xscale="log", yscale="log", xlabel="bytes per call", ylabel="seconds per call", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if profile.prefill is not None:
        _prefill_panel(axes[0][-1], profile.prefill)
    fig.suptitle(f"kvcopy calibration: {profile.hardware.get('device_name')} ({profile.hardware.get('date')})")
    _save(
        fig,
        path,
        "Points: measured medians (bars: 20th-80th percentile). Lines: the fits t = alpha + bytes / beta "
        "(copies) and t = alpha + FLOPs / (FLOP/s) (prefill), which method='auto' and the planner use.",
    )


def _points_and_fit(ax: Any, pts: np.ndarray, fit: CostLine, label: str) -> None:
    """Calibration points ``[bytes, blocks, plane-block bytes, median, p20, p80]`` (medians, p20-p80 bars) and
    the fitted line through their range, in one color."""
    line = ax.errorbar(
        pts[:, 0], pts[:, 3], yerr=[pts[:, 3] - pts[:, 4], pts[:, 5] - pts[:, 3]], fmt="o", ms=3, label=label
    )
    xs = np.logspace(np.log10(pts[:, 0].min()), np.log10(pts[:, 0].max()), 100)
    ax.plot(xs, [fit.predict(x) for x in xs], color=line[0].get_color(), lw=1)


def _per_size_panel(ax: Any, profile: Profile, direction: str) -> None:
    """The link to a peer: one color per range size (each range is one network descriptor), each with its fit
    (what the planner's fetch uses); the title says which peer (a loopback is labelled so)."""
    for method, mp in sorted(profile.directions[direction].items()):
        pts = np.array(mp.points) if mp.points else np.zeros((0, 6))
        for size in sorted({int(p) for p in pts[:, 2]}):
            fit = mp.by_block_nbytes.get(size, mp.fit)
            label = (
                f"{method}, {size // 1024} KiB ranges: alpha {fit.alpha_s * 1e6:.1f} us, "
                f"beta {fit.beta_bytes_per_s / 1e9:.2f} GB/s"
            )
            _points_and_fit(ax, pts[pts[:, 2] == size], fit, label)
    peak = profile.peaks.get(direction)
    title = DIRECTION_NAMES.get(direction, direction) + f"\n{profile.hardware.get('remote_link', '')}"
    title += f"; one range: {peak / 1e9:.1f} GB/s" if peak else ""
    ax.set(xscale="log", yscale="log", xlabel="bytes per read", ylabel="seconds per read", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _prefill_panel(ax: Any, prefill: PrefillProfile) -> None:
    pts = np.array(prefill.points) if prefill.points else np.zeros((0, 2))
    layer_alpha = prefill.alpha_s / (prefill.num_layers or 1)
    if len(pts):
        ax.plot(pts[:, 0], pts[:, 1], "o", ms=4, label="measured: one layer's forward")
        xs = np.logspace(np.log10(pts[:, 0].min()), np.log10(pts[:, 0].max()), 100)
        ax.plot(
            xs,
            layer_alpha + xs / prefill.flops_per_s,
            lw=1,
            label=f"fit: {prefill.flops_per_s / 1e12:.2f} TFLOP/s, alpha {layer_alpha * 1e3:.2f} ms",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="FLOPs of one layer's forward",
        ylabel="seconds",
        title=f"prefill: one layer of {prefill.model} (R^2 {prefill.r2:.3f})",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


# What each plan curve includes.
_PLAN_CURVES = {
    "reload": "reload: copy the prefix's KV to the GPU, then compute the new tokens",
    "layerwise": "layer-wise reload: each layer computes as soon as its KV has arrived",
    "split": "split: recompute the front of the prefix while the rest loads",
    "recompute": "recompute: prefill the prefix and the new tokens",
    "fetch": "fetch (prefix on a peer): network read and reload, pipelined, then compute the new tokens",
}


def plot_plan(
    planner: Planner,
    path: str | os.PathLike[str],
    *,
    max_tokens: int,
    new_tokens: int = 1,
    prefix: int | None = None,
    source: Source = "host",
) -> None:
    """Reload, layer-wise reload, split and recompute time against prefix length, for ``new_tokens`` new
    tokens, and fetching from a peer when the planner has a network link (from the disk when ``source`` is
    "disk"); the small-prefix threshold and (when given) the requested ``prefix`` and its decision marked, for
    a prefix where ``source`` says (see Planner.decide)."""
    plt = _pyplot()
    lengths = np.unique(np.geomspace(1, max_tokens, 200).astype(int))
    decisions = [planner.decide(int(n), new_tokens) for n in lengths]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(lengths, [d.t_reload for d in decisions], label=_PLAN_CURVES["reload"])
    if planner.layerwise:
        ax.plot(lengths, [d.t_layerwise for d in decisions], "-.", label=_PLAN_CURVES["layerwise"])
    split = [d.t_split if d.t_split is not None else np.nan for d in decisions]
    ax.plot(lengths, split, "--", label=_PLAN_CURVES["split"])
    ax.plot(lengths, [d.t_recompute for d in decisions], label=_PLAN_CURVES["recompute"])
    if source == "disk" or planner.fetch is not None:
        remote: Source = "disk" if source == "disk" else "peer"
        fetched = [planner.decide(int(n), new_tokens, source=remote).t_fetch for n in lengths]
        label = "read from the disk and reload (pipelined)" if source == "disk" else _PLAN_CURVES["fetch"]
        ax.plot(lengths, fetched, ":", lw=2, label=label)
    threshold = planner.threshold_tokens(new_tokens, source=source)
    if threshold is not None and threshold <= max_tokens:
        what = {"peer": "fetching from the peer", "disk": "reading from the disk", "host": "keeping the cache"}[source]
        ax.axvline(threshold, color="gray", ls=":", label=f"threshold: {what} pays from {threshold} tokens")
    if prefix:
        chosen = planner.decide(prefix, new_tokens, source=source)
        ax.axvline(prefix, color="black", lw=0.8)
        seconds = {
            "reload": chosen.t_reload,
            "recompute": chosen.t_recompute,
            "split": chosen.t_split,
            "layerwise": chosen.t_layerwise,
            "fetch": chosen.t_fetch,
        }[chosen.action]
        where = {"peer": "on a peer", "disk": "on disk", "host": "cached"}[source]
        ax.plot(
            [prefix], [seconds], "k*", ms=12, label=f"requested: {prefix} {where} + {new_tokens} new -> {chosen.action}"
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel=f"cached prefix tokens (each with {new_tokens} new token{'s' if new_tokens != 1 else ''})",
        ylabel="seconds until the new tokens are computed",
        title=f"{planner.spec.name}: reload{', fetch' if planner.fetch is not None else ''} vs recompute",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5)
    _save(
        fig,
        path,
        "Times predicted from the calibrated profile (copy alpha/beta, prefill roofline) and the "
        "model's KV bytes and FLOPs; the planner picks the lowest curve.",
    )


def plot_bench(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], *, title: str = "kvcopy bench") -> None:
    """Per direction (a row of panels): GB/s against plane-block size and against block count (the sweeps),
    GB/s of each named workload, and microseconds of a 1-block call (fixed cost), per method.

    ``rows``: kvcopy.tools.bench.with_ratios or read_csv output. ValueError when none of those suites is there.
    """
    suites = [s for s in (*_SWEEP_AXES, "workloads", "fixed_cost") if any(r["suite"] == s for r in rows)]
    if not suites:
        raise ValueError("rows: no sweep, workload or fixed_cost rows to plot (run kvcopy bench)")
    directions = list(dict.fromkeys(r["direction"] for r in rows if r["suite"] in suites))
    plt = _pyplot()
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    others = [m for m in dict.fromkeys(r["method"] for r in rows) if not m.startswith("contiguous")]
    colors = {m: palette[k % len(palette)] for k, m in enumerate(others)}  # one color per method in every panel
    fig, axes = plt.subplots(
        len(directions), len(suites), figsize=(6.5 * len(suites), 4.6 * len(directions)), squeeze=False
    )
    for i, direction in enumerate(directions):
        for j, suite in enumerate(suites):
            mine = [r for r in rows if r["suite"] == suite and r["direction"] == direction]
            ax = axes[i][j]
            where = _BENCH_DIRECTIONS.get(direction, direction)
            if suite in _SWEEP_AXES:
                _sweep_panel(ax, mine, suite, where, colors)
            elif suite == "workloads":
                _bars(
                    ax,
                    mine,
                    colors,
                    value="gbps",
                    unit="GB/s",
                    title=f"{where}\nworkloads, {_blocks_of(mine)} per call",
                )
            else:
                _bars(
                    ax,
                    mine,
                    colors,
                    value="median_s",
                    unit="microseconds per call",
                    scale=1e6,
                    title=f"{where}\nfixed cost: 1 block per call",
                )
    fig.suptitle(title)
    _save(fig, path, _PLANE_BLOCK_NOTE)


def _blocks_of(rows: Sequence[dict[str, Any]]) -> str:
    counts = sorted({int(r["num_blocks"]) for r in rows})
    return f"{counts[0]} blocks" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} blocks"


def _sweep_panel(ax: Any, rows: Sequence[dict[str, Any]], suite: str, where: str, colors: dict[str, str]) -> None:
    field, scale, label = _SWEEP_AXES[suite]
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r[field] * scale, r["gbps"]) for r in rows if r["method"] == method)
        xs, ys = zip(*points, strict=True)
        limit = method.startswith("contiguous")
        style = dict(color="black", ls="--", lw=1.5) if limit else dict(marker="o", ms=3, color=colors[method])
        ax.plot(xs, ys, label=method, **style)
    workloads = sorted({r["workload"] for r in rows})
    what = (
        f"{workloads[0]}, blocks per call varied"
        if suite == "count_sweep"
        else f"Llama-3.1-8B's cache, {_blocks_of(rows)} per call, tokens per block varied"
    )
    ax.set_xscale("log", base=2)
    ax.set(xlabel=label, ylabel="GB/s", title=f"{where}\n{what}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _bars(
    ax: Any,
    rows: Sequence[dict[str, Any]],
    colors: dict[str, str],
    *,
    value: str,
    unit: str,
    title: str,
    scale: float = 1.0,
) -> None:
    """Grouped bars: one group per workload, one bar per method (the limit in black)."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / max(len(methods), 1)
    for k, method in enumerate(methods):
        heights = [
            next((r[value] * scale for r in rows if r["workload"] == w and r["method"] == method), np.nan)
            for w in workloads
        ]
        limit = method.startswith("contiguous")
        ax.bar(
            np.arange(len(workloads)) + k * width,
            heights,
            width,
            label=method,
            color="black" if limit else colors[method],
        )
    ax.set_xticks(np.arange(len(workloads)) + width * (len(methods) - 1) / 2, workloads, rotation=15, fontsize=7)
    if value == "median_s":
        ax.set_yscale("log")
    ax.set(ylabel=unit, title=title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=6.5)
