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
- fetch (a prefix held by a peer, ``source="peer"``, or in the disk store, ``source="disk"``):
  ``t_fetch(P) + t_extend(P, n)``: read the blocks over the network (from the disk) into the host pool and
  reload them, the two pipelined in chunks (kvcopy.planner.pipeline);
  split works the same with the fetch in place of the load. Layer-wise reload is not offered for a peer's
  prefix: its page-first blocks hold every layer, so no layer arrives before the others.

``t_load(bytes) = min over the load options of alpha + bytes / (beta · (1 - decode_share))``:
the best measured copy method at that size. ``t_fetch`` reads at ``fetch.alpha_s + bytes / fetch.beta_bytes_per_s``
(the network link, ``kvcopy calibrate --remote``; from the disk, the ``disk`` line, ``kvcopy calibrate --disk``).
``decode_share`` is the fraction
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
from collections.abc import Sequence
from typing import Any, Literal

from kvcopy._checks import boolean, non_negative_int, non_negative_number, positive_int, positive_number
from kvcopy._version import warn_renamed
from kvcopy.model.spec import ModelSpec, forward_costs
from kvcopy.planner.decision import ACTIONS, Action, Decision, seconds_text
from kvcopy.planner.pipeline import pipelined_seconds
from kvcopy.planner.split import best_split
from kvcopy.planner.threshold import first_winning
from kvcopy.profile import DISK_READ_DIRECTION, REMOTE_DIRECTION, CostLine, Profile

__all__ = [
    "ACTIONS",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_CONTEXT_TOKENS",
    "MAX_TOKENS_WITHOUT_CONTEXT_LENGTH",
    "SOURCES",
    "Decision",
    "Planner",
    "Source",
]

# Tokens per block when a profile is turned into load costs: the common paged-attention block.
DEFAULT_BLOCK_TOKENS = 16
# The longest prefix the threshold considers when the model's config does not give its context length.
DEFAULT_CONTEXT_TOKENS = 131072
# The longest sequence (prefix and new tokens) a planner takes when the model's config gives no context length
# (max_position_embeddings): 16 Mi tokens, beyond every model's context today (Llama 4 Scout's 10 M is the
# longest), and small enough that every cost of it stays a finite float.
MAX_TOKENS_WITHOUT_CONTEXT_LENGTH = 1 << 24
# The most bytes a load may be said to move (load_nbytes): an int64, more than any machine's memory.
_MAX_LOAD_NBYTES = (1 << 63) - 1
# A split must beat the best other option by at least this fraction when the caller gives no margin.
_DEFAULT_SPLIT_MARGIN = 0.0
# Where a cached prefix is: in this host's pool (reload), on a peer or in the disk store (fetch).
Source = Literal["host", "peer", "disk"]
# Forwards whose costs a planner keeps: a threshold scan over a 128K context asks for about 20 000 distinct
# ones; past this many the memo starts again (an engine's live planner sees ever new batch shapes).
_FORWARD_COSTS_KEPT = 1 << 16
SOURCES: tuple[Source, ...] = ("host", "peer", "disk")
# Planner's keywords before its cost lines (0.1): (alpha_s keyword, bytes_per_s keyword) -> the line's keyword.
_RENAMED_LINES = {
    ("load_alpha_s", "load_bytes_per_s"): "load",
    ("fetch_alpha_s", "fetch_bytes_per_s"): "fetch",
    ("disk_alpha_s", "disk_bytes_per_s"): "disk",
}


