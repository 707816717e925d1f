"""kvcopy inside a real engine: transformers' continuous batching offloads, decides and reloads through it.

Tiny random-weight models (tests/helpers/hf.py), 10 requests of 40-300 prompt
tokens and 40 new tokens, greedy, on a cache small enough that requests are
preempted several times. Each test asserts that the path it is about ran.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is part of the test install")

from transformers.generation.continuous_batching import continuous_api, offloading_manager

import kvcopy
from kvcopy.integrations import transformers as kvt
from kvcopy.integrations.common.online_planner import predict_paths
from kvcopy.integrations.transformers import manager as _hf_manager

from helpers import HAS_CUDA, gpu
from helpers.hf import (
    MODEL_CASES,
    ROOMY_BLOCKS,
    ModelCase,
    RecordingEngine,
    crossover_profile,
    transformers_own_offload,
)

pytestmark = pytest.mark.engine

DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]
LLAMA = MODEL_CASES[0]
_references: dict[tuple[str, str, str], dict[str, list[int]]] = {}


def reference(case: ModelCase, model: torch.nn.Module, device: str) -> dict[str, list[int]]:
    """Tokens of a run whose cache never preempts (computed once per model and device)."""
    key = (case.name, str(model.dtype), device)
    if key not in _references:
        _references[key] = case.generate(model, ROOMY_BLOCKS)
    return _references[key]


def assert_clean(stats: kvt.OffloadStats) -> None:
    """Every host block returned, and transformers' own manager back in place."""
    assert stats.host_blocks_in_use == 0
    assert continuous_api.OffloadingManager is offloading_manager.OffloadingManager


# --------------------------------------------------------------------------- identical tokens


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_fp32_tokens_identical_to_never_preempted(case, policy, device):
    model = case.build(torch.float32, device)
    expected = reference(case, model, device)
    profile = crossover_profile(model) if policy == "auto" else None
    # learn=False: the crossover profile, not what is learned, decides, so that "auto" takes both paths
    with kvt.offloading(model, host_gib=0.25, policy=policy, profile=profile, learn=False) as stats:
        assert case.generate(model) == expected
    if policy in ("offload", "auto"):
        assert stats.reloaded_requests > 0 and stats.offloaded_blocks > 0
        assert stats.reloaded_requests == stats.offloaded_requests
    if policy in ("recompute", "auto"):
        assert stats.recomputed_requests > 0
    if policy == "recompute":
        assert stats.offloaded_requests == 0
    assert len(stats.decisions) == stats.offloaded_requests + stats.recomputed_requests
    assert_clean(stats)


@pytest.mark.slow
def test_auto_follows_the_planner_and_measures_the_path_taken():
    model = LLAMA.build()
    profile = crossover_profile(model)
    with kvt.offloading(model, host_gib=0.25, policy="auto", profile=profile, learn=False) as stats:
        LLAMA.generate(model)
    planner = kvcopy.Planner.from_profile(profile, kvt.model_spec(model))
    assert {d.action for d in stats.decisions} == {"reload", "recompute"}
    assert stats.profile is profile  # learn=False: the calibration decides
    for d in stats.decisions:
        # in forwards of at most the cache's batch token budget (helpers.hf: max_batch_tokens=256)
        reload, recompute = predict_paths(planner, d.prefix_tokens, d.new_tokens, d.reload_nbytes, 256)
        assert (d.predicted_reload_s, d.predicted_recompute_s) == (reload, recompute)
        assert reload == planner.t_load_nbytes(d.reload_nbytes) + sum(
            planner.t_prefill(min(256, d.new_tokens - done), d.prefix_tokens + done)
            for done in range(0, d.new_tokens, 256)
        )
        assert d.action == ("reload" if reload <= recompute else "recompute")
        assert d.reason.startswith("planner (calibrated): ") and d.observations == 0
        assert d.prefix_tokens > 0 and d.new_tokens > 0 and d.reload_blocks * 16 >= d.prefix_tokens
    measured = [d.measured_s for d in stats.decisions if d.measured_s is not None]
    assert measured and all(s > 0 for s in measured)


