"""Tiny random-weight transformers models and preempting workloads for the continuous-batching tests.

Nothing is downloaded: each model is built from a config here. The cache sizes
were chosen so that every model's requests are preempted several times (the
tests assert that the path they are about really ran).
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import ClassVar

import torch
import transformers as hf
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvcopy import Planner, Profile
from kvcopy.engine.engine import TransferEngine
from kvcopy.integrations import transformers as kvt
from kvcopy.profile import CostLine, MethodProfile, PrefillProfile

VOCAB = 512
PAGE_TOKENS = 16
# A cache holding every request at once: the never-preempted reference run.
ROOMY_BLOCKS = 400
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


@dataclass(frozen=True)
class ModelCase:
    """A model family, its workload, and a cache small enough to preempt that workload several times."""

    name: str
    num_blocks: int
    num_requests: int = 10
    new_tokens: int = 40

    def prompts(self) -> list[list[int]]:
        return prompts(self.num_requests)

    def generate(self, model: torch.nn.Module, num_blocks: int | None = None, **kwargs: object) -> dict[str, list[int]]:
        """This case's workload on a cache of ``num_blocks`` (default: the preempting size)."""
        return generate(model, self.prompts(), num_blocks or self.num_blocks, new_tokens=self.new_tokens, **kwargs)

    def build(self, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
        torch.manual_seed(0)
        if self.name == "llama-gqa":
            model, attn = hf.LlamaForCausalLM(hf.LlamaConfig(**_COMMON)), "sdpa"
        elif self.name == "qwen2-sliding":  # layers 2 and 3 slide over 64 tokens: two cache allocators
            config = hf.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=64, max_window_layers=2)
            model, attn = hf.Qwen2ForCausalLM(config), "sdpa"
        elif self.name == "gemma2":  # alternating sliding and full layers; eager attention only
            config = hf.Gemma2Config(**_COMMON, head_dim=32, sliding_window=64, attn_implementation="eager")
            model, attn = hf.Gemma2ForCausalLM(config), "eager"
        else:
            raise ValueError(self.name)
        model = model.to(dtype=dtype, device=device).eval()
        model.set_attn_implementation(attn)
        return model


MODEL_CASES = (
    ModelCase("llama-gqa", 24),
    ModelCase("qwen2-sliding", 16),
    ModelCase("gemma2", 16, num_requests=12, new_tokens=64),
)


def prompts(num: int = 10, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of 40-300 random tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(40, 300))] for _ in range(num)]


def generate(
    model: torch.nn.Module,
    inputs: list[list[int]],
    num_blocks: int,
    *,
    new_tokens: int = 40,
    cpu_offload_space: float | None = 0.0,
) -> dict[str, list[int]]:
    """Greedy continuous batching; the generated token ids of each request (a failed request raises)."""
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        num_blocks=num_blocks, page_size=PAGE_TOKENS, max_batch_tokens=256, cpu_offload_space=cpu_offload_space
    )
    out = model.generate_batch(inputs, gen, continuous_batching_config=cb)
    failed = {rid: o.error for rid, o in out.items() if o.error is not None}
    if failed or len(out) != len(inputs):
        raise RuntimeError(f"generation failed: {failed or f'{len(out)} of {len(inputs)} results'}")
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def crossover_profile(model: torch.nn.Module, crossover_tokens: int = 150) -> Profile:
    """A profile under which reloading wins for prefixes above ``crossover_tokens`` and recompute below:
    a 1 ms fixed cost per reload at 10 GB/s, and prefill as fast as loading at the crossover."""
    spec = kvt.model_spec(model)
    link = CostLine(alpha_s=1e-3, beta_bytes_per_s=10e9, r2=1.0, max_abs_residual=0.0)
    t_load = link.predict(spec.kv_bytes(crossover_tokens))
    prefill = PrefillProfile(
        model=spec.name, alpha_s=0.0, flops_per_s=spec.prefill_flops(crossover_tokens) / t_load, r2=1.0
    )
    return Profile(
        hardware={"device": "test"},
        directions={"h2h": {"cpu": MethodProfile(fit=link)}, "h2d": {"cuda": MethodProfile(fit=link)}},
        prefill=prefill,
    )


