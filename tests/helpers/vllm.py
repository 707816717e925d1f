"""A vLLM engine without a model, on the CPU: vLLM's real Scheduler and OffloadingConnector (both roles) around
CPU tensors standing in for the GPU's KV cache, for kvcopy's offloading spec.

A "forward" writes every scheduled token's KV as a known function of (request's token ids, position, layer),
so what a load brings back can be compared bitwise with what the store took. vLLM 0.33's APIs, as read in
its code (docs/engines.md, "vLLM").
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")

import prometheus_client  # noqa: E402
import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_planning  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

BLOCK_TOKENS = 16
HEADS, HEAD_DIM = 2, 16  # the default model's KV heads and head size: a 2-layer block of 8 KiB
MAX_MODEL_LEN = 1024  # the default model's context: every prompt of the tests fits
EOS = 255  # never sampled: the rig samples token 1 then stops by max_tokens
SPEC_PATH = {"spec_name": "KVCopyOffloadingSpec", "spec_module_path": "kvcopy.integrations.vllm"}


def write_model_dir(
    path: str,
    num_layers: int,
    sliding_window: int | None = None,
    *,
    kv_heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    max_model_len: int = MAX_MODEL_LEN,
) -> str:
    """A config.json for a tiny Llama (or, with ``sliding_window``, a Mistral whose odd layers slide) of
    ``kv_heads`` KV heads of ``head_dim`` (as many query heads, at least 4) and ``max_model_len`` positions."""
    attention_heads = max(4, kv_heads)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": attention_heads * head_dim,
        "intermediate_size": 2 * attention_heads * head_dim,
        "num_hidden_layers": num_layers,
        "num_attention_heads": attention_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": 256,
        "max_position_embeddings": max_model_len,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-5,
        "eos_token_id": EOS,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def layer_specs(
    num_layers: int,
    sliding_window: int | None,
    mla: bool = False,
    *,
    kv_heads: int = HEADS,
    head_dim: int = HEAD_DIM,
) -> dict[str, object]:
    """Per-layer KV specs, as a model runner reports them: full attention of ``kv_heads`` heads of ``head_dim``,
    every odd layer sliding with ``sliding_window``, or MLA (one latent of 4 x ``head_dim`` per token, no
    heads)."""
    specs = {}
    for i in range(num_layers):
        kwargs = {"block_size": BLOCK_TOKENS, "num_kv_heads": kv_heads, "head_size": head_dim, "dtype": torch.float32}
        if mla:
            specs[f"layers.{i}"] = MLAAttentionSpec(**{**kwargs, "num_kv_heads": 1, "head_size": 4 * head_dim})
        elif sliding_window is not None and i % 2:
            specs[f"layers.{i}"] = SlidingWindowSpec(sliding_window=sliding_window, **kwargs)
        else:
            specs[f"layers.{i}"] = FullAttentionSpec(**kwargs)
    return specs


def write_profile(
    path,
    model: str,
    *,
    load_alpha_s: float,
    load_bytes_per_s: float,
    prefill_flops_per_s: float,
    disk: tuple[float, float] | None = None,
) -> str:
    """A Profile file: host copies of ``load_alpha_s`` + bytes / ``load_bytes_per_s``, prefill at that FLOP rate,
    and with ``disk`` (alpha_s, bytes_per_s) the disk's reads (``kvcopy calibrate --disk``'s line)."""
    from kvcopy.profile import DISK_METHOD, DISK_READ_DIRECTION, CostLine, MethodProfile, PrefillProfile, Profile

    link = CostLine(alpha_s=load_alpha_s, beta_bytes_per_s=load_bytes_per_s, r2=1.0, max_abs_residual=0.0)
    directions = {"h2h": {"cpu": MethodProfile(fit=link)}, "h2d": {"cuda": MethodProfile(fit=link)}}
    if disk is not None:
        read = CostLine(alpha_s=disk[0], beta_bytes_per_s=disk[1], r2=1.0, max_abs_residual=0.0)
        directions[DISK_READ_DIRECTION] = {DISK_METHOD: MethodProfile(fit=read)}
    profile = Profile(
        hardware={"device": "test"},
        directions=directions,
        prefill=PrefillProfile(model=model, alpha_s=0.0, flops_per_s=prefill_flops_per_s, r2=1.0),
    )
    profile.save(path)
    return str(path)


def before_copies(worker, direction: str, hook) -> None:
    """Makes kvcopy's worker engine call ``hook()`` before each copy of ``direction`` ("offload", a store, or
    "reload", a load): a delay or a failure injected into the copy itself."""
    engine = worker.engine
    copy = engine._copy

    def hooked(method, src, src_ids, dst, dst_ids, layer):
        if (src is engine.kv) == (direction == "offload"):
            hook()
        copy(method, src, src_ids, dst, dst_ids, layer)

    engine._copy = hooked


def kv_value(tokens: Sequence[int], position: int, layer: int) -> float:
    """The KV a forward writes for the token at ``position`` of a request with ``tokens``: a function of its
    prefix (as attention's KV is), exact in fp32."""
    return float((sum(tokens[: position + 1]) * 31 + position * 7 + layer * 1009) % 65521)


@dataclass
class Rig:
    """The scheduler, the worker-side connector and the KV cache tensors of one engine."""

    vllm_config: VllmConfig
    scheduler: Scheduler
    worker: object
    caches: dict[str, torch.Tensor]
    kv_cache_config: object
    requests: dict[str, Request] = field(default_factory=dict)
    forwards: list[dict[str, int]] = field(default_factory=list)  # per step: request -> tokens computed

    @property
    def session(self):
        """The scheduler side's kvcopy session: its policy, Planner and decisions."""
        return self.manager.session

    @property
    def worker_spec(self):
        return self.worker.connector_worker.spec

    @property
    def kv_worker(self):
        """kvcopy's OffloadingWorker, as vLLM's worker-side connector holds it."""
        return self.worker.connector_worker.worker

    @property
    def manager(self):
        """kvcopy's OffloadingManager, as vLLM's scheduler-side connector holds it."""
        return self.scheduler.connector.connector_scheduler.manager

    def add(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int = 1,
        kv_transfer_params: dict | None = None,
        kv_hints: object | None = None,
    ) -> Request:
        """Adds a request (``kv_transfer_params``: vLLM's per-request connector parameters, max_load_tokens,
        kv_load_tiers, ...; ``kv_hints``: vLLM's hint envelope, as ``AsyncLLM.generate(..., kv_hints=)`` passes
        it)."""
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._hasher,
            kv_hints=kv_hints,
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def add_from_frontend(self, request: object) -> Request:
        """Adds ``request`` (vLLM's ``EngineCoreRequest``) as vLLM's engine core receives it from its front end
        (``AsyncLLM``, ``vllm serve``): encoded and decoded by vLLM's msgpack IPC codec, then made a Request."""
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        received = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
        made = Request.from_engine_core_request(received, self._hasher)
        self.requests[made.request_id] = made
        self.scheduler.add_request(made)
        return made

    def _forward(self, output) -> dict[str, int]:
        """Writes the KV of the blocks the step computes: each block's page, in every layer, holds kv_value of
        the request's prefix up to the block's last token computed so far (so a full block's value depends on
        its whole prefix, as attention's KV does), whatever vLLM's layout of the page."""
        computed: dict[str, int] = {}
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            end = request.num_computed_tokens  # schedule() has already counted this step's tokens computed
            tokens = request.all_token_ids
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)
            for name, cache in self.caches.items():
                layer = int(name.split(".")[1])
                table = block_ids[self._group_of[name]]
                for index in range((end - count) // BLOCK_TOKENS, -(-end // BLOCK_TOKENS)):
                    last = min(end, (index + 1) * BLOCK_TOKENS) - 1
                    cache[table[index]] = kv_value(tokens, last, layer)
            computed[request_id] = count
        return computed

    def step(self) -> dict[str, int]:
        """One engine step: schedule, start the connector's loads and stores, the forward, finish."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self._context)
        computed = self._forward(output)
        self.worker.wait_for_save()
        if not computed:  # an idle step: let the copies in flight finish instead of spinning on them
            self._on_idle_step()
        results = self.worker.get_transfer_results(output.finished_req_ids)
        worker_meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        running = [r for r in output.num_scheduled_tokens]
        sampled = [[1] if self._done_prefill(r, output) else [] for r in running]
        runner = ModelRunnerOutput(
            req_ids=running,
            req_id_to_index={r: i for i, r in enumerate(running)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=worker_meta,
            ),
        )
        self.scheduler.update_from_output(output, runner)
        self.forwards.append(computed)
        return computed

    def _done_prefill(self, request_id: str, output) -> bool:
        request = self.requests[request_id]
        return request.num_computed_tokens >= request.num_tokens

    def _on_idle_step(self) -> None:
        """After a step that computed nothing: wait for kvcopy's copies in flight."""
        self.kv_worker.wait(self.kv_worker.job_ids_in_flight)

    def _step_until(self, done: Callable[[], bool], max_steps: int, what: str) -> None:
        """Steps until ``done()``, at most ``max_steps`` steps; an AssertionError saying ``what`` did not happen."""
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError(f"{what} in {max_steps} steps")

    def run(self, max_steps: int = 200) -> None:
        """Steps until every request finished and every transfer is reported."""
        self._step_until(
            lambda: not self.scheduler.has_requests() and not self._transfers_pending(),
            max_steps,
            "the engine did not finish",
        )

    def run_until_prefilled(self, request_id: str, max_steps: int = 200) -> None:
        """Steps until ``request_id`` (added with ``max_tokens`` > 1, so it keeps its blocks) has its prompt
        computed or loaded."""
        request = self.requests[request_id]
        self._step_until(
            lambda: request.num_computed_tokens >= request.num_prompt_tokens and bool(request.num_output_tokens),
            max_steps,
            f"{request_id} was not prefilled",
        )

    def store_and_reset(self, tokens: list[int], *, zero: bool = False) -> None:
        """Runs request "first" over ``tokens`` until its stores are reported, then drops vLLM's prefix cache
        (and with ``zero``, the KV cache's bytes): what is left of it is in kvcopy's host tier."""
        self.add("first", tokens)
        self.run()
        self.drain()
        assert self.scheduler.reset_prefix_cache()
        if zero:
            for cache in self.caches.values():
                cache.zero_()

    def rerun(self, tokens: list[int], *, keep_blocks: bool = False) -> list[int]:
        """Runs request "again" over ``tokens``: to its end, or with ``keep_blocks`` until its prompt is in
        (it keeps its blocks, to be read); the tokens each of its forwards computed."""
        self.add("again", tokens, max_tokens=4 if keep_blocks else 1)
        if keep_blocks:
            self.run_until_prefilled("again")
        else:
            self.run()
        return [f["again"] for f in self.forwards if "again" in f]

    def _transfers_pending(self) -> bool:
        connector = self.scheduler.connector.connector_scheduler
        return bool(connector._jobs)

    def drain(self, steps: int = 20) -> None:
        """Steps with nothing to compute until the stores in flight are reported."""
        self._step_until(lambda: not self._transfers_pending(), steps, "stores still pending")

    def blocks_of(self, request_id: str) -> list[list[int]]:
        return [list(b) for b in self.scheduler.kv_cache_manager.get_block_ids(request_id)]

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()

    def __post_init__(self) -> None:
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)
        self._context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._group_of = {
            name: g for g, group in enumerate(self.kv_cache_config.kv_cache_groups) for name in group.layer_names
        }


