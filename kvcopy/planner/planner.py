"""Planner: reload, layer-wise reload, split or recompute — decided from measured costs.

Costs, for a prefix of P cached tokens followed by n >= 1 new tokens (a
resumed request always computes at least the token it continues from):

- reload:    ``t_load(P) + t_extend(P, n)``: load the prefix, then compute;
- layerwise: ``max(t_load(P), t_extend(P, n)) + t_load(P) / L``: layer l's
  blocks load while layers < l compute (only when the engine reloads layer by
  layer: ``layerwise=True``);
- split:     compute the first x tokens while the rest of the prefix loads,
  meeting in the middle (the Cake idea): ``max(t_prefill(x), t_load(rest)) +
  t_extend(P, n)`` at the best x. On sliding-window layers only the last W
  tokens are cached, so computing tokens before them saves no load;
- recompute: ``t_prefill(P + n)``;
- fetch (a prefix held by a peer, ``from_peer=True``, or in the disk store, ``from_disk=True``):
  ``t_fetch(P) + t_extend(P, n)``: read the blocks over the network (from the disk) into the host pool and
  reload them, the two pipelined in chunks (kvcopy.planner.pipeline);
  split works the same with the fetch in place of the load. Layer-wise reload is not offered for a peer's
  prefix: its page-first blocks hold every layer, so no layer arrives before the others.

``t_load(bytes) = min over the load options of alpha + bytes / (beta · (1 - decode_share))``:
the best measured copy method at that size. ``t_fetch`` reads at ``fetch_alpha_s + bytes / fetch_bytes_per_s``
(the network link, ``kvcopy calibrate --remote``; from the disk: ``disk_alpha_s + bytes / disk_bytes_per_s``,
``kvcopy calibrate --disk``). ``decode_share`` is the fraction
of the link (or the SMs) that running decode needs; a load gets the rest.

Prefill, per forward of n new tokens after P cached ones, is a roofline:
``prefill_alpha_s + max(flops(n, P) / prefill_flops_per_s, weight_bytes(n, P) / weight_bytes_per_s)``
(a batch of k requests adds ``(k - 1) * prefill_extra_request_s``, the engine's work per sequence):
a short forward is bound by reading the weights (and the cached KV), not by
FLOPs (ModelSpec.prefill_flops, ModelSpec.weight_bytes). Without
``weight_bytes_per_s`` there is no memory-bound floor; a linear model
``prefill_alpha_s + n / prefill_tokens_per_s`` is also accepted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvcopy.model.spec import forward_costs
from kvcopy.planner.decision import ACTIONS, Action, Decision, seconds_text
from kvcopy.planner.pipeline import pipelined_seconds
from kvcopy.planner.split import best_split
from kvcopy.planner.threshold import first_winning
from kvcopy.profile import DISK_READ_DIRECTION, REMOTE_DIRECTION

if TYPE_CHECKING:
    from kvcopy.model.spec import ModelSpec
    from kvcopy.profile import Profile

__all__ = ["Decision", "Planner", "DEFAULT_BLOCK_TOKENS", "DEFAULT_CONTEXT_TOKENS", "ACTIONS"]

# Tokens per block when a profile is turned into load costs: the common paged-attention block.
DEFAULT_BLOCK_TOKENS = 16
# The longest prefix the threshold considers when the model's config does not give its context length.
DEFAULT_CONTEXT_TOKENS = 131072
# A split must beat the best other option by at least this fraction when the caller gives no margin.
_DEFAULT_SPLIT_MARGIN = 0.0


class Planner:
    """Reload-vs-recompute decisions for one model (a ModelSpec) on one machine.

    Exactly one of ``prefill_tokens_per_s`` (linear prefill model) and
    ``prefill_flops_per_s`` (roofline, via ``spec.prefill_flops``) must be
    given; ``weight_bytes_per_s`` (only with FLOPs) adds the memory-bound floor.
    ``prefill_extra_request_s``: what each request beside the first adds to a
    batched forward (learned online; 0 from a calibration).
    ``load_options``: more (alpha_s, bytes_per_s) copy methods besides the
    first; a load takes the fastest. ``split_margin``: a split is chosen only
    when it beats every other option by more than this fraction (the
    profile's prediction error). ``note``: said in every explanation (e.g.
    what the prefill was calibrated on). ``fetch_alpha_s`` / ``fetch_bytes_per_s``: the network link to
    a peer holding the prefix (both or neither), for ``decide(..., from_peer=True)``; ``disk_alpha_s`` /
    ``disk_bytes_per_s``: the disk store's reads, for ``decide(..., from_disk=True)``; ``block_tokens``:
    tokens per block, the smallest piece a fetch is pipelined in.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        load_alpha_s: float,
        load_bytes_per_s: float,
        prefill_tokens_per_s: float | None = None,
        prefill_flops_per_s: float | None = None,
        prefill_alpha_s: float = 0.0,
        weight_bytes_per_s: float | None = None,
        prefill_extra_request_s: float = 0.0,
        decode_share: float = 0.0,
        layerwise: bool = False,
        load_options: Sequence[tuple[float, float]] = (),
        split_margin: float = _DEFAULT_SPLIT_MARGIN,
        note: str = "",
        fetch_alpha_s: float | None = None,
        fetch_bytes_per_s: float | None = None,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        disk_alpha_s: float | None = None,
        disk_bytes_per_s: float | None = None,
    ) -> None:
        if (prefill_tokens_per_s is None) == (prefill_flops_per_s is None):
            raise ValueError("prefill_tokens_per_s / prefill_flops_per_s: expected exactly one of them")
        if weight_bytes_per_s is not None and prefill_flops_per_s is None:
            raise ValueError("weight_bytes_per_s: only with prefill_flops_per_s (the roofline model)")
        check_costs(
            rates={
                "load_bytes_per_s": load_bytes_per_s,
                "prefill_tokens_per_s": prefill_tokens_per_s,
                "prefill_flops_per_s": prefill_flops_per_s,
                "weight_bytes_per_s": weight_bytes_per_s,
                "fetch_bytes_per_s": fetch_bytes_per_s,
                "disk_bytes_per_s": disk_bytes_per_s,
            },
            links={"fetch": (fetch_alpha_s, fetch_bytes_per_s), "disk": (disk_alpha_s, disk_bytes_per_s)},
            seconds={
                "load_alpha_s": load_alpha_s,
                "prefill_alpha_s": prefill_alpha_s,
                "prefill_extra_request_s": prefill_extra_request_s,
                "fetch_alpha_s": fetch_alpha_s or 0.0,
                "disk_alpha_s": disk_alpha_s or 0.0,
            },
            load_options=load_options,
        )
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens: expected an int >= 1, got {block_tokens!r}")
        if not 0 <= decode_share < 1:
            raise ValueError(f"decode_share: expected a fraction in [0, 1), got {decode_share}")
        if not 0 <= split_margin < 1:
            raise ValueError(f"split_margin: expected a fraction in [0, 1), got {split_margin}")
        self.spec = spec
        self.load_alpha_s = float(load_alpha_s)
        self.load_bytes_per_s = float(load_bytes_per_s)
        self.load_options = ((self.load_alpha_s, self.load_bytes_per_s),) + tuple(
            (float(a), float(b)) for a, b in load_options
        )
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.prefill_flops_per_s = prefill_flops_per_s
        self.prefill_alpha_s = float(prefill_alpha_s)
        self.weight_bytes_per_s = weight_bytes_per_s
        self.prefill_extra_request_s = float(prefill_extra_request_s)
        self.decode_share = float(decode_share)
        self.layerwise = bool(layerwise)
        self.split_margin = float(split_margin)
        self.note = note
        self.fetch_alpha_s = None if fetch_alpha_s is None else float(fetch_alpha_s)
        self.fetch_bytes_per_s = None if fetch_bytes_per_s is None else float(fetch_bytes_per_s)
        self.block_tokens = block_tokens
        self.disk_alpha_s = None if disk_alpha_s is None else float(disk_alpha_s)
        self.disk_bytes_per_s = None if disk_bytes_per_s is None else float(disk_bytes_per_s)

    @classmethod
    def from_profile(
        cls,
        profile: Profile,
        spec: ModelSpec,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        decode_share: float = 0.0,
        layerwise: bool = False,
        tp: int = 1,
    ) -> Planner:
        """Load costs from every measured host->device method (host->host on a CPU-only profile) at
        this model's plane-block size, the fastest at each size; prefill from the profile's roofline.

        The profile's prefill rates are per FLOP and per byte, so they carry over to another
        model; its fixed cost is per layer-forward, scaled by the layer count. A planner for a
        model other than the calibrated one says so in every explanation. The split margin is
        the largest relative miss of the load fits. ``tp``: plan for one of that many
        tensor-parallel ranks (``spec.shard(tp)``: its KV heads, FLOPs and weight bytes). A
        profile with the network link to a peer (``kvcopy calibrate --remote``) gives the fetch
        costs, at the range size of one page-first block (one network descriptor per block).
        """
        spec = spec.shard(tp)
        direction = "h2d" if "h2d" in profile.directions else "h2h"
        if direction not in profile.directions:
            raise ValueError(f"profile: no host->device or host->host measurements (has {sorted(profile.directions)})")
        prefill = profile.prefill
        if prefill is None:
            raise ValueError("profile: no prefill measurement")
        planes = spec.num_layers * (1 if spec.attention == "mla" else 2)
        plane_block = spec.block_nbytes(block_tokens) / planes
        fits = [mp.line_at(plane_block) for mp in profile.directions[direction].values()]
        model = spec.name.split("@")[0]
        alpha = prefill.alpha_for(model, spec.num_layers)
        note = ""
        if prefill.model != model:
            note = f"prefill calibrated on {prefill.model}, scaled to {spec.name}"
        elif spec.tp > 1:
            note = f"one of {spec.tp} tensor-parallel ranks"
        margin = min(0.5, max((fit.max_abs_residual for fit in fits), default=0.0))
        block = spec.block_nbytes(block_tokens)
        fetch, disk = (
            min(
                (mp.line_at(block) for mp in profile.directions.get(link, {}).values()),
                key=lambda fit: fit.predict(block),
                default=None,
            )
            for link in (REMOTE_DIRECTION, DISK_READ_DIRECTION)
        )
        return cls(
            spec,
            load_alpha_s=fits[0].alpha_s,
            load_bytes_per_s=fits[0].beta_bytes_per_s,
            load_options=[(fit.alpha_s, fit.beta_bytes_per_s) for fit in fits[1:]],
            prefill_flops_per_s=prefill.flops_per_s,
            prefill_alpha_s=alpha,
            weight_bytes_per_s=prefill.weight_bytes_per_s,
            prefill_extra_request_s=prefill.extra_request_s,
            decode_share=decode_share,
            layerwise=layerwise,
            split_margin=margin,
            note=note,
            fetch_alpha_s=None if fetch is None else fetch.alpha_s,
            fetch_bytes_per_s=None if fetch is None else fetch.beta_bytes_per_s,
            block_tokens=block_tokens,
            disk_alpha_s=None if disk is None else disk.alpha_s,
            disk_bytes_per_s=None if disk is None else disk.beta_bytes_per_s,
        )

    # ------------------------------------------------------------------ costs

    def t_load_nbytes(self, nbytes: float) -> float:
        """Seconds to load ``nbytes`` of KV in one call, with the fastest load option at that size."""
        share = 1.0 - self.decode_share
        return min(alpha + nbytes / (beta * share) for alpha, beta in self.load_options)

    def t_fetch_nbytes(self, nbytes: float, *, from_disk: bool = False) -> tuple[float, int]:
        """(seconds, chunks) to bring ``nbytes`` of a peer's KV (or, ``from_disk``, of the disk's) here: the read
        into the host pool and the local reload, pipelined at the best chunk count (whole blocks per chunk).
        ValueError without that link."""
        alpha, beta = self._fetch_link(from_disk)
        blocks = math.ceil(nbytes / self.spec.block_nbytes(self.block_tokens))
        return pipelined_seconds(nbytes, blocks, lambda b: alpha + b / beta, self.t_load_nbytes)

    def _fetch_link(self, from_disk: bool = False) -> tuple[float, float]:
        """(alpha, beta) of the network link (the disk's reads, ``from_disk``); ValueError naming ``from_peer``
        (``from_disk``) when the planner has none."""
        if from_disk:
            if self.disk_alpha_s is None or self.disk_bytes_per_s is None:
                raise ValueError(
                    "from_disk: this planner has no disk link (disk_alpha_s / disk_bytes_per_s, or a profile from "
                    "`kvcopy calibrate --disk PATH`)"
                )
            return self.disk_alpha_s, self.disk_bytes_per_s
        if self.fetch_alpha_s is None or self.fetch_bytes_per_s is None:
            raise ValueError(
                "from_peer: this planner has no network link to a peer (fetch_alpha_s / fetch_bytes_per_s, or "
                "a profile from `kvcopy calibrate --remote`)"
            )
        return self.fetch_alpha_s, self.fetch_bytes_per_s

    def t_load(self, tokens: int) -> float:
        """Seconds to reload the KV of ``tokens`` prefix tokens (one call)."""
        return self.t_load_nbytes(self.spec.kv_bytes(tokens))

    def t_prefill(self, tokens: int, cached_tokens: int = 0) -> float:
        """Seconds of one forward computing ``tokens`` new tokens after ``cached_tokens`` cached ones."""
        if tokens <= 0:
            return 0.0
        return self.t_forward((tokens,), (cached_tokens,))

    def t_forward(self, new: Sequence[int], cached: Sequence[int]) -> float:
        """Seconds of one batched forward, request i computing ``new[i]`` tokens after ``cached[i]`` (0 for none):
        ``alpha + (k - 1) * extra + max(FLOPs / F, bytes read / W)`` of :func:`~.model.forward_costs` for its k
        requests, as an OnlineProfile fits."""
        if not any(new):
            return 0.0
        fixed = self.prefill_alpha_s + (len(new) - 1) * self.prefill_extra_request_s
        if self.prefill_tokens_per_s is not None:
            return fixed + sum(new) / self.prefill_tokens_per_s
        flops, read = forward_costs(self.spec, new, cached)
        memory = read / self.weight_bytes_per_s if self.weight_bytes_per_s else 0.0
        return fixed + max(flops / self.prefill_flops_per_s, memory)  # type: ignore[operator]

    # ------------------------------------------------------------------ decisions

    def decide(
        self,
        prefix_tokens: int,
        new_tokens: int = 1,
        *,
        load_nbytes: int | None = None,
        from_peer: bool = False,
        from_disk: bool = False,
    ) -> Decision:
        """Reload, layer-wise reload, split or recompute (fetch, split or recompute with ``from_peer`` or
        ``from_disk``) for a cached prefix of ``prefix_tokens`` and ``new_tokens`` (>= 1) to compute after it.

        ``load_nbytes``: the bytes a reload would move, when the engine knows them (whole
        blocks, a sliding window's ring); default ``spec.kv_bytes(prefix_tokens)``.
        ``from_peer``: the prefix is held by another node: fetch (network read and reload,
        pipelined), split (compute the front while the rest is fetched) or recompute. ValueError
        when the planner has no network link. ``from_disk``: the prefix is in the disk store (kvcopy.storage):
        the same three, the fetch reading the disk into the host pool (action "fetch"). Not both.
        """
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ValueError(f"prefix_tokens: expected an int >= 0, got {prefix_tokens!r}")
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
            raise ValueError(
                f"new_tokens: a resumed request computes at least the token it continues from; "
                f"expected an int >= 1, got {new_tokens!r}"
            )
        if load_nbytes is not None and (
            isinstance(load_nbytes, bool) or not isinstance(load_nbytes, int) or load_nbytes < 0
        ):
            raise ValueError(f"load_nbytes: expected an int >= 0 or None, got {load_nbytes!r}")
        if from_peer and from_disk:
            raise ValueError("from_peer / from_disk: the prefix is on a peer or on the disk, not both")
        elsewhere = from_peer or from_disk
        if elsewhere:
            self._fetch_link(from_disk)  # the error, before any work, when there is no such link
        prefix = prefix_tokens
        extend = self.t_prefill(new_tokens, prefix)
        t_recompute = self.t_prefill(prefix + new_tokens)
        keep: Action = "fetch" if elsewhere else "reload"
        if prefix == 0:
            note = self._note("no cached prefix: compute")
            t_reload, t_fetch = (None, extend) if elsewhere else (extend, None)
            return Decision("recompute", 0, new_tokens, t_reload, t_recompute, None, 0, note, None, t_fetch)

        def load(nbytes: float) -> float:
            return self.t_fetch_nbytes(nbytes, from_disk=from_disk)[0] if elsewhere else self.t_load_nbytes(nbytes)

        nbytes = self.spec.kv_bytes(prefix) if load_nbytes is None else load_nbytes
        t_load, chunks = (
            self.t_fetch_nbytes(nbytes, from_disk=from_disk) if elsewhere else (self.t_load_nbytes(nbytes), 0)
        )
        t_layerwise = max(t_load, extend) + t_load / self.spec.num_layers if self.layerwise and not elsewhere else None
        split = best_split(self, prefix, load)
        t_split = split[1] + extend if split else None
        options: dict[Action, float] = {keep: t_load + extend, "recompute": t_recompute}
        if t_layerwise is not None:
            options["layerwise"] = t_layerwise
        best_other = min(options.values())
        if t_split is not None and t_split < best_other * (1.0 - self.split_margin):
            options["split"] = t_split
        action = min(options, key=options.__getitem__)
        return Decision(
            action,
            prefix,
            new_tokens,
            None if elsewhere else options["reload"],
            t_recompute,
            t_split,
            split[0] if split else 0,
            self._explain(action, prefix, options, split, chunks, "the disk" if from_disk else "the peer"),
            t_layerwise,
            options["fetch"] if elsewhere else None,
            chunks,
            t_load,
        )

    def _note(self, text: str) -> str:
        return f"{text} ({self.note})" if self.note else text

    def _explain(
        self,
        action: Action,
        prefix: int,
        options: dict[Action, float],
        split: tuple[int, float] | None,
        chunks: int,
        source: str,
    ) -> str:
        rest = "the rest is fetched" if "fetch" in options else "the rest loads"
        what = {
            "split": f"split (compute the first {split[0] if split else 0} of {prefix} tokens while {rest})",
            "layerwise": "layer-wise reload",
            "fetch": f"fetch from {source} ({'disk' if source == 'the disk' else 'network'} read and reload, "
            f"pipelined in {chunks} chunk(s))",
        }.get(action, action)
        others = ", ".join(f"{name} {seconds_text(t)}" for name, t in options.items() if name != action)
        return self._note(f"{what}: {seconds_text(options[action])} vs {others} for {prefix} cached tokens")

    def _reload_wins(self, prefix: int, new_tokens: int, from_peer: bool, from_disk: bool = False) -> bool:
        return self.decide(prefix, new_tokens, from_peer=from_peer, from_disk=from_disk).action != "recompute"

    def threshold_tokens(
        self, new_tokens: int = 1, *, max_tokens: int | None = None, from_peer: bool = False, from_disk: bool = False
    ) -> int | None:
        """The smallest prefix P from which keeping the cache always pays: for every P' from P up to
        ``max_tokens`` (default: the model's context length, else DEFAULT_CONTEXT_TOKENS), ``decide``
        picks an option other than recompute (it beats recompute strictly; a split by the margin),
        with ``new_tokens`` to compute after it. None when recompute wins at ``max_tokens``.

        Evaluated on every length up to 4096 and on a geometric grid above (64 steps per
        doubling), then bisected between the last losing and the first winning length of the grid:
        exact unless the sign changes twice within one grid step. ``from_peer``: the threshold for
        fetching a prefix from a peer, ``from_disk``: from the disk store (see :meth:`decide`).
        """
        limit = max_tokens or getattr(self.spec, "context_length", None) or DEFAULT_CONTEXT_TOKENS
        return first_winning(lambda p: self._reload_wins(p, new_tokens, from_peer, from_disk), limit)


# --------------------------------------------------------------------------- checks


def _positive_rate(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name}: expected a positive rate, got {value}")


def check_costs(
    *,
    rates: Mapping[str, float | None],
    links: Mapping[str, tuple[float | None, float | None]],
    seconds: Mapping[str, float],
    load_options: Sequence[tuple[float, float]],
) -> None:
    """ValueError naming the argument: a rate (bytes, FLOPs or tokens per second; None: not given) that is not
    positive, a link (``{name}_alpha_s``, ``{name}_bytes_per_s``) given by halves, fixed seconds below 0 (or
    NaN), or a bad (alpha_s, bytes_per_s) pair in ``load_options``."""
    for name, rate in rates.items():
        _positive_rate(name, rate)
    for what, (alpha, beta) in links.items():
        if (alpha is None) != (beta is None):
            raise ValueError(f"{what}_alpha_s / {what}_bytes_per_s: expected both (a link) or neither")
    for name, value in seconds.items():
        if not value >= 0:
            raise ValueError(f"{name}: expected seconds >= 0, got {value}")
    for alpha, beta in load_options:
        if not alpha >= 0:
            raise ValueError(f"load_options: expected seconds >= 0, got {alpha}")
        _positive_rate("load_options", beta)
