"""The extra-config keys of kvcopy's vLLM offloading spec, read and checked before anything is built.

vLLM builds the spec in both roles (scheduler and worker), so a bad key fails
in both, at start-up, before any transfer.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from kvcopy._checks import path_argument
from kvcopy.agents.plan import DEFAULT_MAX_LEASED_FRACTION, DEFAULT_MAX_SESSION_FRACTION
from kvcopy.methods import METHODS  # the copy methods a TransferEngine accepts, besides "auto"

__all__ = ["AGENTS", "KEYS", "POLICIES", "ProfileNotFoundError", "SpecConfig", "read_config", "suggestion"]

Policy = Literal["auto", "offload"]
POLICIES: tuple[Policy, ...] = ("auto", "offload")
# kvcopy's own keys in kv_connector_extra_config; vLLM's (spec_name, blocks_per_chunk, eviction_policy, ...) pass
# through to vLLM.
KEYS = (
    "cpu_bytes_to_use",
    "kvcopy_policy",
    "kvcopy_profile",
    "kvcopy_method",
    "kvcopy_learn",
    "kvcopy_decode_share",
    "kvcopy_agents",
    "kvcopy_agent_max_leased_fraction",
    "kvcopy_agent_max_session_fraction",
    "kvcopy_agent_forecast",
)
Agents = Literal["auto", "off"]
AGENTS: tuple[Agents, ...] = ("auto", "off")
# A key that starts so (in any case) is meant for kvcopy: one that is not in KEYS is a typo, never ignored.
_KVCOPY_PREFIX = "kvcopy"


class ProfileNotFoundError(FileNotFoundError, ValueError):
    """``kvcopy_profile`` names no file: a missing file, and a bad configuration value."""


@dataclass(frozen=True)
class SpecConfig:
    """What the keys say. ``profile_path`` None: kvcopy's default profile. ``learn``: refine the profile from
    the engine's own transfers and steps (kvcopy.integrations.vllm.KVCopyOffloadingConnector). ``agents``: "auto"
    decides at each pause of a session that hints or is learned (kvcopy.integrations.vllm.agents.pauses), "off" never;
    the two fractions bound the leases; ``forecast_path``: where the gap forecaster is loaded from (when there)
    and saved to."""

    cpu_bytes_to_use: int
    policy: Policy = "auto"
    profile_path: str | None = None
    method: str = "auto"
    learn: bool = True
    decode_share: float = 0.0
    agents: Agents = "auto"
    max_leased_fraction: float = DEFAULT_MAX_LEASED_FRACTION
    max_session_fraction: float = DEFAULT_MAX_SESSION_FRACTION
    forecast_path: str | None = None


def suggestion(name: str, known: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the known name closest to ``name`` (case aside), or "" when none is close."""
    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def _check_key_names(extra: Mapping[Any, Any]) -> None:
    # vLLM's own keys pass through unread; a kvcopy_* key that is not one of kvcopy's would be ignored without
    # a word, so it is an error naming it
    def suffix(key: str) -> str:  # what follows "kvcopy_": the shared prefix would make every key look close
        return key.lower()[len(_KVCOPY_PREFIX) :].lstrip("_-")

    ours = {suffix(k): k for k in KEYS if k.startswith(_KVCOPY_PREFIX)}
    for key in extra:
        if isinstance(key, str) and key.lower().startswith(_KVCOPY_PREFIX) and key not in KEYS:
            close = difflib.get_close_matches(suffix(key), list(ours), n=1)
            hint = f" (did you mean {ours[close[0]]!r}?)" if close else ""
            raise ValueError(f"{key}: not a kvcopy extra-config key{hint}; kvcopy reads {', '.join(KEYS)}")


def _byte_count(extra: Mapping[Any, Any]) -> int:
    """``cpu_bytes_to_use`` as an int: a count of bytes, as vLLM's own CPU spec reads it (``int(value)``).
    A float is taken only when it is a whole number (vLLM's ``kv_offloading_size`` GiB x 2**30 is a float):
    0.5 is refused, never read as 0 bytes."""
    name = "cpu_bytes_to_use"
    if name not in extra:
        close = difflib.get_close_matches(name, [k for k in extra if isinstance(k, str)], n=1)
        typo = f" ({close[0]!r} is there: a typo?)" if close else ""
        raise ValueError(f"{name}: required in kv_connector_extra_config (the host bytes to offload to){typo}")
    size = extra[name]
    if isinstance(size, bool) or not isinstance(size, numbers.Real):
        raise TypeError(f"{name}: expected a number of bytes, got {type(size).__name__} {size!r}")
    if not isinstance(size, numbers.Integral):
        whole = float(size)  # a Real's float: an overflow is inf, refused below
        if not (math.isfinite(whole) and whole.is_integer()):
            raise ValueError(
                f"{name}: expected a whole number of bytes, got {size!r} (the key counts bytes, not GiB: "
                f"1 GiB is {2**30})"
            )
        size = whole
    if size <= 0:
        raise ValueError(f"{name}: expected a positive number of bytes, got {size!r}")
    return int(size)