# --------------------------------------------------------------------------- bf16: against transformers' own offload


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_offload_matches_transformers_own_offload_and_reloads_bitwise(monkeypatch, device):
    model = LLAMA.build(torch.bfloat16, device)
    with monkeypatch.context() as patch:
        transformers_own_offload(patch)
        theirs = LLAMA.generate(model, cpu_offload_space=0.25)
    RecordingEngine.offloaded.clear()
    RecordingEngine.reloaded_blocks = 0
    monkeypatch.setattr(_hf_manager, "TransferEngine", RecordingEngine)
    with kvt.offloading(model, host_gib=0.25, policy="offload") as stats:
        ours = LLAMA.generate(model)
    assert ours == theirs
    assert stats.reloaded_requests > 0
    assert RecordingEngine.reloaded_blocks >= stats.reloaded_requests
    assert_clean(stats)


# --------------------------------------------------------------------------- ordering does not depend on timing


# Offload copies held back on the copy stream (GPU) or in the copy worker (CPU) for this long each.
_SLOW_COPY_SECONDS = 0.05
_GPU_SLEEP_CYCLES = 100_000_000  # about 50 ms at 2 GHz


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MODEL_CASES[:2], ids=lambda c: c.name)
def test_slow_offload_copies_keep_tokens_identical(monkeypatch, case, device):
    """Without kvcopy's waits, the next forward overwrites blocks before the held-back offload reads them
    (tried: the tokens of a reloaded request then differ)."""
    model = case.build(torch.float32, device)
    expected = reference(case, model, device)
    real_copy = _hf_manager.TransferEngine._copy
    slowed = []

    def slow_copy(self, method, src, src_ids, dst, dst_ids, layer):
        if src is self.kv:  # an offload: device pages -> host
            slowed.append(src_ids.numel())
            if self.kv.device.type == "cuda":
                torch.cuda._sleep(_GPU_SLEEP_CYCLES)  # runs on the copy stream, ahead of the copy
            else:
                time.sleep(_SLOW_COPY_SECONDS)  # runs in the copy worker
        real_copy(self, method, src, src_ids, dst, dst_ids, layer)

    monkeypatch.setattr(_hf_manager.TransferEngine, "_copy", slow_copy)
    with kvt.offloading(model, host_gib=0.25, policy="offload") as stats:
        assert case.generate(model) == expected
    assert slowed and stats.reloaded_requests > 0
    assert_clean(stats)


# --------------------------------------------------------------------------- full pool, cancellation, failures


@pytest.mark.slow
def test_full_host_pool_falls_back_to_recompute():
    model = LLAMA.build()
    expected = reference(LLAMA, model, "cpu")
    block_nbytes = kvt.model_spec(model).kv_bytes(16)
    with kvt.offloading(model, host_gib=12 * block_nbytes / 2**30, policy="offload") as stats:
        assert LLAMA.generate(model) == expected
    full = [d for d in stats.decisions if d.reason == "host pool full"]
    assert full and all(d.action == "recompute" and d.reload_blocks > 12 for d in full)
    assert stats.recomputed_requests == len(full) and stats.reloaded_requests > 0
    assert_clean(stats)
    assert LLAMA.generate(model) == expected  # transformers on its own afterwards


