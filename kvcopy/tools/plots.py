"""Plots for the CLI: calibration fits, reload/recompute/split curves and benchmark sweeps (matplotlib, Agg)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..policy.planner import Planner
from ..profile import Profile

__all__ = ["plot_bench", "plot_calibration", "plot_plan"]

# Sweeps drawn by plot_bench: suite -> (row field on the x axis, its scale to display units, axis label).
_SWEEP_AXES = {
    "size_sweep": ("plane_block_bytes", 1 / 1024, "KiB per plane-block"),
    "count_sweep": ("num_blocks", 1, "blocks per call"),
}


def _pyplot():  # noqa: ANN202
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("plots need matplotlib: pip install 'kvcopy[plot]'") from err
    return plt


def plot_calibration(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Measured copy time against bytes (medians with p20-p80 bars) and each method's fitted line, per direction."""
    plt = _pyplot()
    directions = sorted(profile.links)
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions), 4.5), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        for method, mp in sorted(profile.links[direction].items()):
            pts = np.array(mp.points)
            line = ax.errorbar(
                pts[:, 0],
                pts[:, 3],
                yerr=[pts[:, 3] - pts[:, 4], pts[:, 5] - pts[:, 3]],
                fmt="o",
                ms=3,
                label=f"{method}: alpha {mp.fit.alpha_s * 1e6:.1f} us, beta {mp.fit.beta_bytes_per_s / 1e9:.1f} GB/s",
            )
            xs = np.logspace(np.log10(pts[:, 0].min()), np.log10(pts[:, 0].max()), 100)
            ax.plot(xs, [mp.fit.predict(x) for x in xs], color=line[0].get_color(), lw=1)
        peak = profile.peaks.get(direction)
        title = f"{direction}" + (f" (contiguous peak {peak / 1e9:.1f} GB/s)" if peak else "")
        ax.set(xscale="log", yscale="log", xlabel="bytes per call", ylabel="seconds per call", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"kvcopy calibration: {profile.hardware.get('device_name')} ({profile.hardware.get('date')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_plan(planner: Planner, path: str | os.PathLike[str], *, max_tokens: int, new_tokens: int = 1) -> None:
    """Reload, layer-wise reload, split and recompute time against prefix length, with the threshold marked."""
    plt = _pyplot()
    lengths = np.unique(np.geomspace(1, max_tokens, 200).astype(int))
    decisions = [planner.decide(int(n), new_tokens) for n in lengths]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(lengths, [d.t_reload for d in decisions], label="reload")
    if planner.layerwise:
        ax.plot(lengths, [d.t_layerwise for d in decisions], "-.", label="layer-wise reload")
    ax.plot(lengths, [d.t_split if d.t_split is not None else np.nan for d in decisions], "--", label="split")
    ax.plot(lengths, [d.t_recompute for d in decisions], label="recompute")
    threshold = planner.threshold_tokens(new_tokens)
    if threshold is not None and threshold <= max_tokens:
        ax.axvline(threshold, color="gray", ls=":", label=f"keeping the cache pays from {threshold} tokens")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="cached prefix tokens",
        ylabel="seconds",
        title=f"{planner.spec.name}: reload vs recompute",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bench(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], *, title: str = "kvcopy bench") -> None:
    """GB/s against plane-block size and against block count, per method and direction, with the limit dashed.

    ``rows``: kvcopy.tools.bench.with_ratios or read_csv output; the size_sweep and
    count_sweep suites are drawn, one column each. ValueError when neither is there.
    """
    suites = [s for s in _SWEEP_AXES if any(r["suite"] == s for r in rows)]
    if not suites:
        raise ValueError("rows: no size_sweep or count_sweep rows to plot (run the sweeps)")
    directions = list(dict.fromkeys(r["direction"] for r in rows if r["suite"] in suites))
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(directions), len(suites), figsize=(6.5 * len(suites), 4.2 * len(directions)), squeeze=False
    )
    for i, direction in enumerate(directions):
        for j, suite in enumerate(suites):
            field, scale, label = _SWEEP_AXES[suite]
            ax = axes[i][j]
            mine = [r for r in rows if r["suite"] == suite and r["direction"] == direction]
            for method in dict.fromkeys(r["method"] for r in mine):
                points = sorted((r[field] * scale, r["gbps"]) for r in mine if r["method"] == method)
                xs, ys = zip(*points)
                limit = method.startswith("contiguous")
                style = dict(color="black", ls="--", lw=1.5) if limit else dict(marker="o", ms=3)
                ax.plot(xs, ys, label=method, **style)
            ax.set_xscale("log", base=2)
            ax.set(xlabel=label, ylabel="GB/s", title=f"{direction}: {suite.replace('_', ' ')}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