def _choice(extra: Mapping[Any, Any], name: str, default: str, choices: Sequence[str]) -> str:
    """The str at ``name`` (``default`` when absent), one of ``choices``."""
    value = extra.get(name, default)
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {tuple(choices)}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}{suggestion(value, choices)}")
    return value


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected true or false, got {type(value).__name__} {value!r}")
    if value.lower() not in ("true", "false"):
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    return value.lower() == "true"


def _fraction(name: str, value: Any, *, whole: bool = False) -> float:
    """``value`` as a float in [0, 1) (the share of the link decode traffic keeps: all of it would leave loads
    nothing), or in [0, 1] with ``whole`` (a share of the host tier a lease may hold)."""
    span = "[0, 1]" if whole else "[0, 1)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a fraction in {span}, got {type(value).__name__} {value!r}")
    try:
        share = float(value)
    except OverflowError:  # an int beyond any float: out of range all the same
        share = math.inf
    if not (0 <= share <= 1 if whole else 0 <= share < 1):  # NaN fails too
        raise ValueError(f"{name}: expected a fraction in {span}, got {value!r:.80}")
    return share


def read_config(extra: Mapping[str, Any]) -> SpecConfig:
    """The spec's configuration from vLLM's ``kv_connector_extra_config``, every key checked before any is used.

    A value of the wrong type is a TypeError naming its key (``kvcopy_policy: 1``, ``kvcopy_method: null``,
    ``cpu_bytes_to_use: "lots"``); a wrong value a ValueError naming its key: ``cpu_bytes_to_use`` missing,
    not above 0 or not a whole number of bytes, an unknown ``kvcopy_policy`` or ``kvcopy_method``, a
    ``kvcopy_decode_share`` outside [0, 1), an agent fraction outside [0, 1], a ``kvcopy_agents`` other than
    "auto" or "off", a ``kvcopy_agent_forecast`` that is a directory, and a ``kvcopy_*`` key kvcopy does not
    read (a typo, never ignored). A ``kvcopy_profile`` that names no file is a :class:`ProfileNotFoundError` (a
    FileNotFoundError and a ValueError); one that names a directory a ValueError saying so.
    """
    if not isinstance(extra, Mapping):
        raise TypeError(f"kv_connector_extra_config: expected a mapping of keys, got {type(extra).__name__}")
    _check_key_names(extra)
    size = _byte_count(extra)
    policy = _choice(extra, "kvcopy_policy", "auto", POLICIES)
    method = _choice(extra, "kvcopy_method", "auto", ("auto", *sorted(METHODS)))
    path = extra.get("kvcopy_profile")
    if path is not None:
        path = os.fspath(path_argument("kvcopy_profile", path))
        if os.path.isdir(path):
            raise ValueError(
                f"kvcopy_profile: {path!r} is a directory; expected a profile's file (`kvcopy calibrate --out <file>`)"
            )
        if not os.path.isfile(path):
            raise ProfileNotFoundError(f"kvcopy_profile: no profile at {path!r} (write one with `kvcopy calibrate`)")
    share = _fraction("kvcopy_decode_share", extra.get("kvcopy_decode_share", 0.0))
    forecast = extra.get("kvcopy_agent_forecast")
    if forecast is not None:
        forecast = os.fspath(path_argument("kvcopy_agent_forecast", forecast))
        if os.path.isdir(forecast):
            raise ValueError(f"kvcopy_agent_forecast: {forecast!r} is a directory; name the forecaster's file")
    leased = "kvcopy_agent_max_leased_fraction"
    per_session = "kvcopy_agent_max_session_fraction"
    return SpecConfig(
        cpu_bytes_to_use=size,
        policy=cast(Policy, policy),
        profile_path=path,
        method=method,
        learn=_bool("kvcopy_learn", extra.get("kvcopy_learn", True)),
        decode_share=share,
        agents=cast(Agents, _choice(extra, "kvcopy_agents", "auto", AGENTS)),
        max_leased_fraction=_fraction(leased, extra.get(leased, DEFAULT_MAX_LEASED_FRACTION), whole=True),
        max_session_fraction=_fraction(per_session, extra.get(per_session, DEFAULT_MAX_SESSION_FRACTION), whole=True),
        forecast_path=forecast,
    )
