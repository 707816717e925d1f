"""What the planner decides for a cached prefix: the action and the predicted seconds of each option."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ACTIONS", "Action", "Decision", "seconds_text"]

Action = Literal["reload", "layerwise", "split", "fetch", "recompute"]
ACTIONS: tuple[Action, ...] = ("reload", "layerwise", "split", "fetch", "recompute")


@dataclass(frozen=True)
class Decision:
    """What to do with a cached prefix, and the predicted seconds of each option.

    A prefix held here (host memory): ``t_reload`` is load-then-compute, ``t_fetch`` None. A prefix held by
    a peer (``Planner.decide(..., source="peer")``) or in the disk store (``source="disk"``): ``t_fetch``
    is fetch-then-compute (the network or disk read into the host pool and the local reload pipelined in
    ``fetch_chunks`` chunks), ``t_reload`` None. ``t_layerwise`` is None unless the planner was made with
    ``layerwise=True`` (and never for a prefix elsewhere); ``t_split`` is None when the prefix is too short
    to split. ``t_transfer`` is the moving alone, without the new tokens' compute: the reload, or the
    pipelined read and reload of a prefix elsewhere (what a measured fetch or reload compares with); 0 for
    no prefix.
    """

    action: Action
    prefix_tokens: int
    new_tokens: int
    t_reload: float | None
    t_recompute: float
    t_split: float | None
    split_tokens: int  # tokens to compute in a split (the rest is loaded); 0 unless a split was possible
    explanation: str
    t_layerwise: float | None = None
    t_fetch: float | None = None
    fetch_chunks: int = 0
    t_transfer: float = 0.0


def seconds_text(seconds: float) -> str:
    """Seconds in the unit that reads best: "12.3 us", "4.56 ms" or "7.89 s"."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