def make_rig(
    tmp_path,
    *,
    num_layers: int = 2,
    sliding_window: int | None = None,
    num_blocks: int = 160,
    extra: dict | None = None,
    connector: str = "OffloadingConnector",
    max_batch_tokens: int = 512,
    layout: str = "LBHNC",
    load_failure_policy: str = "fail",
    mla: bool = False,
    device: str = "cpu",
    engine_id: str | None = None,
    rig_cls: type[Rig] = Rig,
    hf_overrides: dict | None = None,
    cache_dtype: str = "auto",
    kv_events: bool = False,
    kv_heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    max_model_len: int = MAX_MODEL_LEN,
) -> Rig:
    """A CPU engine whose offloading connector uses kvcopy's spec with ``extra`` keys (``extra`` may name
    another spec), built as ``rig_cls``; ``engine_id`` names vLLM's engine (vLLM draws a uuid without it);
    ``hf_overrides`` and ``cache_dtype`` are vLLM's (the model's config as vLLM resolves it, and the KV cache's
    dtype vLLM records: the stand-in cache stays float32); ``kv_events``: vLLM's KV cache events on (published
    nowhere); ``kv_heads``, ``head_dim`` and ``max_model_len`` size the model (write_model_dir): a block is
    2 x BLOCK_TOKENS x kv_heads x head_dim x 4 bytes a layer."""
    model_dir = write_model_dir(
        str(tmp_path / "model"),
        num_layers,
        sliding_window,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_model_len=max_model_len,
    )
    extra_config = {**SPEC_PATH, "cpu_bytes_to_use": 1 << 22, **(extra or {})}
    extra_config = {key: value for key, value in extra_config.items() if value is not None}  # None: key left out
    transfer = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config,
        "kv_load_failure_policy": load_failure_policy,
        "engine_id": engine_id,
    }
    if connector != "OffloadingConnector":
        transfer["kv_connector_module_path"] = "kvcopy.integrations.vllm"
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=max_model_len,
            hf_overrides=hf_overrides or {},
        ),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True, cache_dtype=cache_dtype),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_batch_tokens,
            max_num_seqs=8,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device=device),
        kv_transfer_config=KVTransferConfig(**transfer),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
    )
    vllm_config.cache_config.kv_cache_layout = layout
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    specs = layer_specs(num_layers, sliding_window, mla, kv_heads=kv_heads, head_dim=head_dim)
    page = 2 * BLOCK_TOKENS * kv_heads * head_dim * 4
    with set_current_vllm_config(vllm_config):
        groups = kv_cache_planning.get_global_kv_cache_groups(vllm_config, [specs])
        kv_cache_config = kv_cache_planning.get_kv_cache_configs(
            vllm_config, [specs], [num_blocks * page * num_layers], groups
        )[0]
        vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_TOKENS,
        )
        try:  # the scheduler's spec may hold a shared region or threads: released if the worker side fails
            worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            caches = allocate_kv_cache(
                kv_cache_config, torch.device(device), vllm_config.cache_config.get_resolved_kv_cache_layout()
            )
            worker.register_kv_caches(caches)
        except BaseException:
            scheduler.shutdown()
            raise
    return rig_cls(vllm_config, scheduler, worker, caches, kv_cache_config)