class Planner:
    """Reload-vs-recompute decisions for one model (a ModelSpec) on one machine.

    Parameters:

    - ``spec``: the model (a ModelSpec).
    - ``load``: the reload's cost line (a CostLine: fixed seconds per call and bytes per second).
    - ``prefill_tokens_per_s``: a linear prefill model; or
    - ``prefill_flops_per_s``: the roofline's compute rate (via ``spec.prefill_flops``); exactly one of the two.
    - ``prefill_alpha_s``: a forward's fixed seconds.
    - ``weight_bytes_per_s``: the roofline's memory rate, the memory-bound floor (only with FLOPs).
    - ``prefill_extra_request_s``: what each request beside the first adds to a batched forward (learned
      online; 0 from a calibration).
    - ``decode_share``: the fraction of the link (or the SMs) that running decode needs; a load gets the rest.
    - ``layerwise``: the engine reloads layer by layer (offers the layer-wise reload).
    - ``load_options``: more cost lines of copy methods besides ``load``; a load takes the fastest.
    - ``split_margin``: a split is chosen only when it beats every other option by more than this fraction
      (the profile's prediction error).
    - ``note``: said in every explanation (e.g. what the prefill was calibrated on).
    - ``fetch``: the network link to a peer holding the prefix, for ``decide(..., source="peer")``.
    - ``disk``: the disk store's reads, for ``decide(..., source="disk")``.
    - ``block_tokens``: tokens per block, the smallest piece a fetch is pipelined in.

    ``load_alpha_s``/``load_bytes_per_s``, ``fetch_alpha_s``/``fetch_bytes_per_s`` and
    ``disk_alpha_s``/``disk_bytes_per_s`` (and (alpha_s, bytes_per_s) tuples in ``load_options``) are the
    deprecated spellings of the cost lines.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        load: CostLine | None = None,
        prefill_tokens_per_s: float | None = None,
        prefill_flops_per_s: float | None = None,
        prefill_alpha_s: float = 0.0,
        weight_bytes_per_s: float | None = None,
        prefill_extra_request_s: float = 0.0,
        decode_share: float = 0.0,
        layerwise: bool = False,
        load_options: Sequence[CostLine] = (),
        split_margin: float = _DEFAULT_SPLIT_MARGIN,
        note: str = "",
        fetch: CostLine | None = None,
        disk: CostLine | None = None,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        **renamed: float | None,
    ) -> None:
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"spec: expected a ModelSpec (ModelSpec.preset(name), ...), got {type(spec).__name__}")
        lines = _lines_from_renamed(renamed, {"load": load, "fetch": fetch, "disk": disk})
        load, fetch, disk = lines["load"], lines["fetch"], lines["disk"]
        if load is None:
            raise TypeError("Planner: missing load (a CostLine: the reload's fixed seconds and bytes per second)")
        options = []
        for option in load_options:  # a loop, not a comprehension: the deprecation warning names the caller
            options.append(_as_line(option))
        for name, line in (("load", load), ("fetch", fetch), ("disk", disk), *(("load_options", o) for o in options)):
            _check_line(name, line)
        if (prefill_tokens_per_s is None) == (prefill_flops_per_s is None):
            raise ValueError("prefill_tokens_per_s / prefill_flops_per_s: expected exactly one of them")
        if weight_bytes_per_s is not None and prefill_flops_per_s is None:
            raise ValueError("weight_bytes_per_s: only with prefill_flops_per_s (the roofline model)")
        for name, rate in (
            ("prefill_tokens_per_s", prefill_tokens_per_s),
            ("prefill_flops_per_s", prefill_flops_per_s),
            ("weight_bytes_per_s", weight_bytes_per_s),
        ):
            if rate is not None:
                positive_number(name, rate)
        non_negative_number("prefill_alpha_s", prefill_alpha_s)
        non_negative_number("prefill_extra_request_s", prefill_extra_request_s)
        positive_int("block_tokens", block_tokens)
        for name, fraction in (("decode_share", decode_share), ("split_margin", split_margin)):
            if not non_negative_number(name, fraction) < 1:
                raise ValueError(f"{name}: expected a fraction in [0, 1), got {fraction}")
        boolean("layerwise", layerwise)
        self.spec = spec
        self.load = load
        self.load_options: tuple[CostLine, ...] = (load, *options)
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.prefill_flops_per_s = prefill_flops_per_s
        self.prefill_alpha_s = float(prefill_alpha_s)
        self.weight_bytes_per_s = weight_bytes_per_s
        self.prefill_extra_request_s = float(prefill_extra_request_s)
        self.decode_share = float(decode_share)
        self.layerwise = bool(layerwise)
        self.split_margin = float(split_margin)
        self.note = note
        self.fetch = fetch
        self.disk = disk
        # forward_costs by (new, cached), for self.spec: a threshold scan asks for the same forwards thousands of
        # times (each split bisection computes the same fronts), and they depend on the spec alone.
        self._forward_costs: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[float, float]] = {}
        self._forward_costs_of = spec
        self.block_tokens = block_tokens

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

        TypeError naming the argument for a ``profile`` that is not a Profile (a path: ``Profile.load(path)``
        reads it), a ``spec`` that is not a ModelSpec (a name: ``ModelSpec.preset(name)``), or a ``layerwise``
        that is not a bool.
        """
        if not isinstance(profile, Profile):
            raise TypeError(
                f"profile: expected a Profile (Profile.load(path) reads one), got {type(profile).__name__} "
                f"{profile!r:.80}"
            )
        if not isinstance(spec, ModelSpec):
            raise TypeError(
                f"spec: expected a ModelSpec (ModelSpec.preset(name), ModelSpec.from_hf_config(path)), got "
                f"{type(spec).__name__} {spec!r:.80}"
            )
        boolean("layerwise", layerwise)
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
                (mp.line_at(block) for mp in profile.directions.get(direction, {}).values()),
                key=lambda fit: fit.predict(block),
                default=None,
            )
            for direction in (REMOTE_DIRECTION, DISK_READ_DIRECTION)
        )
        return cls(
            spec,
            load=_given(fits[0]),
            load_options=[_given(fit) for fit in fits[1:]],
            prefill_flops_per_s=prefill.flops_per_s,
            prefill_alpha_s=alpha,
            weight_bytes_per_s=prefill.weight_bytes_per_s,
            prefill_extra_request_s=prefill.extra_request_s,
            decode_share=decode_share,
            layerwise=layerwise,
            split_margin=margin,
            note=note,
            fetch=None if fetch is None else _given(fetch),
            block_tokens=block_tokens,
            disk=None if disk is None else _given(disk),
        )

    # ------------------------------------------------------------------ costs

    def t_load_nbytes(self, nbytes: float) -> float:
        """Seconds to load ``nbytes`` of KV in one call, with the fastest load option at that size."""
        share = 1.0 - self.decode_share
        return min(line.alpha_s + nbytes / (line.beta_bytes_per_s * share) for line in self.load_options)

    def t_fetch_nbytes(self, nbytes: float, *, source: Source = "peer", **renamed: bool) -> tuple[float, int]:
        """(seconds, chunks) to bring ``nbytes`` of KV held by ``source`` ("peer" or "disk") here: the read into
        the host pool and the local reload, pipelined at the best chunk count (whole blocks per chunk).
        ValueError when the planner has no cost line for that source. ``from_disk=True``: deprecated spelling
        of ``source="disk"``."""
        source = _source_from_renamed(renamed, source, "Planner.t_fetch_nbytes", default="peer")
        if source == "host":
            raise ValueError('source: a fetch is from "peer" or "disk", got "host"')
        line = self._fetch_line(source)
        blocks = math.ceil(nbytes / self.spec.block_nbytes(self.block_tokens))
        return pipelined_seconds(nbytes, blocks, line.predict, self.t_load_nbytes)

    def _fetch_line(self, source: Source) -> CostLine:
        """The cost line of a read from ``source`` ("peer": the network link, "disk": the disk's reads);
        ValueError naming ``source`` when the planner has none."""
        if source == "disk":
            if self.disk is None:
                raise ValueError(
                    'source="disk": this planner has no disk cost line (disk=CostLine(...), or a profile from '
                    "`kvcopy calibrate --disk PATH`)"
                )
            return self.disk
        if self.fetch is None:
            raise ValueError(
                'source="peer": this planner has no network link to a peer (fetch=CostLine(...), or a profile '
                "from `kvcopy calibrate --remote`)"
            )
        return self.fetch

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
        flops, read = self._costs(new, cached)
        memory = read / self.weight_bytes_per_s if self.weight_bytes_per_s else 0.0
        assert self.prefill_flops_per_s is not None  # one of the two rates is given (checked in __init__)
        return fixed + max(flops / self.prefill_flops_per_s, memory)

    def _costs(self, new: Sequence[int], cached: Sequence[int]) -> tuple[float, float]:
        """forward_costs(self.spec, new, cached), each forward computed once for a spec."""
        if self._forward_costs_of is not self.spec:  # the spec was replaced: what was kept is another model's
            self._forward_costs.clear()
            self._forward_costs_of = self.spec
        key = (tuple(new), tuple(cached))
        costs = self._forward_costs.get(key)
        if costs is None:
            if len(self._forward_costs) >= _FORWARD_COSTS_KEPT:
                self._forward_costs.clear()
            costs = self._forward_costs[key] = forward_costs(self.spec, new, cached)
        return costs

    # ------------------------------------------------------------------ decisions

    def decide(
        self,
        prefix_tokens: int,
        new_tokens: int = 1,
        *,
        load_nbytes: int | None = None,
        source: Source = "host",
        **renamed: bool,
    ) -> Decision:
        """Reload, layer-wise reload, split or recompute for a cached prefix of ``prefix_tokens`` and
        ``new_tokens`` (>= 1) to compute after it.

        ``load_nbytes``: the bytes a reload would move, when the engine knows them (whole
        blocks, a sliding window's ring); default ``spec.kv_bytes(prefix_tokens)``.
        ``source``: where the prefix is. "host" (the default): in this host's pool. "peer": held by another
        node: fetch (network read and reload, pipelined), split (compute the front while the rest is
        fetched) or recompute; ValueError when the planner has no network link. "disk": in the disk store
        (kvcopy.storage): the same three, the fetch reading the disk into the host pool (action "fetch").
        ``from_peer=True`` / ``from_disk=True``: deprecated spellings of ``source``.

        TypeError for a count that is not an int (100.0, True, "100"); ValueError for ``prefix_tokens +
        new_tokens`` beyond :meth:`max_sequence_tokens` (the model's context length).
        """
        source = _source_from_renamed(renamed, source, "Planner.decide")
        prefix_tokens = non_negative_int("prefix_tokens", prefix_tokens)
        new_tokens = _new_tokens(new_tokens)
        limit, said = self.max_sequence_tokens()
        if prefix_tokens + new_tokens > limit:
            raise ValueError(
                f"prefix_tokens + new_tokens: expected at most {limit} tokens ({said}), got "
                f"{_count_text(prefix_tokens)} + {_count_text(new_tokens)}"
            )
        if load_nbytes is not None:
            load_nbytes = non_negative_int("load_nbytes", load_nbytes)
            if load_nbytes > _MAX_LOAD_NBYTES:
                raise ValueError(
                    f"load_nbytes: expected at most {_MAX_LOAD_NBYTES} bytes, got {_count_text(load_nbytes)}"
                )
        elsewhere = source != "host"
        if elsewhere:
            self._fetch_line(source)  # the error, before any work, when there is no such line
        prefix = prefix_tokens
        extend = self.t_prefill(new_tokens, prefix)
        t_recompute = self.t_prefill(prefix + new_tokens)
        keep: Action = "fetch" if elsewhere else "reload"
        if prefix == 0:
            note = self._note("no cached prefix: compute")
            t_reload, t_fetch = (None, extend) if elsewhere else (extend, None)
            return Decision("recompute", 0, new_tokens, t_reload, t_recompute, None, 0, note, None, t_fetch)

        def load(nbytes: float) -> float:
            return self.t_fetch_nbytes(nbytes, source=source)[0] if elsewhere else self.t_load_nbytes(nbytes)

        nbytes = self.spec.kv_bytes(prefix) if load_nbytes is None else load_nbytes
        t_load, chunks = self.t_fetch_nbytes(nbytes, source=source) if elsewhere else (self.t_load_nbytes(nbytes), 0)
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
            self._explain(action, prefix, options, split, chunks, source),
            t_layerwise,
            options["fetch"] if elsewhere else None,
            chunks,
            t_load,
        )

    def max_sequence_tokens(self) -> tuple[int, str]:
        """(the most tokens a sequence may have, what that limit is): the model's context length
        (``spec.context_length``, its config's max_position_embeddings), else
        MAX_TOKENS_WITHOUT_CONTEXT_LENGTH."""
        if self.spec.context_length is not None:
            return self.spec.context_length, f"the context length of {self.spec.name}, max_position_embeddings"
        return MAX_TOKENS_WITHOUT_CONTEXT_LENGTH, (
            f"{self.spec.name}'s config gives no context length; the planner's limit without one"
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
        source: Source,
    ) -> str:
        rest = "the rest is fetched" if "fetch" in options else "the rest loads"
        what = {
            "split": f"split (compute the first {split[0] if split else 0} of {prefix} tokens while {rest})",
            "layerwise": "layer-wise reload",
            "fetch": f"fetch from the {source} ({'disk' if source == 'disk' else 'network'} read and reload, "
            f"pipelined in {chunks} chunk(s))",
        }.get(action, action)
        others = ", ".join(f"{name} {seconds_text(t)}" for name, t in options.items() if name != action)
        return self._note(f"{what}: {seconds_text(options[action])} vs {others} for {prefix} cached tokens")

    def threshold_tokens(
        self, new_tokens: int = 1, *, max_tokens: int | None = None, source: Source = "host", **renamed: bool
    ) -> int | None:
        """The smallest prefix P from which keeping the cache always pays: for every P' from P up to
        ``max_tokens`` (default: the longest prefix the model's context length leaves room for after
        ``new_tokens``, else DEFAULT_CONTEXT_TOKENS), ``decide``
        picks an option other than recompute (it beats recompute strictly; a split by the margin),
        with ``new_tokens`` to compute after it. None when recompute wins at ``max_tokens``.

        Evaluated on every length up to 4096 and on a geometric grid above (64 steps per
        doubling), then bisected between the last losing and the first winning length of the grid:
        exact unless the sign changes twice within one grid step. ``source``: where the prefix is (see
        :meth:`decide`); ``from_peer`` / ``from_disk``: its deprecated spellings. ValueError naming
        ``max_tokens`` when it is below 1 or leaves no room for ``new_tokens`` in :meth:`max_sequence_tokens`.
        """
        source = _source_from_renamed(renamed, source, "Planner.threshold_tokens")
        new_tokens = _new_tokens(new_tokens)
        most, said = self.max_sequence_tokens()
        room = most - new_tokens  # the longest prefix that leaves room for the new tokens
        if max_tokens is None:
            if room < 1:
                raise ValueError(f"new_tokens: expected fewer than {most} tokens ({said}), got {new_tokens}")
            limit = room if self.spec.context_length is not None else min(room, DEFAULT_CONTEXT_TOKENS)
        else:
            limit = positive_int("max_tokens", max_tokens)
            if limit > room:
                raise ValueError(
                    f"max_tokens: expected at most {room} (a prefix that leaves room for {new_tokens} new tokens "
                    f"in {most}: {said}), got {_count_text(limit)}"
                )
        return first_winning(lambda p: self.decide(p, new_tokens, source=source).action != "recompute", limit)

    # ------------------------------------------------------------------ deprecated spellings (0.1)

    load_alpha_s = property(lambda self: _renamed_part(self.load, "load_alpha_s", "Planner.load.alpha_s"))
    load_bytes_per_s = property(
        lambda self: _renamed_part(self.load, "load_bytes_per_s", "Planner.load.beta_bytes_per_s")
    )
    fetch_alpha_s = property(lambda self: _renamed_part(self.fetch, "fetch_alpha_s", "Planner.fetch.alpha_s"))
    fetch_bytes_per_s = property(
        lambda self: _renamed_part(self.fetch, "fetch_bytes_per_s", "Planner.fetch.beta_bytes_per_s")
    )
    disk_alpha_s = property(lambda self: _renamed_part(self.disk, "disk_alpha_s", "Planner.disk.alpha_s"))
    disk_bytes_per_s = property(
        lambda self: _renamed_part(self.disk, "disk_bytes_per_s", "Planner.disk.beta_bytes_per_s")
    )