@pytest.mark.slow
def test_cancelled_offloaded_request_frees_its_host_blocks(monkeypatch):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = LLAMA.build()
    expected = reference(LLAMA, model, "cpu")
    real_offload = _hf_manager.KvcopyOffloadingManager._offload_to_cpu
    cancelled: list[str] = []

    def offload_then_cancel(self, victims, victim_block_tables):
        kept = real_offload(self, victims, victim_block_tables)
        if kept and not cancelled:  # cancel the first request kvcopy kept on the host, before it is reloaded
            cancelled.append(sorted(kept)[0])
            self.scheduler.set_request_cancellation(cancelled[0])
        return kept

    monkeypatch.setattr(_hf_manager.KvcopyOffloadingManager, "_offload_to_cpu", offload_then_cancel)
    gen = GenerationConfig(max_new_tokens=LLAMA.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=LLAMA.num_blocks, page_size=16, max_batch_tokens=256)
    with kvt.offloading(model, host_gib=0.25, policy="offload") as stats:
        with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, timeout=5
        ) as manager:
            for i, prompt in enumerate(LLAMA.prompts()):
                manager.add_request(prompt, request_id=f"req_{i}", max_new_tokens=LLAMA.new_tokens)
            results = {}
            while len(results) < LLAMA.num_requests - len(cancelled) or not cancelled:
                result = manager.get_result(timeout=30)
                assert result is not None, "generation stalled"
                if result.is_finished():
                    results[result.request_id] = list(result.generated_tokens)
        assert cancelled and cancelled[0] not in results
        assert results == {rid: tokens for rid, tokens in expected.items() if rid != cancelled[0]}
        assert stats.host_blocks_in_use == 0  # freed at cancellation, not only when the context closes
    assert_clean(stats)
    assert LLAMA.generate(model) == expected  # transformers on its own afterwards


@pytest.mark.slow
def test_failure_mid_generation_returns_every_host_block():
    model = LLAMA.build()
    expected = reference(LLAMA, model, "cpu")
    with kvt.offloading(model, host_gib=0.25, policy="offload") as stats:

        def fail_after_an_offload(module, args):
            if stats.offloaded_requests > stats.reloaded_requests:  # a request's KV is on the host right now
                raise RuntimeError("injected failure")

        hook = model.model.layers[0].register_forward_pre_hook(fail_after_an_offload)
        try:
            with pytest.raises(RuntimeError, match="injected failure"):
                LLAMA.generate(model)
        finally:
            hook.remove()
        assert stats.offloaded_requests > stats.reloaded_requests  # it failed with KV on the host
        assert stats.host_blocks_in_use == 0
        assert LLAMA.generate(model) == expected  # the same context still works
    assert_clean(stats)
    assert LLAMA.generate(model) == expected


def test_exception_in_the_context_restores_transformers():
    model = LLAMA.build()
    with pytest.raises(KeyError, match="from the caller"), kvt.offloading(model, policy="offload") as stats:
        assert continuous_api.OffloadingManager is not offloading_manager.OffloadingManager
        raise KeyError("from the caller")
    assert_clean(stats)
    with kvt.offloading(model, policy="offload"):  # and it can be entered again
        pass


# --------------------------------------------------------------------------- bad input, nesting, versions


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(host_gib=0), ValueError, "host_gib"),
        (dict(host_gib=-1.0), ValueError, "host_gib"),
        (dict(host_gib=float("nan")), ValueError, "host_gib"),
        (dict(host_gib="1"), TypeError, "host_gib"),
        (dict(host_gib=True), TypeError, "host_gib"),
        (dict(policy="sometimes"), ValueError, "policy.*'auto', 'offload', 'recompute'"),
        (dict(profile="/no/such/profile.json"), FileNotFoundError, "/no/such/profile.json"),
        (dict(profile=3), TypeError, "profile"),
        (dict(method="fast"), ValueError, "method"),
        (dict(learn="yes"), TypeError, "learn"),
        (dict(save_profile=3), TypeError, "save_profile"),
        (dict(learn=False, save_profile="out.json"), ValueError, "save_profile.*learn=True"),
        (dict(policy=1), TypeError, "policy: expected one of .*, got int 1"),
        (dict(policy=None), TypeError, "policy: expected one of"),
        (dict(method=None), TypeError, "method: expected 'auto' or one of .*, got NoneType"),
        (dict(learn=1), TypeError, "learn: expected a bool, got int"),
        (dict(host_gib=1e6), ValueError, "host_gib: expected at most this machine's physical memory"),
        (dict(host_gib=10**400), ValueError, "host_gib"),
    ],
)
def test_bad_arguments_fail_before_anything_is_patched(kwargs, error, match):
    model = LLAMA.build()
    with pytest.raises(error, match=match), kvt.offloading(model, **kwargs):
        pytest.fail("the context must not open")
    assert continuous_api.OffloadingManager is offloading_manager.OffloadingManager