# --------------------------------------------------------------------------- what a load brings back

PROMPT = [(7 * i + 3) % 250 for i in range(150)]


def expected_block(rig, tokens, name: str, block_index: int) -> torch.Tensor:
    """A full block's page as the forwards write it (above): kv_value of its whole prefix."""
    layer = int(name.split(".")[1])
    return torch.full_like(rig.caches[name][0], kv_value(tokens, (block_index + 1) * BLOCK_TOKENS - 1, layer))


def assert_blocks_hold(rig, request_id: str, tokens, blocks: range, groups=None) -> int:
    """The request's blocks ``blocks`` (indices into its block table) hold the prefix's KV, bitwise, in every
    layer of its groups; returns how many blocks were compared."""
    compared = 0
    table = rig.blocks_of(request_id)
    for name, cache in rig.caches.items():
        group = rig._group_of[name]
        if groups is not None and group not in groups:
            continue
        for index in blocks:
            block = table[group][index]
            if block == 0:  # vLLM's null block: outside a sliding window
                continue
            assert torch.equal(cache[block], expected_block(rig, tokens, name, index)), (name, index, block)
            compared += 1
    return compared


def reload_prefix(rig, prompt, chunk_tokens: int = BLOCK_TOKENS) -> tuple[list[int], int]:
    """Stores ``prompt``, zeroes the cache, reruns it with 3 more tokens: (those tokens, the tokens loaded:
    every complete chunk), asserting the rest was computed."""
    rig.store_and_reset(prompt, zero=True)
    tokens = [*prompt, 5, 6, 7]
    hit = len(prompt) // chunk_tokens * chunk_tokens
    assert len(tokens) - hit in rig.rerun(tokens, keep_blocks=True)  # the rest was loaded
    return tokens, hit