# --------------------------------------------------------------------------- checks and deprecated spellings


def _given(fit: CostLine) -> CostLine:
    """A fitted line as the planner keeps it: its cost, not its quality."""
    return CostLine(fit.alpha_s, fit.beta_bytes_per_s)


def _check_line(name: str, line: CostLine | None) -> None:
    """TypeError unless ``line`` is a CostLine (or None); ValueError naming ``name`` for fixed seconds below 0
    (or NaN) or a rate that is not positive."""
    if line is None:
        return
    if not isinstance(line, CostLine):
        raise TypeError(f"{name}: expected a CostLine (or None), got {type(line).__name__}")
    if not line.alpha_s >= 0:
        raise ValueError(f"{name}: expected seconds >= 0, got {line.alpha_s}")
    if not line.beta_bytes_per_s > 0:
        raise ValueError(f"{name}: expected a positive rate, got {line.beta_bytes_per_s}")


def _as_line(option: object) -> CostLine:
    """A load option: a CostLine, or (deprecated) an (alpha_s, bytes_per_s) pair."""
    if isinstance(option, tuple) and len(option) == 2:
        warn_renamed("Planner(load_options=[(alpha_s, bytes_per_s)])", "load_options=[CostLine(...)]", stacklevel=4)
        return CostLine(float(option[0]), float(option[1]))
    return option  # type: ignore[return-value]  # _check_line says what it is when it is not a CostLine


