"""KVCopyDiskTier inside vLLM's tiered offloading: vLLM's real Scheduler and connector in both roles, vLLM's
own TieringOffloadingSpec with a CPU stand-in worker (tests/helpers/vllm_tiers.py), CPU tensors in the GPU
cache's place.

What is checked, each on the KV the rig's forwards write (a function of the prefix, layer and position):
a prompt stored, cascaded to the disk tier, evicted from the primary tier and requested again loads bitwise
what was stored (1 and 2 blocks per chunk, two layers), through the tier's own promotion; a new engine in
another process with the same configuration and path loads the same blocks bitwise; one whose only change is
rope scaling (hf_overrides) or the KV-cache dtype loads nothing and computes every token; a flipped byte in a
stored chunk loads the chunks before it bitwise and computes from it on; an engine killed with SIGKILL while it
cascades, at several points, restarts serving only blocks bitwise equal to what was stored.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")
pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

from kvcopy.integrations.vllm import KVCopyDiskTier
from kvcopy.integrations.vllm.tiers.disk import store_hash
from kvcopy.storage.files import DATA

from helpers.forked import Child
from helpers.vllm import BLOCK_TOKENS, PROMPT, assert_blocks_hold
from helpers.vllm_tiers import REGION_PATH, make_tiering_rig, record_calls

TESTS = str(Path(__file__).resolve().parents[1])
ROW_PAD = 4096  # vLLM rounds a row up to the page
TIER_BYTES = 1 << 22  # room for every chunk of the prompt


def disk_tier(path) -> dict:
    return {
        "type": "KVCopyDiskTier",
        "module_path": "kvcopy.integrations.vllm",
        "path": str(path),
        "bytes_to_use": TIER_BYTES,
    }


def the_tier(rig) -> KVCopyDiskTier:
    (tier,) = rig.tiers
    assert isinstance(tier, KVCopyDiskTier)
    return tier


def computed_again(rig, tokens) -> int:
    """Requests ``tokens`` as "again" until its prompt is in; the tokens its forwards computed."""
    return sum(rig.rerun(list(tokens), keep_blocks=True))


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_a_prompt_cascaded_to_the_disk_tier_loads_back_bitwise(tmp_path, blocks_per_chunk):
    rig = make_tiering_rig(tmp_path, secondary_tiers=[disk_tier(tmp_path / "tier")], blocks_per_chunk=blocks_per_chunk)
    try:
        tier = the_tier(rig)
        loads = record_calls(tier, "submit_load")
        tokens, hit = rig.reload_from_tiers(PROMPT)
        assert hit >= 8 * BLOCK_TOKENS
        assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS
        assert len(loads) == 1  # the chunks came from the disk tier, in one promotion
        (job,) = loads[0]
        assert len(list(job.keys)) == hit // (BLOCK_TOKENS * blocks_per_chunk)
        assert tier.store.num_blocks == TIER_BYTES // tier.block_size_bytes
    finally:
        rig.close()
    assert not rig.region_left_behind


RESTART_WRITER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from helpers.vllm import PROMPT
from helpers.vllm_tiers import make_tiering_rig
from kvcopy.integrations.vllm.tiers.disk import store_hash
tier = {tier!r}
rig = make_tiering_rig(Path({tmp!r}), secondary_tiers=[tier])
try:
    rig.add("first", PROMPT)
    rig.run()
    rig.drain()
    store = rig.tiers[0].store
    print("stored", sum(store.contains(store_hash(k)) for k in rig.offload_keys(PROMPT)), flush=True)
finally:
    rig.close()
"""