def test_a_host_pool_beyond_physical_memory_is_refused_at_entry(monkeypatch):
    """Against the memory the machine has (2 GiB here): more is a ValueError naming host_gib before any pool is
    made; up to it the context opens (the pool is made by the first generation, not here)."""
    monkeypatch.setattr(kvt, "_physical_memory_bytes", lambda: 2 << 30)
    monkeypatch.setattr(kvt, "OffloadSession", None)  # a refusal must come before the session (and its pools)
    model = LLAMA.build()
    with (
        pytest.raises(ValueError, match=r"host_gib: .*physical memory \(2.0 GiB\).*got 2.5"),
        kvt.offloading(model, host_gib=2.5, policy="offload"),
    ):
        pytest.fail("the context must not open")
    monkeypatch.undo()
    monkeypatch.setattr(kvt, "_physical_memory_bytes", lambda: 2 << 30)
    with kvt.offloading(model, host_gib=2, policy="offload") as stats:
        assert stats.host_blocks_in_use == 0


def test_the_machines_physical_memory_is_what_the_os_reports():
    expected = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert kvt._physical_memory_bytes() == expected > 0


def read_only_directory(tmp_path: Path) -> Path:
    """A directory where this process cannot create a file: mode 0o555, or for root (whom modes do not stop)
    /proc, where no one can."""
    if os.geteuid() != 0:
        directory = tmp_path / "read-only"
        directory.mkdir()
        directory.chmod(0o555)
        return directory
    if not os.path.isdir("/proc/self"):
        pytest.skip("running as root without /proc: no read-only directory to try")
    return Path("/proc")


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("directory", "is a directory; expected the path of a file"),
        ("under a file", "lies under .*, which is a file, not a directory"),
        ("read-only", "cannot write .*: cannot create files in "),
    ],
)
def test_a_save_profile_that_cannot_be_written_is_refused_at_entry(tmp_path, where, message):
    """Refused when the context opens, not when it closes after the run (when the learned profile would be
    lost); nothing is written and nothing patched."""
    (tmp_path / "a file").write_text("kept")
    path = {
        "directory": tmp_path,
        "under a file": tmp_path / "a file" / "sub" / "learned.json",
        "read-only": read_only_directory(tmp_path) / "learned.json",
    }[where]
    before = sorted(p.name for p in tmp_path.iterdir())
    model = LLAMA.build()
    with (
        pytest.raises(ValueError, match=f"save_profile: .*{message}"),
        kvt.offloading(model, policy="offload", save_profile=path),
    ):
        pytest.fail("the context must not open")
    assert continuous_api.OffloadingManager is offloading_manager.OffloadingManager
    assert sorted(p.name for p in tmp_path.iterdir()) == before and (tmp_path / "a file").read_text() == "kept"
    assert path == tmp_path or not path.exists()


def test_a_save_profile_in_missing_directories_opens_and_writes_them_at_the_end(tmp_path):
    path = tmp_path / "new" / "dirs" / "learned.json"
    model = LLAMA.build()
    with kvt.offloading(model, policy="offload", profile=crossover_profile(model), save_profile=path) as stats:
        assert list(tmp_path.iterdir()) == []  # the check wrote nothing
    assert kvcopy.Profile.load(path).to_dict() == stats.profile.to_dict()


def test_a_save_that_fails_at_the_end_says_the_profile_is_still_in_stats(tmp_path):
    path = tmp_path / "learned.json"
    model = LLAMA.build()
    with (
        pytest.raises(OSError, match=r"save_profile: the learned profile could not be written .*stats\.profile"),
        kvt.offloading(model, policy="offload", profile=crossover_profile(model), save_profile=path) as stats,
    ):
        path.mkdir()  # the file system changed after the entry's check
    assert stats.profile is not None