OFFLOAD_INFO = "vllm:kv_offload_config_info"  # vLLM's info metric of an offloading connector's config


def prometheus_logger(rig: Rig) -> CollectorRegistry:
    """vLLM's own Prometheus logger of the connector (``KVConnectorProm``, as vLLM's frontend builds it from the
    config), over a registry of its own, fed the scheduler's connector stats of every step (what
    ``update_from_output`` sends the frontend): a metric the spec the config names does not declare fails the
    step with vLLM's assertion, as it would fail the frontend."""
    registry = CollectorRegistry()

    class Logger(KVConnectorProm):
        _gauge_cls = functools.partial(prometheus_client.Gauge, registry=registry)
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)
        _histogram_cls = functools.partial(prometheus_client.Histogram, registry=registry)

    logger = Logger(rig.vllm_config, ["model_name", "engine"], {0: ["model", "0"]})
    connector = rig.scheduler.connector
    collect = connector.get_kv_connector_stats

    def collected():
        stats = collect()
        if stats is not None and not stats.is_empty():
            logger.observe(stats.to_dict())
        return stats

    connector.get_kv_connector_stats = collected
    return registry


def metric_totals(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample's value in ``registry`` summed by sample name (``..._total``, ``..._count``, ``..._info``)."""
    totals: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def info_labels(registry: CollectorRegistry) -> list[dict[str, str]]:
    """The labels of each series of vLLM's offloading info metric (the config a manager reports) in ``registry``."""
    return [dict(s.labels) for family in registry.collect() for s in family.samples if s.name == OFFLOAD_INFO]
