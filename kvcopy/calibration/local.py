"""The calibrator: measures this machine's copy costs and prefill throughput into a Profile.

For each direction (device->host and host->device on a GPU, host->host on the
CPU) and each method that can run, it times block copies over a sweep of
shapes — plane-block sizes x block counts, from one small block to hundreds of
MB — with kvcopy.calibration.timing (CUDA events on a GPU, perf_counter on the CPU;
warm-up, repeats, median and spread), and fits ``t = alpha + bytes / beta``
robustly (kvcopy.calibration.fit), overall and per block size. It also measures the
contiguous-copy peak of the link, and the sustained throughput of a real
prefill-shaped layer (projections, causal attention, gated MLP) of a model,
timed over several token counts and fitted the same way.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcopy import _ext
from kvcopy.calibration.fit import LinearFit, fit_alpha_beta
from kvcopy.calibration.machine import machine_identity
from kvcopy.calibration.progress import ProgressBar, progress_bar
from kvcopy.calibration.timing import COLD_BYTES, measure
from kvcopy.host.pool import HostKVPool
from kvcopy.layout import PagedKV
from kvcopy.ops import available_methods, copy_blocks
from kvcopy.profile import CostLine, MethodProfile, PrefillProfile, Profile

if TYPE_CHECKING:
    from kvcopy.model.spec import ModelSpec

__all__ = ["CALIBRATION_PLANES", "DEFAULT_MODEL", "calibrate", "fit_lines"]

# Planes of the synthetic cache: enough that per-plane costs show, as in a real
# cache (a llama8b cache has 64), while keeping the largest shapes small.
CALIBRATION_PLANES = 16
# The model whose layer shape times prefill unless another is given.
DEFAULT_MODEL = "llama-3.1-8b"
# Each side of a calibration pair holds at least kvcopy.calibration.timing.COLD_BYTES, and
# successive timed calls copy different blocks. Distinct id sets cycled through
# by the timed calls of one shape: at least this many, and enough that together
# they cover COLD_BYTES, so a small copy's repeats do not find their blocks in cache.
_MIN_ID_SETS = 16
_MAX_ID_SETS = 4096
# A prefill fit missing a point by more than this (relative) is timed again.
PREFILL_REFIT_RESIDUAL = 0.1
# Token counts timed for prefill's memory-bound floor: forwards this short read all their weights and
# compute almost nothing, so their time is the fixed cost plus the weight reads.
PREFILL_FLOOR_TOKENS = (1, 4)
# Rounds over every prefill token count, each count's time its fastest round: interleaved, a busy spell
# slows one round of every count instead of every repeat of one, and the minimum drops it.
PREFILL_ROUNDS = 2
# A token count whose forward takes this many times the few-token floor is past the roofline knee.
PREFILL_COMPUTE_BOUND = 2.0


@dataclass(frozen=True)
class _Sweep:
    """Shapes to time: plane-block sizes x block counts, capped in total bytes."""

    plane_block_nbytes: tuple[int, ...]
    num_blocks: tuple[int, ...]
    max_total_bytes: int
    repeats: int
    prefill_tokens: tuple[int, ...]


# Full: 4 KiB (a 16-token fp8 head slice) to 256 KiB plane-blocks, 1 to 1024 blocks, up to 512 MiB per call.
_FULL_GPU = _Sweep(
    (4096, 16384, 65536, 262144), (1, 4, 16, 64, 256, 1024), 512 << 20, 10, (512, 1024, 2048, 4096, 8192)
)
_FULL_CPU = _Sweep((4096, 32768, 262144), (1, 4, 16, 64, 256), 256 << 20, 7, (64, 128, 256, 384))
# Quick: a few shapes, about ten seconds on a 2-core CPU.
_QUICK_GPU = _Sweep((4096, 32768, 262144), (1, 16, 256), 256 << 20, 5, (512, 2048))
_QUICK_CPU = _Sweep((4096, 32768, 262144), (1, 8, 64), 64 << 20, 5, (64, 128, 192))


def _hardware(device: torch.device) -> dict[str, object]:
    return {**machine_identity(device), "calibration_planes": CALIBRATION_PLANES}


def _link_fit(fit: LinearFit) -> CostLine:
    return CostLine(alpha_s=fit.alpha, beta_bytes_per_s=fit.beta, r2=fit.r2, max_abs_residual=fit.max_abs_residual)


def _pairs(device: torch.device, plane_block_nbytes: int, num_blocks: int) -> dict[str, tuple[PagedKV, PagedKV]]:
    """Source and destination caches per direction for one plane-block size."""
    planes = [
        torch.empty(num_blocks, plane_block_nbytes, dtype=torch.uint8, device=device) for _ in range(CALIBRATION_PLANES)
    ]
    for plane in planes:
        plane.random_()
    kv = PagedKV.from_planes(planes)
    host = HostKVPool(kv, num_blocks).paged  # keeps the pool's (pinned) memory alive
    if device.type == "cuda":
        return {"d2h": (kv, host), "h2d": (host, kv)}
    return {"h2h": (kv, host)}


def _methods_to_time(src: PagedKV, dst: PagedKV, wanted: Sequence[str] | None) -> list[str]:
    methods = available_methods(src, dst)
    if _ext.TRITON_INTERPRET and "triton" in methods:
        methods.remove("triton")  # the interpreter is a test mode, not a copy method worth timing
    return [m for m in methods if wanted is None or m in wanted]


def _time_links(device: torch.device, sweep: _Sweep, methods: Sequence[str] | None, progress: bool) -> dict:
    points: dict[str, dict[str, list[list[float]]]] = {}
    shapes = [
        (b, n)
        for b in sweep.plane_block_nbytes
        for n in sweep.num_blocks
        if b * n * CALIBRATION_PLANES <= sweep.max_total_bytes
    ]
    bar = progress_bar(len(shapes) * (2 if device.type == "cuda" else 1), progress, "calibrating copies", "shape")
    generator = torch.Generator().manual_seed(0)
    for block_nbytes in sweep.plane_block_nbytes:
        counts = [n for b, n in shapes if b == block_nbytes]
        if not counts:
            continue
        pool_blocks = max(2 * max(counts), -(-COLD_BYTES // (block_nbytes * CALIBRATION_PLANES)))
        for direction, (src, dst) in _pairs(device, block_nbytes, pool_blocks).items():
            for num_blocks in counts:
                # Random ids (the common, uncoalesced case), a different set of blocks each call.
                nbytes = num_blocks * block_nbytes * CALIBRATION_PLANES
                num_sets = max(_MIN_ID_SETS, min(_MAX_ID_SETS, COLD_BYTES // nbytes))
                id_sets = [
                    (
                        torch.randperm(src.num_blocks, generator=generator)[:num_blocks],
                        torch.randperm(dst.num_blocks, generator=generator)[:num_blocks],
                    )
                    for _ in range(num_sets)
                ]
                for method in _methods_to_time(src, dst, methods):
                    timing = measure(
                        _copy_next(src, dst, id_sets, method),
                        warmup=2,
                        repeats=sweep.repeats,
                        device=device,
                        inner=max(1, min(_MIN_ID_SETS, (1 << 20) // max(nbytes, 1))),
                    )
                    points.setdefault(direction, {}).setdefault(method, []).append(
                        [nbytes, num_blocks, block_nbytes, timing.median, timing.p20, timing.p80]
                    )
                bar.update()
    bar.close()
    return points


def _copy_next(
    src: PagedKV, dst: PagedKV, id_sets: list[tuple[torch.Tensor, torch.Tensor]], method: str
) -> Callable[[], None]:
    """A call that copies with ``method`` the blocks of the next of ``id_sets`` each time, round robin."""
    sets = itertools.cycle(id_sets)

    def copy_next() -> None:
        src_ids, dst_ids = next(sets)
        copy_blocks(src, src_ids, dst, dst_ids, method=method)

    return copy_next


def fit_lines(points: dict[str, dict[str, list[list[float]]]]) -> dict[str, dict[str, MethodProfile]]:
    """Per direction and method: the fit over all points ``[bytes, blocks, plane-block bytes, median s, ...]``
    and one per plane-block size (where that size has two or more byte counts and the times grow)."""
    links: dict[str, dict[str, MethodProfile]] = {}
    for direction, methods in points.items():
        for method, rows in methods.items():
            overall = _link_fit(fit_alpha_beta([r[0] for r in rows], [r[3] for r in rows]))
            by_block: dict[int, CostLine] = {}
            for block_nbytes in sorted({int(r[2]) for r in rows}):
                mine = [r for r in rows if int(r[2]) == block_nbytes]
                if len({r[0] for r in mine}) < 2:
                    continue
                try:
                    by_block[block_nbytes] = _link_fit(fit_alpha_beta([r[0] for r in mine], [r[3] for r in mine]))
                except ValueError:  # times flat within noise at this size: the overall fit serves it
                    continue
            links.setdefault(direction, {})[method] = MethodProfile(overall, by_block, rows)
    return links


def _contiguous_peaks(device: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """Bytes/s of one contiguous copy of ``nbytes`` per direction: the link's reference."""
    if device.type != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        return {"h2h": measure(lambda: dst.copy_(src), repeats=repeats).gbps(nbytes) * 1e9}
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = HostKVPool(PagedKV.from_planes([torch.empty(1, nbytes, dtype=torch.uint8)]), 1).buffer  # keeps it pinned
    return {
        "d2h": measure(lambda: host.copy_(gpu, non_blocking=True), repeats=repeats, device=device).gbps(nbytes) * 1e9,
        "h2d": measure(lambda: gpu.copy_(host, non_blocking=True), repeats=repeats, device=device).gbps(nbytes) * 1e9,
    }