def _lines_from_renamed(renamed: dict[str, Any], lines: dict[str, CostLine | None]) -> dict[str, CostLine | None]:
    """The cost lines, with any given by their 0.1 keywords (``load_alpha_s`` and ``load_bytes_per_s``, ...)."""
    unknown = set(renamed) - {name for pair in _RENAMED_LINES for name in pair}
    if unknown:
        raise TypeError(f"Planner: unexpected keyword argument(s) {sorted(unknown)}")
    for (alpha_name, beta_name), name in _RENAMED_LINES.items():
        alpha, beta = renamed.get(alpha_name), renamed.get(beta_name)
        if alpha is None and beta is None:
            continue
        warn_renamed(f"Planner({alpha_name}=..., {beta_name}=...)", f"Planner({name}=CostLine(...))", stacklevel=4)
        if alpha is None or beta is None:
            raise ValueError(f"{alpha_name} / {beta_name}: expected both (a cost line) or neither")
        if lines[name] is not None:
            raise TypeError(f"Planner: give {name} or {alpha_name} / {beta_name}, not both")
        lines[name] = CostLine(float(alpha), float(beta))
    return lines


def _new_tokens(new_tokens: object) -> int:
    """``new_tokens`` as an int >= 1: a resumed request computes at least the token it continues from."""
    count = non_negative_int("new_tokens", new_tokens)
    if count < 1:
        raise ValueError(
            f"new_tokens: a resumed request computes at least the token it continues from; "
            f"expected an int >= 1, got {new_tokens!r}"
        )
    return count


