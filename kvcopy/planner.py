"""Planner: reload, recompute, or split — decided from measured costs (shared/DESIGN.md §1).

Costs, for a prefix of P tokens followed by n new tokens:

- reload:    ``t_load(P) + t_extend(P, n)``, with
  ``t_load(P) = load_alpha_s + kv_bytes(P) / (load_bytes_per_s * (1 - decode_share))``;
- recompute: ``t_prefill(P + n)``;
- split:     compute the first x tokens while the other P - x load, meeting in
  the middle (the Cake idea): ``max(t_prefill(x), t_load_part(P - x)) + t_extend(P, n)``
  at the best x.

``t_prefill`` is linear (``prefill_alpha_s + tokens / prefill_tokens_per_s``)
or, from FLOPs, ``prefill_alpha_s + prefill_flops(tokens, cached) / prefill_flops_per_s``,
which carries the quadratic attention term. ``decode_share`` is the fraction of
the link (or of the SMs, for the SM copy path) that running decode needs: a
reload gets only the rest, so it is chosen only when it wins without taking
that share away from more valuable decode work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Decision", "Planner", "DEFAULT_BLOCK_TOKENS"]

Action = Literal["reload", "recompute", "split"]
# Tokens per block when a profile is turned into load costs: the common paged-attention block.
DEFAULT_BLOCK_TOKENS = 16
# The threshold search gives up beyond this many tokens (no context is longer).
_MAX_TOKENS = 1 << 31


@dataclass(frozen=True)
class Decision:
    """What to do with a cached prefix, and the predicted seconds of each option."""

    action: Action
    prefix_tokens: int
    new_tokens: int
    t_reload: float
    t_recompute: float
    t_split: float | None  # None when the prefix is too short to split
    split_tokens: int  # tokens to compute in a split (the rest is loaded); 0 unless a split was possible
    explanation: str


class Planner:
    """Reload-vs-recompute decisions for one model (a ModelSpec) on one machine.

    Exactly one of ``prefill_tokens_per_s`` (linear prefill model) and
    ``prefill_flops_per_s`` (FLOPs model, via ``spec.prefill_flops``) must be given.
    """

    def __init__(
        self,
        spec: object,
        *,
        load_alpha_s: float,
        load_bytes_per_s: float,
        prefill_tokens_per_s: float | None = None,
        prefill_flops_per_s: float | None = None,
        prefill_alpha_s: float = 0.0,
        decode_share: float = 0.0,
    ) -> None:
        if (prefill_tokens_per_s is None) == (prefill_flops_per_s is None):
            raise ValueError("prefill_tokens_per_s / prefill_flops_per_s: expected exactly one of them")
        for name, value in (("load_bytes_per_s", load_bytes_per_s), ("prefill_tokens_per_s", prefill_tokens_per_s),
                            ("prefill_flops_per_s", prefill_flops_per_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name}: expected a positive rate, got {value}")
        for name, value in (("load_alpha_s", load_alpha_s), ("prefill_alpha_s", prefill_alpha_s)):
            if not value >= 0:
                raise ValueError(f"{name}: expected seconds >= 0, got {value}")
        if not 0 <= decode_share < 1:
            raise ValueError(f"decode_share: expected a fraction in [0, 1), got {decode_share}")
        self.spec = spec
        self.load_alpha_s = float(load_alpha_s)
        self.load_bytes_per_s = float(load_bytes_per_s)
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.prefill_flops_per_s = prefill_flops_per_s
        self.prefill_alpha_s = float(prefill_alpha_s)
        self.decode_share = float(decode_share)

    @classmethod
    def from_profile(
        cls,
        profile: object,
        spec: object,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        decode_share: float = 0.0,
    ) -> Planner:
        """Load costs from the profile's best host->device method (host->host on a CPU-only
        profile) at this model's plane-block size; prefill from its measured FLOP/s."""
        direction = "h2d" if "h2d" in profile.links else "h2h"
        if direction not in profile.links:
            raise ValueError(f"profile: no host->device or host->host measurements (has {sorted(profile.links)})")
        if profile.prefill is None:
            raise ValueError("profile: no prefill measurement")
        planes = spec.num_layers * (1 if spec.attention == "mla" else 2)
        plane_block = spec.block_nbytes(block_tokens) / planes
        nbytes = 64 * spec.block_nbytes(block_tokens)  # a 1024-token prefix: where the choice usually matters
        method = profile.fastest_method(direction, nbytes, plane_block)
        link = profile.links[direction][method].link_at(plane_block)
        return cls(
            spec,
            load_alpha_s=link.alpha_s,
            load_bytes_per_s=link.beta_bytes_per_s,
            prefill_flops_per_s=profile.prefill.flops_per_s,
            prefill_alpha_s=profile.prefill.alpha_s,
            decode_share=decode_share,
        )

    # ------------------------------------------------------------------ costs

    @property
    def _effective_bytes_per_s(self) -> float:
        return self.load_bytes_per_s * (1.0 - self.decode_share)

    def t_load(self, tokens: int) -> float:
        """Seconds to reload the KV of ``tokens`` prefix tokens (one call)."""
        return self.load_alpha_s + self.spec.kv_bytes(tokens) / self._effective_bytes_per_s

    def t_prefill(self, tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to compute ``tokens`` new tokens after ``cached_tokens`` already in the cache."""
        if tokens <= 0:
            return 0.0
        if self.prefill_tokens_per_s is not None:
            return self.prefill_alpha_s + tokens / self.prefill_tokens_per_s
        return self.prefill_alpha_s + self.spec.prefill_flops(tokens, cached_tokens) / self.prefill_flops_per_s

    def _t_load_rest(self, prefix: int, computed: int) -> float:
        """Seconds to load the prefix's tokens after the first ``computed``."""
        rest_bytes = self.spec.kv_bytes(prefix) - self.spec.kv_bytes(computed)
        return self.load_alpha_s + rest_bytes / self._effective_bytes_per_s

    def _t_split(self, prefix: int, computed: int) -> float:
        """Compute the first ``computed`` tokens while the rest of the prefix loads."""
        return max(self.t_prefill(computed), self._t_load_rest(prefix, computed))

    def _best_split(self, prefix: int) -> tuple[int, float] | None:
        """The x in [1, prefix - 1] minimising the split time.

        Computing x tokens takes longer as x grows and loading the rest shorter,
        so the best x is where the two cross: the first x at which computing is
        no faster, or the one before it.
        """
        if prefix < 2:
            return None
        lo, hi = 1, prefix - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.t_prefill(mid) >= self._t_load_rest(prefix, mid):
                hi = mid
            else:
                lo = mid + 1
        best = min({max(1, lo - 1), lo}, key=lambda x: self._t_split(prefix, x))
        return best, self._t_split(prefix, best)

    # ------------------------------------------------------------------ decisions

    def t_load_nbytes(self, nbytes: int) -> float:
        """Seconds to reload ``nbytes`` of KV (one call), for an engine that knows the bytes it moves."""
        return self.load_alpha_s + nbytes / self._effective_bytes_per_s

    def decide(self, prefix_tokens: int, new_tokens: int = 0, *, load_nbytes: int | None = None) -> Decision:
        """Reload, recompute or split for a cached prefix of ``prefix_tokens`` and ``new_tokens`` to add.

        ``load_nbytes``: the bytes a reload would move, when the engine knows them (whole
        blocks, a sliding window's ring); default ``spec.kv_bytes(prefix_tokens)``.
        """
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ValueError(f"prefix_tokens: expected an int >= 0, got {prefix_tokens!r}")
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 0:
            raise ValueError(f"new_tokens: expected an int >= 0, got {new_tokens!r}")
        if load_nbytes is not None and (isinstance(load_nbytes, bool) or not isinstance(load_nbytes, int)
                                        or load_nbytes < 0):
            raise ValueError(f"load_nbytes: expected an int >= 0 or None, got {load_nbytes!r}")
        extend = self.t_prefill(new_tokens, prefix_tokens)
        t_recompute = self.t_prefill(prefix_tokens + new_tokens)
        if not prefix_tokens:
            t_load = 0.0
        else:
            t_load = self.t_load(prefix_tokens) if load_nbytes is None else self.t_load_nbytes(load_nbytes)
        t_reload = t_load + extend
        split = self._best_split(prefix_tokens)
        t_split = split[1] + extend if split else None
        options = {"reload": t_reload, "recompute": t_recompute}
        if t_split is not None and t_split < min(t_reload, t_recompute):
            options["split"] = t_split
        action: Action = min(options, key=options.get)  # type: ignore[arg-type]
        if prefix_tokens == 0:
            action = "recompute"
        explanation = self._explain(action, prefix_tokens, t_reload, t_recompute, t_split, split)
        return Decision(
            action=action, prefix_tokens=prefix_tokens, new_tokens=new_tokens, t_reload=t_reload,
            t_recompute=t_recompute, t_split=t_split, split_tokens=split[0] if split else 0, explanation=explanation,
        )

    def _explain(self, action: str, prefix: int, t_reload: float, t_recompute: float, t_split: float | None,
                 split: tuple[int, float] | None) -> str:
        us = 1e6
        if prefix == 0:
            return "no cached prefix: compute"
        if action == "split":
            return (f"split: compute the first {split[0]} of {prefix} tokens while loading the rest, "
                    f"{t_split * us:.0f} us vs reload {t_reload * us:.0f} us and recompute {t_recompute * us:.0f} us")
        other = "recompute" if action == "reload" else "reload"
        mine, theirs = (t_reload, t_recompute) if action == "reload" else (t_recompute, t_reload)
        return f"{action}: {mine * us:.0f} us vs {other} {theirs * us:.0f} us for {prefix} cached tokens"

    def threshold_tokens(self) -> int | None:
        """The smallest prefix length n with ``t_reload(n) < t_recompute(n)`` strictly.

        None if no length up to 2^31 tokens qualifies; 1 if reloading always
        wins. With a linear prefill model and no sliding-window layers this is
        the closed form ``ceil((load_alpha_s - prefill_alpha_s) / (1/prefill_tokens_per_s
        - kv_bytes_per_token/load_bytes_per_s))`` (where that denominator is
        positive; at an exact integer tie the strict inequality needs one more
        token). Otherwise a search over n, assuming reload(n) - recompute(n)
        changes sign at most once beyond the first length where reload wins.
        """

        def reload_wins(n: int) -> bool:
            return self.t_load(n) < self.t_prefill(n)

        if reload_wins(1):
            return 1
        hi = 2
        while not reload_wins(hi):
            if hi >= _MAX_TOKENS:
                return None
            hi *= 2
        lo = hi // 2  # reload loses at lo, wins at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if reload_wins(mid) else (mid, hi)
        return hi
