"""transformers' continuous batching, preempting, with kvcopy deciding and moving the KV.

A tiny random-weight Llama (built from a config: nothing is downloaded)
serves 64 requests of 40-300 prompt tokens on a paged cache too small to hold
them all, so transformers preempts them, some 30 times. kvcopy keeps or drops
each preempted request's KV, as the Planner decides for this model on this
machine, and reloads what it kept; it learns the engine's own costs as it
serves (``learn=True``).

The workload runs five times: never preempted (the reference), then under
kvcopy with policy "offload" (every preempted request reloaded: measures the
reload path), "recompute" (every one re-prefilled: measures that path),
"auto" deciding from the calibration alone (``learn=False``) and "auto"
learning. Printed per preempted request of the learning "auto" run: the
decision, the predicted and measured seconds of both paths (measured in the
run that took that path, for the same request preempted at the same point),
and whether its tokens match the never-preempted run; then per run the
Planner's error (median and p90 of |predicted for the path taken / measured
- 1| after the first 10 decisions), static against learned, and whether the
learning "auto" took the faster path where both were measured. Exits 1 on
any token mismatch.

    python examples/transformers_offload.py [--profile profile.json] [--device cpu]

Without --profile it calibrates this machine for this model first (about 10 s
on a CPU: copies, and prefill of one layer of this model's shape).
``--save-profile PATH`` writes what the learning run learned.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import kvcopy
from kvcopy.calibration.machine import machine_identity
from kvcopy.integrations import transformers as kvt
from kvcopy.tools.bench.engine_errors import DEFAULT_SKIP, compare_paths, crowding_summary, error_summary

NUM_REQUESTS = 64  # some 30 preemptions on the tight cache
NEW_TOKENS = 40
PAGE_TOKENS = 16
ROOMY_BLOCKS = 400  # holds every request at once: no preemption
TIGHT_BLOCKS = 24  # holds the longest request, not all of them: transformers preempts


def build_model(device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(config).to(device).eval()
    model.set_attn_implementation("sdpa")
    return model


def make_prompts(num_requests: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 512) for _ in range(rng.randrange(40, 300))] for _ in range(num_requests)]


def generate(model: LlamaForCausalLM, prompts: list[list[int]], num_blocks: int) -> dict[str, list[int]]:
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=PAGE_TOKENS, max_batch_tokens=256)
    out = model.generate_batch(prompts, gen, continuous_batching_config=cb)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:8.2f} ms" if value < 1 else f"{value:8.2f} s "


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="a calibrated profile (default: calibrate now, for this model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save-profile", help="write the profile the learning run learned here")
    parser.add_argument("--requests", type=int, default=NUM_REQUESTS, help=f"requests served (default {NUM_REQUESTS})")
    args = parser.parse_args()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # its per-run chatter

    start = time.perf_counter()
    model = build_model(args.device)
    prompts = make_prompts(args.requests)
    spec = kvt.model_spec(model)
    if args.profile:
        profile = kvcopy.Profile.load(args.profile)
    else:
        print(f"calibrating {args.device} for {spec.name} (copies, and prefill of one layer of this shape)...")
        profile = kvcopy.calibrate(args.device, quick=True, progress=False, model=spec)

    reference = generate(model, prompts, ROOMY_BLOCKS)
    runs: dict[str, kvt.OffloadStats] = {}
    matched: dict[str, dict[str, bool]] = {}
    for run, policy, learn in (
        ("offload", "offload", True),
        ("recompute", "recompute", True),
        ("auto, static", "auto", False),
        ("auto", "auto", True),
    ):
        save = args.save_profile if run == "auto" else None
        with kvt.offloading(
            model, host_gib=0.25, policy=policy, profile=profile, learn=learn, save_profile=save
        ) as stats:
            tokens = generate(model, prompts, TIGHT_BLOCKS)
        runs[run] = stats
        matched[run] = {rid: tokens.get(rid) == expected for rid, expected in reference.items()}

    def measured(policy: str, decision: kvt.OffloadDecision) -> float | None:
        """The same request preempted at the same point, in the run that always took ``policy``'s path."""
        return next(
            (
                d.measured_s
                for d in runs[policy].decisions
                if (d.request_id, d.prefix_tokens) == (decision.request_id, decision.prefix_tokens)
            ),
            None,
        )

    who = machine_identity(args.device)
    print(
        f"\nmeasured on {who['device_name']} ({who['host_cores']} cores, {who['torch_threads']} threads), torch "
        f"{who['torch']}, transformers {transformers.__version__}, kvcopy {who['kvcopy']}, {who['date']}"
    )
    print(
        f"{spec.name} on {args.device}: {args.requests} requests, a {TIGHT_BLOCKS}-block cache "
        f"({PAGE_TOKENS} tokens a block)"
    )
    header = (
        f"{'request':8} {'cached':>6} {'decision':9} {'learned':>7} {'pred. reload':>12} {'meas. reload':>12} "
        f"{'pred. recomp.':>13} {'meas. recomp.':>13}  tokens"
    )
    print(header)
    print("-" * len(header))
    for d in runs["auto"].decisions:
        print(
            f"{d.request_id:8} {d.prefix_tokens:6d} {d.action:9} {d.observations:7d} "
            f"{seconds(d.predicted_reload_s):>12} {seconds(measured('offload', d)):>12} "
            f"{seconds(d.predicted_recompute_s):>13} {seconds(measured('recompute', d)):>13}  "
            f"{'match' if matched['auto'][d.request_id] else 'MISMATCH'}"
        )
    print("(learned: how many of the engine's own measurements the decision's profile held)")
    for run, stats in runs.items():
        errors = error_summary(stats)
        print(
            f"policy {run:12}: {stats.offloaded_requests} offloaded, {stats.reloaded_requests} reloaded, "
            f"{stats.recomputed_requests} recomputed; tokens of {sum(matched[run].values())}/{args.requests} "
            f"requests match the never-preempted run; error median {errors['error_median']}, "
            f"p90 {errors['error_p90']} over {errors['errors_measured']} measured decisions"
        )
    print(f"(error: |predicted for the path taken / measured - 1| after the first {DEFAULT_SKIP} decisions)")
    print(f"auto's measured decisions, by what their forwards carried: {crowding_summary(runs['auto'])}")
    print(compare_paths(runs["auto"], runs["offload"], runs["recompute"]))
    print(f"({time.perf_counter() - start:.0f} s in all)")
    return 0 if all(all(m.values()) for m in matched.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