_DIGITS_PER_BIT = math.log10(2)


def _count_text(count: int) -> str:
    """``count`` as digits, or its size when it has too many to show (str() refuses past 4300 digits)."""
    return (
        str(count)
        if count.bit_length() <= 64
        else f"an int of about {math.ceil(count.bit_length() * _DIGITS_PER_BIT)} digits"
    )


def _source_from_renamed(renamed: dict[str, Any], source: Source, where: str, default: Source = "host") -> Source:
    """``source``, or what the deprecated ``from_peer`` / ``from_disk`` booleans say (``source`` left at its
    ``default``); TypeError for a source that is not a str, a flag that is not a bool or another keyword;
    ValueError for a source that is none of SOURCES."""
    unknown = set(renamed) - {"from_peer", "from_disk"}
    if unknown:
        raise TypeError(f"{where}: unexpected keyword argument(s) {sorted(unknown)}")
    if not isinstance(source, str):
        raise TypeError(f"source: expected one of {SOURCES}, got {type(source).__name__} {source!r:.80}")
    flagged = [name for name in ("from_peer", "from_disk") if name in renamed and boolean(name, renamed[name])]
    if renamed:
        warn_renamed(f"{where}(from_peer=..., from_disk=...)", f'{where}(source="peer" | "disk")', stacklevel=4)
    if len(flagged) == 2:
        raise ValueError("from_peer / from_disk: the prefix is on a peer or on the disk, not both")
    if flagged:
        if source != default:
            raise TypeError(f"{where}: give source or {flagged[0]}, not both")
        source = "peer" if flagged[0] == "from_peer" else "disk"
    if source not in SOURCES:
        raise ValueError(f"source: expected one of {SOURCES}, got {source!r}")
    return source


def _renamed_part(line: CostLine | None, old: str, new: str) -> float | None:
    warn_renamed(f"Planner.{old}", new, stacklevel=4)
    if line is None:
        return None
    return line.alpha_s if new.endswith("alpha_s") else line.beta_bytes_per_s