def _bench_engine() -> ModuleType:
    """benchmarks/bench_engine.py, which holds the stand-in that lets transformers' own offload run here."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"
    spec = importlib.util.spec_from_file_location("bench_engine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def transformers_own_offload(monkeypatch) -> None:
    """Lets transformers' own CPU offload run here (no pinning without a GPU)."""
    if not torch.cuda.is_available():
        from transformers.generation.continuous_batching import offloading_manager

        monkeypatch.setattr(offloading_manager, "torch", _bench_engine().TorchWithoutPinning())


class RecordingEngine(TransferEngine):
    """A TransferEngine that checks, bitwise, that every offloaded block landed on the host and that every
    reloaded block equals what was offloaded into that host block. Waits for each copy (tests only)."""

    offloaded: ClassVar[dict[tuple[int, int], torch.Tensor]] = {}  # every engine's, by (host pool id, slot)
    reloaded_blocks = 0

    def offload(self, block_ids, host_ids):
        transfer = super().offload(block_ids, host_ids)
        transfer.wait()
        device, host = self.kv.planes[0], self.host.paged.planes[0]
        for block, slot in zip(block_ids, host_ids, strict=True):
            assert torch.equal(host[slot], device[block].cpu()), f"offloaded block {block} differs on the host"
            RecordingEngine.offloaded[(id(self.host), slot)] = device[block].cpu().clone()
        return transfer

    def reload(self, host_ids, block_ids, *, layerwise=False):
        transfer = super().reload(host_ids, block_ids, layerwise=layerwise)
        transfer.wait()
        device = self.kv.planes[0]
        for slot, block in zip(host_ids, block_ids, strict=True):
            expected = RecordingEngine.offloaded[(id(self.host), slot)]
            assert torch.equal(device[block].cpu(), expected), f"reloaded block {block} differs from its offload"
            RecordingEngine.reloaded_blocks += 1
        return transfer


def engine_law(model: torch.nn.Module, base: Profile) -> Profile:
    """What a "measured" engine costs, far from helpers.hf's crossover profile ``base``: copies at 2 ms + 2 GB/s
    (base: 1 ms + 10 GB/s), forwards 5 ms + a quarter of the base's FLOP rate (base: 0 ms)."""
    link = CostLine(alpha_s=2e-3, beta_bytes_per_s=2e9, r2=1.0, max_abs_residual=0.0)
    spec = kvt.model_spec(model)
    return Profile(
        hardware={"device": "engine law"},
        directions={"h2h": {"cpu": MethodProfile(fit=link)}},
        prefill=PrefillProfile(model=spec.name, alpha_s=5e-3, flops_per_s=base.prefill.flops_per_s / 4, r2=1.0),
    )


def time_by_law(monkeypatch, law: Planner) -> None:
    """Makes kvcopy's measurements of transformers' engine follow ``law`` instead of the wall clock: each forward
    PathClock times lasts law.t_forward of its requests' (new, cached) tokens, and each finished copy's turnaround
    is law.t_load_nbytes of its bytes. Everything else (the engine, the copies, the decisions) is real; what
    kvcopy measures no longer depends on the machine's load."""
    from kvcopy.engine.transfer import Transfer
    from kvcopy.integrations.common import path_clock

    now = [0.0]
    pending = [0.0]
    start, stop = path_clock.PathClock.start, path_clock.PathClock.stop

    def start_by_law(self: path_clock.PathClock, requests: list[path_clock.ForwardRequest]) -> None:
        start(self, requests)
        pending[0] = law.t_forward(tuple(r.new_tokens for r in requests), tuple(r.cached_tokens for r in requests))

    def stop_by_law(self: path_clock.PathClock) -> None:
        if self._forward is not None:  # a forward ends: the law's seconds have passed since it started
            now[0] += pending[0]
        stop(self)

    def turnaround_by_law(transfer: Transfer) -> float | None:
        return None if transfer._seconds_between(0, 2) is None else law.t_load_nbytes(transfer.nbytes)

    monkeypatch.setattr(path_clock, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(path_clock.PathClock, "start", start_by_law)
    monkeypatch.setattr(path_clock.PathClock, "stop", stop_by_law)
    monkeypatch.setattr(Transfer, "turnaround", property(turnaround_by_law))
