"""End to end: transformers' continuous batching under memory pressure, its own paths against kvcopy's.

A random-weight Llama (built from a config) serves ``--requests`` prompts of
``--min-prompt``..``--max-prompt`` tokens, ``--new-tokens`` each (default 64
requests, 128-512 prompt tokens, 128 new), greedy, on a paged cache holding
``--cache-fraction`` of what they need at once (default 0.06: some 40
preemptions), so transformers preempts requests again and again. Paths, in
one run:

- ``transformers soft reset``: transformers on its own without a host pool:
  a preempted request is re-prefilled;
- ``transformers offload``: transformers' own CPU offload (index_select and
  copy_ on the compute stream). It pins its pool, which needs a GPU: on a
  CPU it runs with pinning dropped, and is labelled so;
- ``kvcopy offload`` / ``kvcopy recompute`` / ``kvcopy auto``:
  ``kvcopy.integrations.transformers.offloading`` with each policy ("auto"
  decides with the Planner from ``--profile``, else from a quick calibration
  of this machine for this model, made first), learning the engine's costs
  as it serves (``learn=True``); ``kvcopy auto, static``: "auto" deciding
  from the calibration alone (``learn=False``).

Per path: total seconds, generated tokens per second, preemptions, and the
time from a preemption to the request's first new token after it resumed
(median and max; from transformers' own token timestamps), and whether every
request's tokens equal the first path's. Per kvcopy path, the Planner's
error: the median and p90 of ``|predicted for the path taken / measured - 1|``
over its decisions after the first ``--skip`` (docs/decisions.md defines both
quantities). Then, for the preemptions that the offload and the recompute
runs both measured, whether "auto" (learned) took the faster path. Rows go
to ``--csv`` with the machine's identity.

    python benchmarks/bench_engine.py [--requests 64] [--csv results/bench_engine_cpu.csv]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import offloading_manager

import kvcopy
from kvcopy.calibration.machine import machine_identity
from kvcopy.integrations import transformers as kvt
from kvcopy.tools.bench import IDENTITY_COLUMNS
from kvcopy.tools.bench.engine_errors import DEFAULT_SKIP, compare_paths, crowding_summary, error_summary

PAGE_TOKENS = 16
MAX_BATCH_TOKENS = 512
HOST_GIB = 4.0  # room for every preempted request's KV at the default sizes
COLUMNS = (
    "path",
    "requests",
    "prompt_tokens",
    "generated_tokens",
    "cache_blocks",
    "seconds",
    "tokens_per_s",
    "preemptions",
    "resume_median_s",
    "resume_max_s",
    "same_tokens",
    "decisions",
    "error_median",
    "error_p90",
    "errors_measured",
    "note",
    *IDENTITY_COLUMNS,
)


class TorchWithoutPinning:
    """``torch`` for transformers' offloading module with ``pin_memory`` dropped from ``torch.empty``
    (pinning needs an NVIDIA driver): transformers' own CPU offload, runnable on a CPU. The tests use it too."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def empty(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        del pin_memory
        return torch.empty(*args, **kwargs)


@contextlib.contextmanager
def preemption_clock() -> Iterator[list[tuple[str, float]]]:
    """Records (request id, time) of every preemption, whichever manager (transformers' or kvcopy's) runs."""
    events: list[tuple[str, float]] = []
    base = offloading_manager.OffloadingManager
    real = base.offload_requests

    def offload_requests(self):  # type: ignore[no-untyped-def]
        before = set(self.scheduler.active_requests)
        result = real(self)
        now = time.perf_counter()  # not measure: a stamp on the clock of transformers' own token timestamps
        events.extend((rid, now) for rid in before - set(self.scheduler.active_requests))
        return result

    base.offload_requests = offload_requests
    try:
        yield events
    finally:
        base.offload_requests = real


@contextlib.contextmanager
def unpinned_transformers_offload() -> Iterator[None]:
    real = offloading_manager.torch
    offloading_manager.torch = TorchWithoutPinning()
    try:
        yield
    finally:
        offloading_manager.torch = real


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    heads = args.hidden // 64
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    model.set_attn_implementation("sdpa")
    return model


def run_path(
    model: LlamaForCausalLM, prompts: list[list[int]], args: argparse.Namespace, num_blocks: int, offload_gib: float
) -> tuple[dict[str, list[int]], float, list[tuple[str, float]], dict[str, list[float]]]:
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        num_blocks=num_blocks, page_size=PAGE_TOKENS, max_batch_tokens=MAX_BATCH_TOKENS, cpu_offload_space=offload_gib
    )
    with preemption_clock() as preemptions:
        start = time.perf_counter()  # not measure: one end-to-end run, its preemptions and tokens part of the result
        out = model.generate_batch(prompts, gen, continuous_batching_config=cb, record_timestamps=True)
        seconds = time.perf_counter() - start
    failed = [rid for rid, o in out.items() if o.error is not None]
    if failed or len(out) != len(prompts):
        raise RuntimeError(f"generation failed for {failed or 'some requests'}")
    tokens = {rid: list(o.generated_tokens) for rid, o in out.items()}
    stamps = {rid: list(o.timestamps or []) for rid, o in out.items()}
    return tokens, seconds, preemptions, stamps