def _layer_forward(
    spec: ModelSpec, device: torch.device
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[int], float], torch.dtype, int]:
    """One decoder layer shaped like ``spec``: q/k/v/o projections, causal SDPA, gated MLP.

    Returns the forward, the FLOPs it executes for n tokens (so the fitted
    rate is a real rate, whatever the model's MoE routing or MLA projections;
    the planner then divides the model's own FLOPs by it), the dtype, and
    the bytes of its weights (what a forward of a few tokens reads).
    MLA models are timed as a layer with their hidden size and query heads,
    KV heads equal to query heads (the decompressed attention of prefill);
    MoE models with one dense MLP of their intermediate size.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden, heads = spec.hidden_size, spec.num_attention_heads
    if spec.attention == "mla":  # spec.head_dim is the cached latent; queries use nope + rope dims
        assert spec.qk_nope_head_dim is not None and spec.qk_rope_head_dim is not None  # an MLA spec has both
        head_dim, kv_heads = spec.qk_nope_head_dim + spec.qk_rope_head_dim, heads
    else:
        head_dim, kv_heads = spec.head_dim, spec.num_kv_heads
    inter = spec.intermediate_size

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) / cols**0.5

    wq, wk, wv = (
        weight(hidden, heads * head_dim),
        weight(hidden, kv_heads * head_dim),
        weight(hidden, kv_heads * head_dim),
    )
    wo = weight(heads * head_dim, hidden)
    w_gate, w_up, w_down = weight(hidden, inter), weight(hidden, inter), weight(inter, hidden)

    def forward(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = (x @ wq).view(n, heads, head_dim).transpose(0, 1)
        k = (x @ wk).view(n, kv_heads, head_dim).transpose(0, 1)
        v = (x @ wv).view(n, kv_heads, head_dim).transpose(0, 1)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
        x = x + attn.transpose(0, 1).reshape(n, heads * head_dim) @ wo
        return x + (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down

    weights = sum(w.numel() for w in (wq, wk, wv, wo, w_gate, w_up, w_down))

    def executed_flops(n: int) -> float:
        # 2 FLOPs per weight per token; causal QK^T and AV: n^2/2 pairs x head_dim x 2 FLOPs x 2 products per head
        return 2.0 * n * weights + 2.0 * heads * head_dim * n * n

    return forward, executed_flops, dtype, weights * dtype.itemsize


def _time_prefill(spec: ModelSpec, device: torch.device, sweep: _Sweep, progress: bool) -> PrefillProfile:
    """Times one layer at each token count and fits the roofline of one forward.

    ``t = alpha + flops / flops_per_s`` is fitted over the sweep's token counts
    that are compute-bound (PREFILL_COMPUTE_BOUND times the floor; else the two
    largest); the memory-bound floor comes from the fastest forward of
    PREFILL_FLOOR_TOKENS tokens: ``weight_bytes / (t_floor - alpha)`` (None when
    the floor is within the fixed cost: no weight-read bound measurable). Each
    count is timed in PREFILL_ROUNDS interleaved rounds and keeps its fastest;
    when the fit fails or misses a point by more than PREFILL_REFIT_RESIDUAL,
    one more round is timed; if timings still do not grow with the token count
    (a busy machine), the largest count's rate stands in, with R^2 0 so that
    the calibration is reported as poor rather than failing.
    """
    forward, executed_flops, dtype, weight_bytes = _layer_forward(spec, device)
    counts = tuple(sweep.prefill_tokens)
    timed = PREFILL_FLOOR_TOKENS + counts
    flops = [executed_flops(tokens) for tokens in counts]
    best: dict[int, float] = {}

    def one_round(bar: ProgressBar) -> None:
        for tokens, seconds in _time_prefill_round(forward, dtype, spec, device, timed, sweep, bar).items():
            best[tokens] = min(seconds, best.get(tokens, seconds))

    def compute_fit() -> LinearFit | None:
        # Only counts clearly past the roofline knee (twice the floor's time) say how fast compute is: a
        # memory-bound count on the line would tilt it, and its intercept would be the weight reads.
        floor = min(best[t] for t in PREFILL_FLOOR_TOKENS)
        bound = [i for i, t in enumerate(counts) if best[t] >= PREFILL_COMPUTE_BOUND * floor]
        chosen = bound if len(bound) >= 2 else list(range(len(counts)))[-2:]
        return _prefill_fit([flops[i] for i in chosen], [best[counts[i]] for i in chosen])

    bar = progress_bar(
        PREFILL_ROUNDS * len(timed), progress, f"calibrating prefill ({PREFILL_ROUNDS} interleaved rounds)", "forward"
    )
    for _ in range(PREFILL_ROUNDS):
        one_round(bar)
    bar.close()
    fit = compute_fit()
    if fit is None or fit.max_abs_residual > PREFILL_REFIT_RESIDUAL:
        bar = progress_bar(
            len(timed), progress, "calibrating prefill again (the fit was poor: a busy machine?)", "forward"
        )
        one_round(bar)
        bar.close()
        fit = compute_fit()
        if fit is None:  # still no growth with the token count: a busy machine. Kept, and reported as poor.
            fit = _through_origin(flops[-1], best[counts[-1]])
    memory_s = min(best[t] for t in PREFILL_FLOOR_TOKENS) - fit.alpha
    return PrefillProfile(
        model=spec.name,
        alpha_s=fit.alpha * spec.num_layers,  # every layer pays its launch overhead once per forward
        flops_per_s=fit.beta,
        r2=fit.r2,
        points=tuple(zip(flops, (best[t] for t in counts), strict=True)),
        weight_bytes_per_s=weight_bytes / memory_s if memory_s > 0 else None,
        num_layers=spec.num_layers,
    )


def _through_origin(flops: float, seconds: float) -> LinearFit:
    """The largest count's rate with no fixed cost, when timings gave no line: R^2 0, so fit_problems reports
    it and calibrate neither trusts nor saves it over a good profile (unless --force)."""
    return LinearFit(alpha=0.0, beta=flops / seconds, r2=0.0, residuals=(1.0,))


def _prefill_fit(flops: list[float], seconds: list[float]) -> LinearFit | None:
    try:
        return fit_alpha_beta(flops, seconds)
    except ValueError:
        return None


def _time_prefill_round(
    forward: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
    spec: ModelSpec,
    device: torch.device,
    counts: Sequence[int],
    sweep: _Sweep,
    bar: ProgressBar,
) -> dict[int, float]:
    """Median seconds of one layer forward at each token count, one after the other."""
    seconds: dict[int, float] = {}
    for tokens in counts:
        x = torch.randn(tokens, spec.hidden_size, device=device, dtype=dtype)
        # Few repeats per round: the rounds' minimum is what rejects a slow spell.
        seconds[tokens] = measure(
            functools.partial(forward, x), warmup=1, repeats=max(2, sweep.repeats // 3), device=device
        ).median
        bar.update()
    return seconds


def calibrate(
    device: torch.device | str | None = None,
    *,
    methods: Sequence[str] | None = None,
    quick: bool = False,
    progress: bool = True,
    model: ModelSpec | str | None = None,
) -> Profile:
    """Measures copies and prefill on ``device`` (default: the GPU if any, else the CPU).

    ``methods``: limit to these (default: every method that can run, except
    Triton under its interpreter). ``quick``: fewer shapes and repeats (about
    10 s on a 2-core CPU). ``model``: a ModelSpec (or preset name) whose
    layer shape times prefill (default: DEFAULT_MODEL).
    """
    from kvcopy.model.spec import ModelSpec

    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device} asked for, but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected a cpu or cuda device, got {device}")
    spec = model if isinstance(model, ModelSpec) else ModelSpec.preset(model or DEFAULT_MODEL)
    sweep = (_QUICK_GPU if quick else _FULL_GPU) if device.type == "cuda" else (_QUICK_CPU if quick else _FULL_CPU)
    points = _time_links(device, sweep, methods, progress)
    if not points:
        raise ValueError(f"methods: none of {list(methods or [])} can run on {device}")
    profile = Profile(hardware=_hardware(device), directions=fit_lines(points))
    profile.peaks = _contiguous_peaks(device, sweep.max_total_bytes // 2, sweep.repeats)
    profile.prefill = _time_prefill(spec, device, sweep, progress)
    return profile