@pytest.mark.parametrize("content", ["{not json", "[]", '{"hardware": {}}'])
def test_a_bad_profile_file_fails_as_profile_load_fails_on_it(tmp_path, content):
    """offloading(profile=path) surfaces the loader's own error (its type and its message, naming the file),
    not a vaguer one of its own, before anything is patched."""
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(Exception) as loading:
        kvcopy.Profile.load(path)
    model = LLAMA.build()
    with pytest.raises(type(loading.value)) as opening, kvt.offloading(model, profile=path):
        pytest.fail("the context must not open")
    assert type(opening.value) is type(loading.value) and str(opening.value) == str(loading.value)
    assert continuous_api.OffloadingManager is offloading_manager.OffloadingManager


@pytest.mark.parametrize("policy", ["auto", "offload"])
def test_not_a_model_is_a_type_error(policy):
    with (
        pytest.raises(TypeError, match="model: expected a transformers model"),
        kvt.offloading(object(), policy=policy),
    ):
        pass


def test_nesting_and_a_second_thread_are_refused():
    import threading

    model = LLAMA.build()
    errors: list[BaseException] = []

    def enter_from_another_thread():
        try:
            with kvt.offloading(model, policy="offload"):
                pass
        except RuntimeError as err:
            errors.append(err)

    with kvt.offloading(model, policy="offload"):
        with pytest.raises(RuntimeError, match="already open"), kvt.offloading(model, policy="offload"):
            pass
        thread = threading.Thread(target=enter_from_another_thread)
        thread.start()
        thread.join()
    assert len(errors) == 1 and "already open" in str(errors[0])
    with kvt.offloading(model, policy="offload"):  # free again once closed
        pass


def test_unsupported_transformers_version_is_refused(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    with (
        pytest.raises(RuntimeError, match=r">=5\.23\.0,<5\.24.*5\.24\.0"),
        kvt.offloading(LLAMA.build(), policy="offload"),
    ):
        pass
    assert continuous_api.OffloadingManager is offloading_manager.OffloadingManager


def test_moved_internals_are_refused(monkeypatch):
    monkeypatch.delattr(offloading_manager.OffloadingManager, "_offload_to_cpu")
    with (
        pytest.raises(RuntimeError, match=r"_offload_to_cpu.*supports transformers"),
        kvt.offloading(LLAMA.build(), policy="offload"),
    ):
        pass


@pytest.mark.slow
def test_without_transformers_the_module_imports_and_offloading_names_the_extra():
    import subprocess
    import sys

    code = (
        "import sys, types; sys.modules['transformers'] = None\n"
        "from kvcopy.integrations import transformers as kvt\n"
        "model = types.SimpleNamespace(generate_batch=print, config=types.SimpleNamespace(to_dict=dict))\n"
        "try:\n    kvt.offloading(model, policy='offload').__enter__()\n"
        "except ImportError as err:\n    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'kvcopy[transformers]'" in out.stdout


@pytest.mark.slow
def test_auto_without_a_profile_offloads_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setenv("KVCOPY_PROFILE", "none")  # no default profile either
    monkeypatch.setattr(kvcopy.profile, "_default", {})
    model = LLAMA.build()
    with (
        caplog.at_level(logging.WARNING, logger="kvcopy.integrations.transformers"),
        kvt.offloading(model, policy="auto", profile=None, learn=False) as stats,
    ):
        LLAMA.generate(model)
    assert stats.reloaded_requests > 0 and stats.recomputed_requests == 0
    assert all(d.predicted_reload_s is None and "no profile" in d.reason for d in stats.decisions)
    assert sum("no calibrated profile" in r.getMessage() for r in caplog.records) == 1
    assert stats.profile is None


def test_model_spec_comes_from_the_live_config():
    model = LLAMA.build()
    spec = kvt.model_spec(model)
    config = model.config
    # K and V of every layer, fp32: what transformers' paged cache stores per token.
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // 4) * 4
    assert spec.kv_bytes_per_token() == per_token
    assert kvt.model_spec(LLAMA.build(torch.bfloat16)).kv_bytes_per_token() == per_token // 2