def resume_latencies(preemptions: list[tuple[str, float]], stamps: dict[str, list[float]]) -> list[float]:
    """Seconds from each preemption to the request's next new token."""
    return [next((t - when for t in stamps[rid] if t > when), math.nan) for rid, when in preemptions]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--cache-fraction",
        type=float,
        default=0.06,
        help="the paged cache holds this fraction of what all requests need at once",
    )
    parser.add_argument(
        "--skip", type=int, default=DEFAULT_SKIP, help="decisions not judged: the first ones of each run"
    )
    parser.add_argument("--hidden", type=int, default=256, help="model width (heads of 64; KV heads a quarter)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", help="calibrated profile for policy 'auto' (default: calibrate for this model)")
    parser.add_argument("--csv", help="write the rows here, with the machine's identity")
    args = parser.parse_args(argv)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)

    model = build_model(args)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 2048) for _ in range(rng.randrange(args.min_prompt, args.max_prompt + 1))]
        for _ in range(args.requests)
    ]
    needed = sum(math.ceil((len(p) + args.new_tokens) / PAGE_TOKENS) for p in prompts)
    longest = max(math.ceil((len(p) + args.new_tokens) / PAGE_TOKENS) for p in prompts)
    num_blocks = max(int(needed * args.cache_fraction), longest + 1)
    on_gpu = torch.device(args.device).type == "cuda"
    if args.profile:
        profile = kvcopy.Profile.load(args.profile)
    else:
        start = time.perf_counter()  # not measure: how long the calibration took, a note for the reader
        profile = kvcopy.calibrate(args.device, quick=True, progress=False, model=kvt.model_spec(model))
        print(f"calibrated {args.device} for this model in {time.perf_counter() - start:.0f} s")

    paths: list[tuple[str, str, contextlib.AbstractContextManager, float]] = [
        ("transformers soft reset", "", contextlib.nullcontext(), 0.0),
        (
            "transformers offload",
            "" if on_gpu else "pin_memory dropped to run without a GPU",
            contextlib.nullcontext() if on_gpu else unpinned_transformers_offload(),
            HOST_GIB,
        ),
    ]
    for name, policy, learn in (
        ("kvcopy offload", "offload", True),
        ("kvcopy recompute", "recompute", True),
        ("kvcopy auto, static", "auto", False),
        ("kvcopy auto", "auto", True),
    ):
        context = kvt.offloading(model, host_gib=HOST_GIB, policy=policy, profile=profile, learn=learn)
        paths.append((name, "learned" if learn else "calibration only", context, 0.0))
    identity = machine_identity(args.device)
    rows, first_tokens, runs = [], None, {}
    print(
        f"{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, {args.new_tokens} new; "
        f"cache {num_blocks} blocks of {PAGE_TOKENS} tokens ({args.cache_fraction:g} of {needed} needed); "
        f"Llama {args.layers} x {args.hidden} {args.dtype} on {identity['device_name']}"
    )
    header = (
        f"{'path':26} {'seconds':>8} {'tok/s':>8} {'preempt.':>8} {'resume p50':>11} {'resume max':>11}  "
        f"{'error p50':>9} {'error p90':>9}  tokens"
    )
    print(header + "\n" + "-" * len(header))
    for name, note, context, offload_gib in paths:
        with context as stats:
            tokens, seconds, preemptions, stamps = run_path(model, prompts, args, num_blocks, offload_gib)
        errors = error_summary(stats, args.skip) if stats is not None else {}
        if stats is not None:
            runs[name] = stats
        first_tokens = first_tokens or tokens
        waits = [w for w in resume_latencies(preemptions, stamps) if not math.isnan(w)]
        generated = sum(len(t) for t in tokens.values())
        row = dict(
            path=name,
            requests=args.requests,
            prompt_tokens=sum(map(len, prompts)),
            generated_tokens=generated,
            cache_blocks=num_blocks,
            seconds=round(seconds, 3),
            tokens_per_s=round(generated / seconds, 1),
            preemptions=len(preemptions),
            resume_median_s=round(statistics.median(waits), 4) if waits else "",
            resume_max_s=round(max(waits), 4) if waits else "",
            same_tokens=tokens == first_tokens,
            note=note,
            **errors,
            **identity,
        )
        rows.append(row)
        print(
            f"{name:26} {seconds:8.2f} {row['tokens_per_s']:8.1f} {len(preemptions):8d} "
            f"{row['resume_median_s'] or '-':>11} {row['resume_max_s'] or '-':>11}  "
            f"{errors.get('error_median', '') or '-':>9} {errors.get('error_p90', '') or '-':>9}  "
            f"{'same' if row['same_tokens'] else 'DIFFERENT'}{'  (' + note + ')' if note else ''}"
        )
    print(
        f"error: |predicted for the path taken / measured - 1| over the decisions after the first {args.skip} "
        f"(measured: the time the request takes to catch up once it runs again; docs/decisions.md)"
    )
    crowding = crowding_summary(runs["kvcopy auto"], args.skip)
    print(f"kvcopy auto's measured decisions, by what their forwards carried: {crowding}")
    print(compare_paths(runs["kvcopy auto"], runs["kvcopy offload"], runs["kvcopy recompute"], args.skip))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        print(f"rows saved to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
