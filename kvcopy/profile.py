"""Profile: what the calibrator measured on one machine, as JSON on disk.

Per direction ("d2h", "h2d", "h2h", "d2d") and method: the fit
``t = alpha + bytes / beta`` over all of that method's points, fits per
plane-block size (small pages move slower, so predictions use the fit of the
nearest measured block size), the raw points, and the contiguous-copy peak of
the link. Plus the machine's prefill throughput and the hardware identity.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from kvcopy._checks import Described, FileFormatError, path_argument, writable_file_path
from kvcopy._version import warn_renamed

__all__ = [
    "DEFAULT_PROFILE_PATH",
    "DISK_METHOD",
    "DISK_READ_DIRECTION",
    "DISK_WRITE_DIRECTION",
    "PER_SIZE_JUDGED_DIRECTIONS",
    "POOR_FIT_R2",
    "POOR_FIT_RESIDUAL",
    "REMOTE_DIRECTION",
    "CostLine",
    "MethodProfile",
    "PrefillProfile",
    "Profile",
    "default_profile",
    "direction_of",
    "fit_problems",
    "set_default_profile",
]

# The file format Profile.save writes: 2 keys the fits by "directions" (format 1 called them "links"; read too).
PROFILE_FORMAT = 2
_READABLE_FORMATS = (1, 2)
# The direction of the network link to a peer: its pool read into this host's (kvcopy.calibration.network).
REMOTE_DIRECTION = "r2h"
# The disk's directions (kvcopy.calibration.disk, `kvcopy calibrate --disk`): host to file (a put), file to
# host (a get).
DISK_WRITE_DIRECTION, DISK_READ_DIRECTION = "h2f", "f2h"
# The method of the disk's fits: the disk store's reads and writes through NIXL's POSIX backend.
DISK_METHOD = "nixl_posix"
DEFAULT_PROFILE_PATH = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcopy" / "profile.json"


@dataclass(frozen=True)
class CostLine:
    """kvcopy's one cost line: ``seconds = alpha_s + nbytes / beta_bytes_per_s``, a fixed cost per call and a
    rate. A fitted line says how well it fit its points (``r2``, and ``max_abs_residual``: the largest
    ``|measured - predicted| / predicted``); a line given by hand keeps the defaults (1.0 and 0.0)."""

    alpha_s: float
    beta_bytes_per_s: float
    r2: float = 1.0
    max_abs_residual: float = 0.0

    def predict(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_per_s


@dataclass
class MethodProfile:
    """One method in one direction."""

    fit: CostLine
    by_block_nbytes: dict[int, CostLine] = field(default_factory=dict)
    # [total bytes, num_blocks, plane-block bytes, median s, p20 s, p80 s] per measured shape
    points: list[list[float]] = field(default_factory=list)

    def line_at(self, block_nbytes: float | None) -> CostLine:
        """The fit for plane-blocks of ``block_nbytes``, interpolated from the per-size fits.

        Each measured size gives a fixed cost alpha and a per-plane-block cost
        ``c = size / beta``. Both are made non-decreasing in the size (a bigger
        block never copies faster or cheaper than a smaller one; noise aside)
        and interpolated linearly between measured sizes; beyond them alpha is
        the nearest size's and c scales with the bytes. At a measured size this
        is that size's fit (when already monotone), and predictions grow with
        the bytes at any block count.
        """
        if not self.by_block_nbytes or not block_nbytes:
            return self.fit
        sizes = sorted(self.by_block_nbytes)
        alphas, costs, max_alpha, max_cost = [], [], 0.0, 0.0
        for size in sizes:
            fit = self.by_block_nbytes[size]
            max_alpha, max_cost = max(max_alpha, fit.alpha_s), max(max_cost, size / fit.beta_bytes_per_s)
            alphas.append(max_alpha)
            costs.append(max_cost)
        if block_nbytes <= sizes[0]:
            alpha, cost = alphas[0], block_nbytes / sizes[0] * costs[0]
        elif block_nbytes >= sizes[-1]:
            alpha, cost = alphas[-1], block_nbytes / sizes[-1] * costs[-1]
        else:
            hi = next(i for i, size in enumerate(sizes) if size >= block_nbytes)
            w = (block_nbytes - sizes[hi - 1]) / (sizes[hi] - sizes[hi - 1])
            alpha = alphas[hi - 1] + w * (alphas[hi] - alphas[hi - 1])
            cost = costs[hi - 1] + w * (costs[hi] - costs[hi - 1])
        nearest = self.by_block_nbytes[min(sizes, key=lambda size: abs(size - block_nbytes))]
        return CostLine(
            alpha_s=alpha,
            beta_bytes_per_s=block_nbytes / cost,
            r2=nearest.r2,
            max_abs_residual=nearest.max_abs_residual,
        )

    def link_at(self, block_nbytes: float | None) -> CostLine:
        """Deprecated: :meth:`line_at`."""
        warn_renamed("MethodProfile.link_at", "MethodProfile.line_at")
        return self.line_at(block_nbytes)

    def predict(self, nbytes: float, block_nbytes: float | None = None) -> float:
        """Seconds for ``nbytes`` moved as plane-blocks of ``block_nbytes`` (None: the overall fit)."""
        return self.line_at(block_nbytes).predict(nbytes)


@dataclass(frozen=True)
class PrefillProfile:
    """A roofline for prefill-shaped work of ``model``, per forward of k requests:
    ``alpha_s + (k - 1) * extra_request_s + max(flops / flops_per_s, weight_bytes / weight_bytes_per_s)``.

    ``alpha_s``: the fixed seconds of a forward of ``num_layers`` layers (the
    fit's intercept). ``weight_bytes_per_s``: how fast a forward of a few
    tokens reads its weights; None in profiles written before it was measured
    (the planner then has no memory-bound floor). ``num_layers``: the layer
    count the fixed cost is for (None in older profiles: not scaled).
    ``extra_request_s``: what each request beside the first adds to a
    batched forward (the engine's work per sequence); 0 where only
    single-request forwards were measured, as the calibrator's are.
    """

    model: str
    alpha_s: float
    flops_per_s: float
    r2: float
    points: tuple[tuple[float, float], ...] = ()  # (flops, seconds)
    weight_bytes_per_s: float | None = None
    num_layers: int | None = None
    extra_request_s: float = 0.0

    def alpha_for(self, model: str, num_layers: int) -> float:
        """The fixed seconds of one forward of ``num_layers`` layers of ``model``: ``alpha_s`` for the model it
        was measured on (or a profile without a layer count), else scaled per layer."""
        if model == self.model or not self.num_layers:
            return self.alpha_s
        return self.alpha_s * num_layers / self.num_layers


@dataclass(init=False)
class Profile:
    """Calibration results; see the module docstring. Save with :meth:`save`, read with :meth:`load`.

    ``hardware``: the machine it was measured on (kvcopy.calibration.machine) and the calibration's settings.
    ``directions``: per direction ("d2h", "h2d", "h2h", "d2d", "r2h", "h2f", "f2h"), per method, its fits.
    ``peaks``: per direction, the contiguous-copy bytes/s (the limit a method is judged against).
    ``prefill``: the prefill's measured throughput, or None.
    ``links``: deprecated spelling of ``directions``.
    """

    hardware: dict[str, Any]
    directions: dict[str, dict[str, MethodProfile]]
    peaks: dict[str, float]  # direction -> contiguous-copy bytes/s
    prefill: PrefillProfile | None

    def __init__(
        self,
        hardware: dict[str, Any],
        directions: dict[str, dict[str, MethodProfile]] | None = None,
        peaks: dict[str, float] | None = None,
        prefill: PrefillProfile | None = None,
        *,
        links: dict[str, dict[str, MethodProfile]] | None = None,
    ) -> None:
        if links is not None:
            warn_renamed("Profile(links=...)", "Profile(directions=...)")
            if directions is not None:
                raise TypeError("Profile: give directions (or its deprecated spelling links), not both")
            directions = links
        self.hardware = hardware
        self.directions = {} if directions is None else directions
        self.peaks = {} if peaks is None else peaks
        self.prefill = prefill

    @property
    def links(self) -> dict[str, dict[str, MethodProfile]]:
        """Deprecated: :attr:`directions`."""
        warn_renamed("Profile.links", "Profile.directions")
        return self.directions

    def methods(self, direction: str) -> list[str]:
        return sorted(self.directions.get(direction, {}))

    def _measured(self, direction: str) -> dict[str, MethodProfile]:
        measured = self.directions.get(direction)
        if not measured:
            raise ValueError(f"direction: no measurements for {direction!r}; measured: {sorted(self.directions)}")
        return measured

    def _plane_block(self, nbytes: float, num_blocks: int, planes: int | None) -> float:
        """Bytes of one plane-block: a block's bytes over its planes (default: the calibration's)."""
        return nbytes / max(num_blocks, 1) / (planes or self.hardware.get("calibration_planes", 1))

    def predict(
        self,
        direction: str,
        nbytes: float,
        *,
        num_blocks: int = 1,
        method: str | None = None,
        planes: int | None = None,
    ) -> float:
        """Predicted seconds to move ``nbytes`` in ``num_blocks`` blocks; ``method=None``: the best measured one.

        ``planes``: how many planes a block spans in your cache (default: the
        calibration's), which sets the plane-block size whose fits apply.
        """
        measured = self._measured(direction)
        if method is not None and method not in measured:
            raise ValueError(f"method: {method!r} was not measured for {direction}; measured: {sorted(measured)}")
        plane_block = self._plane_block(nbytes, num_blocks, planes)
        return min(measured[m].predict(nbytes, plane_block) for m in ([method] if method else measured))

    def best_method(
        self,
        direction: str,
        block_nbytes: int,
        num_blocks: int,
        *,
        planes: int | None = None,
        candidates: Sequence[str] | None = None,
    ) -> str | None:
        """The measured method (among ``candidates``, default all) predicted fastest for ``num_blocks`` blocks
        of ``block_nbytes`` (all planes; ``planes`` per block, default the calibration's); None when none of
        the candidates was measured. ValueError when ``direction`` was never measured."""
        nbytes = block_nbytes * num_blocks
        return self._fastest(direction, nbytes, self._plane_block(nbytes, num_blocks, planes), candidates)

    def fastest_method(
        self, direction: str, nbytes: float, plane_block_nbytes: float, candidates: list[str] | None = None
    ) -> str | None:
        """Deprecated: :meth:`best_method`, which takes blocks as every other Profile method does."""
        warn_renamed("Profile.fastest_method(direction, nbytes, plane_block_nbytes)", "Profile.best_method")
        return self._fastest(direction, nbytes, plane_block_nbytes, candidates)

    def _fastest(
        self, direction: str, nbytes: float, plane_block_nbytes: float, candidates: Sequence[str] | None
    ) -> str | None:
        measured = self._measured(direction)
        names = [m for m in measured if candidates is None or m in candidates]
        return min(names, key=lambda m: measured[m].predict(nbytes, plane_block_nbytes)) if names else None

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "hardware": self.hardware,
            "peaks": self.peaks,
            "directions": {
                direction: {
                    method: {
                        "fit": asdict(mp.fit),
                        "by_block_nbytes": {str(b): asdict(f) for b, f in mp.by_block_nbytes.items()},
                        "points": mp.points,
                    }
                    for method, mp in methods.items()
                }
                for direction, methods in self.directions.items()
            },
            "prefill": None if self.prefill is None else asdict(self.prefill),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, file: str | os.PathLike[str] = "<profile dict>") -> Profile:
        """The Profile ``data`` (a :meth:`to_dict`) describes: format 2, or format 1 (its fits keyed "links").
        Every field is checked: FileFormatError (a ValueError) naming ``file``, the field, what was expected and
        what was found, for the first that is not what :meth:`save` writes (a missing or unknown field, a wrong
        type, a number that is not finite, or negative or 0 where it cannot be)."""
        return _ProfileReader(file).profile(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the profile as JSON at ``path`` (its folders made). TypeError naming ``path`` unless it is a
        path; ValueError, before anything is written, for a profile that :meth:`load` would refuse, and for a
        ``path`` that cannot be written: a directory, one under a file (named), or one without permission."""
        path = path_argument("path", path)
        data = self.to_dict()
        try:
            _ProfileReader("the profile to save").profile(json.loads(json.dumps(data)))
        except FileFormatError as err:
            raise ValueError(f"Profile.save: would not load back from {path}: {err}") from None
        writable_file_path("path", path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """The profile saved at ``path``. TypeError naming ``path`` unless it is a path; FileNotFoundError when
        there is no file; OSError (naming the file) when it cannot be read; FileFormatError (a ValueError)
        naming the file, the field, what was expected and what was found when it is not a profile: not JSON,
        or any field missing, unknown, of the wrong type or out of range (see :meth:`from_dict`)."""
        path = path_argument("path", path)
        if path.is_dir():
            raise FileFormatError(
                path, "(the file)", "a profile JSON file (kvcopy calibrate --out)", Described("a directory")
            )
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"profile: no file at {path} (run `kvcopy calibrate --out {path}`)") from None
        except OSError as err:
            raise type(err)(err.errno, f"profile: cannot read {path}: {err.strerror}") from None
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as err:
            found = f"{err.msg} at line {err.lineno} column {err.colno}"
            raise FileFormatError(path, "(the file)", "a profile in JSON", Described(found)) from None
        except (ValueError, RecursionError) as err:  # not UTF-8; an int of too many digits; nested too deep
            raise FileFormatError(
                path, "(the file)", "a profile in JSON", Described(f"{type(err).__name__}: {err}")
            ) from None
        return cls.from_dict(data, file=path)


# --------------------------------------------------------------------------- reading a profile's JSON

# The top-level fields of a profile file (besides its fits, keyed "directions" in format 2, "links" in format 1).
_TOP_FIELDS = ("format", "hardware", "peaks", "prefill")
_COST_LINE_FIELDS = ("alpha_s", "beta_bytes_per_s", "r2", "max_abs_residual")
_METHOD_FIELDS = ("fit", "by_block_nbytes", "points")
_PREFILL_FIELDS = (
    "model",
    "alpha_s",
    "flops_per_s",
    "r2",
    "points",
    "weight_bytes_per_s",
    "num_layers",
    "extra_request_s",
)
# Values of a point: a copy's [bytes, blocks, plane-block bytes, median s, p20 s, p80 s]; prefill's (flops, s).
_COPY_POINT_WIDTH, _PREFILL_POINT_WIDTH = 6, 2
# A per-size fit's key: a plane-block size in bytes, written in decimal (at most 19 digits: an int64).
_BLOCK_SIZE_KEY = re.compile(r"[1-9][0-9]{0,18}")

# What a number of a profile must be: the words an error says, and the test.
_Rule = tuple[str, Callable[[float], bool]]
_NON_NEGATIVE: _Rule = ("a finite number >= 0", lambda x: x >= 0)
_POSITIVE: _Rule = ("a finite number > 0", lambda x: x > 0)
_FIT_QUALITY: _Rule = ("a finite number <= 1 (R^2)", lambda x: x <= 1)


class _ProfileReader:
    """Builds a Profile from the JSON document of ``file``, checking every field on the way: a FileFormatError
    naming the file, the field's path (``directions.h2d.cuda.fit.alpha_s``), what was expected and what was
    found, for the first field that is not what Profile.save writes."""

    def __init__(self, file: str | os.PathLike[str]) -> None:
        self.file = file

    def fail(self, at: str, expected: str, found: object) -> NoReturn:
        raise FileFormatError(self.file, at or "(top level)", expected, found)

    def fields(self, value: object, at: str, allowed: Sequence[str], required: Sequence[str] = ()) -> Mapping[str, Any]:
        """``value`` as an object holding every ``required`` field and no field outside ``allowed``."""
        if not isinstance(value, Mapping):
            self.fail(at, "an object", value)
        for name in value:
            if name not in allowed:
                self.fail(at, f"only the fields {', '.join(allowed)}", name)
        for name in required:
            if name not in value:
                self.fail(_join(at, name), "a value", Described("nothing: the field is missing"))
        return value

    def mapping(self, value: object, at: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            self.fail(at, "an object", value)
        return value

    def number(self, value: object, at: str, rule: _Rule) -> float:
        expected, holds = rule
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(at, expected, value)
        try:
            number = float(value)
        except OverflowError:  # an int beyond any float
            self.fail(at, expected, value)
        if not (math.isfinite(number) and holds(number)):
            self.fail(at, expected, value)
        return number

    def count(self, value: object, at: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(at, "an int >= 1", value)
        return value

    def rows(self, value: object, at: str, width: int) -> list[list[float]]:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            self.fail(at, f"a list of points ({width} numbers each)", value)
        rows = []
        for i, row in enumerate(value):
            where = f"{at}[{i}]"
            if isinstance(row, (str, bytes, Mapping)) or not isinstance(row, Sequence) or len(row) != width:
                self.fail(where, f"a point of {width} numbers", row)
            rows.append([self.number(x, f"{where}[{j}]", _NON_NEGATIVE) for j, x in enumerate(row)])
        return rows

    def cost_line(self, value: object, at: str) -> CostLine:
        doc = self.fields(value, at, _COST_LINE_FIELDS, required=("alpha_s", "beta_bytes_per_s"))
        return CostLine(
            alpha_s=self.number(doc["alpha_s"], _join(at, "alpha_s"), _NON_NEGATIVE),
            beta_bytes_per_s=self.number(doc["beta_bytes_per_s"], _join(at, "beta_bytes_per_s"), _POSITIVE),
            r2=self.number(doc.get("r2", 1.0), _join(at, "r2"), _FIT_QUALITY),
            max_abs_residual=self.number(
                doc.get("max_abs_residual", 0.0), _join(at, "max_abs_residual"), _NON_NEGATIVE
            ),
        )

    def method(self, value: object, at: str) -> MethodProfile:
        doc = self.fields(value, at, _METHOD_FIELDS, required=("fit",))
        by_size = {}
        sizes_at = _join(at, "by_block_nbytes")
        for key, line in self.mapping(doc.get("by_block_nbytes", {}), sizes_at).items():
            if not _BLOCK_SIZE_KEY.fullmatch(key):
                self.fail(_join(sizes_at, key), "a plane-block size in bytes (a positive int) as the key", key)
            by_size[int(key)] = self.cost_line(line, _join(sizes_at, key))
        points = self.rows(doc.get("points", []), _join(at, "points"), _COPY_POINT_WIDTH)
        return MethodProfile(fit=self.cost_line(doc["fit"], _join(at, "fit")), by_block_nbytes=by_size, points=points)

    def prefill(self, value: object, at: str) -> PrefillProfile | None:
        if value is None:
            return None
        doc = self.fields(value, at, _PREFILL_FIELDS, required=("model", "alpha_s", "flops_per_s", "r2"))
        if not isinstance(doc["model"], str):
            self.fail(_join(at, "model"), "a model name (a string)", doc["model"])
        weight_rate, layers = doc.get("weight_bytes_per_s"), doc.get("num_layers")
        return PrefillProfile(
            model=doc["model"],
            alpha_s=self.number(doc["alpha_s"], _join(at, "alpha_s"), _NON_NEGATIVE),
            flops_per_s=self.number(doc["flops_per_s"], _join(at, "flops_per_s"), _POSITIVE),
            r2=self.number(doc["r2"], _join(at, "r2"), _FIT_QUALITY),
            points=tuple(
                (flops, seconds)
                for flops, seconds in self.rows(doc.get("points", []), _join(at, "points"), _PREFILL_POINT_WIDTH)
            ),
            weight_bytes_per_s=None
            if weight_rate is None
            else self.number(weight_rate, _join(at, "weight_bytes_per_s"), _POSITIVE),
            num_layers=None if layers is None else self.count(layers, _join(at, "num_layers")),
            extra_request_s=self.number(doc.get("extra_request_s", 0.0), _join(at, "extra_request_s"), _NON_NEGATIVE),
        )

    def profile(self, data: object) -> Profile:
        if not isinstance(data, Mapping):
            self.fail("", "a profile (a JSON object)", data)
        version = data.get("format")
        if isinstance(version, bool) or not isinstance(version, int) or version not in _READABLE_FORMATS:
            self.fail(
                "format",
                f"{PROFILE_FORMAT} (or 1)",
                Described("nothing: the field is missing") if version is None else version,
            )
        fits_key = "directions" if version >= 2 else "links"
        doc = self.fields(data, "", (*_TOP_FIELDS, fits_key), required=("format", "hardware", fits_key))
        hardware = self.mapping(doc["hardware"], "hardware")
        if "calibration_planes" in hardware:
            self.count(hardware["calibration_planes"], "hardware.calibration_planes")
        peaks = {
            direction: self.number(rate, _join("peaks", direction), _POSITIVE)
            for direction, rate in self.mapping(doc.get("peaks", {}), "peaks").items()
        }
        directions = {
            direction: {
                method: self.method(mp, _join(fits_key, direction, method))
                for method, mp in self.mapping(methods, _join(fits_key, direction)).items()
            }
            for direction, methods in self.mapping(doc[fits_key], fits_key).items()
        }
        return Profile(
            hardware=dict(hardware),
            directions=directions,
            peaks=peaks,
            prefill=self.prefill(doc.get("prefill"), "prefill"),
        )


def _join(*parts: str) -> str:
    """A field's path: the non-empty parts joined by dots."""
    return ".".join(part for part in parts if part)


# A fit is poor when it explains its points this badly: R^2 below this, or a measured point this far (relative)
# from the line. What they catch is contention (seen: R^2 0.53, a point 209x off).
POOR_FIT_R2 = 0.8
POOR_FIT_RESIDUAL = 1.5
# Methods whose fit is not judged: the "torch" reference loop is not linear in the bytes even on an idle
# machine (its index_select temporaries fault pages in: R^2 0.75-0.85 seen on the CPU VM).
UNJUDGED_METHODS = ("torch",)
# Directions judged by their fit per block size instead of the line over all sizes: the link to a peer
# (kvcopy.calibration.network) and the disk (kvcopy.calibration.disk), where each range is one descriptor with
# its own fixed cost, so the time per byte depends on the range size by design and one line through every size does not
# describe it.
PER_SIZE_JUDGED_DIRECTIONS = (REMOTE_DIRECTION, DISK_WRITE_DIRECTION, DISK_READ_DIRECTION)


def fit_problems(profile: Profile) -> list[str]:
    """The fits of ``profile`` that are poor (POOR_FIT_R2, POOR_FIT_RESIDUAL; not UNJUDGED_METHODS), described;
    [] when none is."""
    problems = []
    for direction, methods in sorted(profile.directions.items()):
        for method, mp in sorted(methods.items()):
            if method in UNJUDGED_METHODS:
                continue
            fits = {"": mp.fit}
            if direction in PER_SIZE_JUDGED_DIRECTIONS and mp.by_block_nbytes:
                fits = {f" {size} B ranges": fit for size, fit in sorted(mp.by_block_nbytes.items())}
            for where, fit in fits.items():
                if fit.r2 < POOR_FIT_R2 or fit.max_abs_residual > POOR_FIT_RESIDUAL:
                    problems.append(
                        f"{direction} {method}{where}: R^2 {fit.r2:.3f}, max resid {fit.max_abs_residual:.0%}"
                    )
    if profile.prefill is not None and profile.prefill.r2 < POOR_FIT_R2:
        problems.append(f"prefill: R^2 {profile.prefill.r2:.3f}")
    return problems


def direction_of(src_device_type: str, dst_device_type: str) -> str:
    """ "d2h", "h2d", "h2h" or "d2d" for a pair of device types."""
    side = {"cpu": "h"}
    return f"{side.get(src_device_type, 'd')}2{side.get(dst_device_type, 'd')}"


_default: dict[str, Profile | None] = {}
# Bumped whenever the default profile changes, so choices cached from the old one are dropped (kvcopy.dispatch).
_default_generation = [0]


def default_profile_generation() -> int:
    """A number that changes whenever :func:`set_default_profile` is called."""
    return _default_generation[0]


def set_default_profile(profile: Profile | None) -> None:
    """The profile ``method="auto"`` consults when no engine-specific one is given (None: none)."""
    _default["profile"] = profile
    _default_generation[0] += 1


def default_profile() -> Profile | None:
    """The default profile: set_default_profile's, else KVCOPY_PROFILE (a path, or "none"), else
    DEFAULT_PROFILE_PATH if it exists. Read once."""
    if "profile" not in _default:
        where = os.environ.get("KVCOPY_PROFILE")
        if where == "none":
            _default["profile"] = None
        else:
            path = Path(where) if where else DEFAULT_PROFILE_PATH
            try:
                _default["profile"] = Profile.load(path) if path.exists() else None
            except (ValueError, OSError) as err:  # unreadable, or not a profile: the documented defaults apply
                warnings.warn(f"kvcopy: ignoring the profile at {path}: {err}", stacklevel=2)
                _default["profile"] = None
    return _default["profile"]


def __getattr__(name: str) -> Any:
    if name == "LinkFit":  # renamed in 0.2.0
        warn_renamed("kvcopy.profile.LinkFit", "kvcopy.profile.CostLine")
        return CostLine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