@pytest.mark.slow
def test_a_new_engine_process_with_the_same_configuration_loads_the_same_blocks(tmp_path):
    tier = disk_tier(tmp_path / "tier")
    code = RESTART_WRITER.format(tests=TESTS, tier=tier, tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"stored {len(PROMPT) // BLOCK_TOKENS}" in done.stdout  # every complete chunk reached the disk
    rig = make_tiering_rig(tmp_path, secondary_tiers=[tier])
    try:
        loads = record_calls(the_tier(rig), "submit_load")
        tokens = [*PROMPT, 5, 6, 7]
        hit = len(PROMPT) // BLOCK_TOKENS * BLOCK_TOKENS
        assert computed_again(rig, tokens) == len(tokens) - hit
        assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS
        assert len(loads) == 1
    finally:
        rig.close()


@pytest.mark.parametrize(
    "changed",
    [{"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}}, {"cache_dtype": "fp8"}],
    ids=["rope_scaling", "kv_cache_dtype"],
)
def test_an_engine_whose_only_change_is_rope_scaling_or_the_kv_dtype_loads_nothing(tmp_path, changed):
    tier = disk_tier(tmp_path / "tier")
    rig = make_tiering_rig(tmp_path, secondary_tiers=[tier])
    try:
        rig.add("first", PROMPT)
        rig.run()
        rig.drain()
    finally:
        rig.close()
    rig = make_tiering_rig(tmp_path, secondary_tiers=[tier], **changed)
    try:
        loads = record_calls(the_tier(rig), "submit_load")
        tokens = [*PROMPT, 5, 6, 7]
        assert computed_again(rig, tokens) == len(tokens)  # every token computed
        assert loads == []
        assert assert_blocks_hold(rig, "again", tokens, range(len(PROMPT) // BLOCK_TOKENS))  # computed right
    finally:
        rig.close()


def test_a_flipped_byte_loads_the_chunks_before_it_and_computes_from_it_on(tmp_path):
    rig = make_tiering_rig(tmp_path, secondary_tiers=[disk_tier(tmp_path / "tier")])
    try:
        tier = the_tier(rig)
        rig.store_cascade_evict(PROMPT)
        keys = rig.offload_keys(PROMPT)
        bad = 4
        (slot,) = tier.store.match([store_hash(keys[bad])])
        with open(os.path.join(tier.store.path, DATA), "r+b") as f:
            f.seek(slot * tier.block_size_bytes + 5)
            byte = f.read(1)
            f.seek(slot * tier.block_size_bytes + 5)
            f.write(bytes([byte[0] ^ 0x01]))
        tier.store.drop_page_cache()
        tokens = [*PROMPT, 5, 6, 7]
        assert computed_again(rig, tokens) == len(tokens) - bad * BLOCK_TOKENS  # computed from the bad chunk on
        assert assert_blocks_hold(rig, "again", tokens, range(bad)) == 2 * bad  # those before it: loaded, bitwise
        assert assert_blocks_hold(rig, "again", tokens, range(len(PROMPT) // BLOCK_TOKENS))  # the rest computed
        assert not tier.store.contains(store_hash(keys[bad]))  # dropped: never offered again
    finally:
        rig.close()


CRASH_WRITER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from helpers.vllm_tiers import make_tiering_rig
sys.path.insert(0, {here!r})
from test_vllm_disk_tier_engine import crash_prompt
rig = make_tiering_rig(Path({tmp!r}), secondary_tiers=[{tier!r}], engine_id={engine_id!r})
for i in range({prompts}):
    rig.add(f"p{{i}}", crash_prompt(i))
    rig.run()
    print("ran", i, flush=True)
rig.drain()
print("drained", flush=True)
"""
CRASH_PROMPTS = 16
CRASH_AFTER = (1, 3, 6, 10, 14)  # prompts run before the SIGKILL


def crash_prompt(i: int) -> list[int]:
    """Prompt i of the crash test: 5 chunks, its own tokens from the first."""
    return [(i * 37 + 11 * t + 1) % 250 for t in range(5 * BLOCK_TOKENS + 3)]


@pytest.mark.slow
def test_an_engine_killed_mid_cascade_restarts_serving_only_blocks_it_stored(tmp_path):

    loaded_total = 0
    for kill_after in CRASH_AFTER:
        tier = disk_tier(tmp_path / f"tier-{kill_after}")
        engine_id = f"kvcopy-crash-{uuid.uuid4().hex[:12]}"
        code = CRASH_WRITER.format(
            tests=TESTS,
            here=str(Path(__file__).parent),
            tmp=str(tmp_path),
            tier=tier,
            engine_id=engine_id,
            prompts=CRASH_PROMPTS,
        )
        try:
            with Child(code) as child:
                for line in child.lines():
                    if line.split() == ["ran", str(kill_after)]:
                        child.kill()  # its cascades of the last prompts are in flight
                        break
                child.communicate()
        finally:
            region = glob.escape(REGION_PATH.format(engine_id=engine_id))
            for leftover in glob.glob(region) + glob.glob(region + ".*"):
                os.unlink(leftover)  # a killed engine leaves its region (and its segments) behind
        assert child.returncode == -signal.SIGKILL, f"the engine ended before its kill ({child.returncode})"
        rig = make_tiering_rig(tmp_path, secondary_tiers=[tier])
        try:
            for i in range(kill_after + 2):
                tokens = [*crash_prompt(i), 1, 2]
                rig.add(f"check{i}", tokens, max_tokens=4)
                rig.run_until_prefilled(f"check{i}")
                computed = sum(f.get(f"check{i}", 0) for f in rig.forwards)
                loaded_total += len(tokens) - computed
                full = len(tokens) // BLOCK_TOKENS
                assert assert_blocks_hold(rig, f"check{i}", tokens, range(full)) == 2 * full  # loaded or computed
        finally:
            rig.close()
    assert loaded_total > 0  # the restarts did load what the killed engines had stored
