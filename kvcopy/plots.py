"""Plots for the CLI: calibration fits and reload/recompute/split curves (matplotlib, Agg)."""

from __future__ import annotations

import os

import numpy as np

from .planner import Planner
from .profile import Profile

__all__ = ["plot_calibration", "plot_plan"]


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
            line = ax.errorbar(pts[:, 0], pts[:, 3], yerr=[pts[:, 3] - pts[:, 4], pts[:, 5] - pts[:, 3]], fmt="o",
                               ms=3, label=f"{method}: alpha {mp.fit.alpha_s * 1e6:.1f} us, "
                                           f"beta {mp.fit.beta_bytes_per_s / 1e9:.1f} GB/s")
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


def plot_plan(planner: Planner, path: str | os.PathLike[str], *, max_tokens: int, new_tokens: int = 0) -> None:
    """Reload, recompute and split time against prefix length, with the crossover marked."""
    plt = _pyplot()
    lengths = np.unique(np.geomspace(1, max_tokens, 200).astype(int))
    decisions = [planner.decide(int(n), new_tokens) for n in lengths]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(lengths, [d.t_reload for d in decisions], label="reload")
    ax.plot(lengths, [d.t_recompute for d in decisions], label="recompute")
    ax.plot(lengths, [d.t_split if d.t_split is not None else np.nan for d in decisions], "--", label="split")
    threshold = planner.threshold_tokens()
    if threshold is not None and threshold <= max_tokens:
        ax.axvline(threshold, color="gray", ls=":", label=f"reload wins from {threshold} tokens")
    ax.set(xscale="log", yscale="log", xlabel="cached prefix tokens", ylabel="seconds",
           title=f"{planner.spec.name}: reload vs recompute")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
