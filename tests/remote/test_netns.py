"""kvcopy.remote between two test hosts: network namespaces joined by a tbf-shaped veth pair, a kvcopy peer in
each, UCX over TCP (tests/helpers/netns.py). The link is real: bytes cross a network stack at a known rate,
and it can be brought down or its peer killed in the middle of a transfer.

Skipped, saying why, where the sandbox cannot make namespaces (not root, no iproute2); CI installs iproute2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="kvcopy.remote needs the nixl extra (pip install 'kvcopy[nixl]')")

import kvcopy
from kvcopy.calibration.network import REMOTE_METHOD

from helpers import HANG_TIMEOUT_S, SUBPROCESS_TIMEOUT_S
from helpers.netns import RATES_BIT_S, NetnsUnavailable, NsPeer, PeerError, netns_link

KVCOPY_CLI = [sys.executable, "-m", "kvcopy"]

pytestmark = [pytest.mark.netns, pytest.mark.slow]

# Llama-3.1-8B's 16-token blocks (2 MiB each): 256 of them are a 4096-token prefix.
BLOCK_TOKENS, POOL_BLOCKS = 16, 256
BLOCK_NBYTES = 2 << 20
# How close measured and predicted must be: the 15% (1-2% measured on a quiet machine).
TOLERANCE = 0.15
# At 1 Gbit/s the 2-core VM's CPU, not the shaping, can set the rate: TCP over a veth pushed 0.95 Gbit/s on a
# quiet machine and 0.80-0.84 in CI runs of the whole suite (where 250 Mbit/s still held within 6%). So the fast
# rate is checked to be no faster than the link and clearly above the slow one, not within TOLERANCE of 1 Gbit/s.
CPU_BOUND_FLOOR = 0.6
# Measurements of the link at one rate, at most: the first, and again while one is below its rate's band.
MEASURE_TRIES = 3
# A fault's wait: long enough that the read is well under way, short beside the test.
FAULT_TIMEOUT_S = 2.0
# How far past its timeout a wait may return: one NIXL poll, which on a loaded 2-core machine blocked for
# up to 6 s; only a wait that ignores its deadline reaches this.
DEADLINE_SLACK_S = 60.0
# Blocks a fault test reads: 128 MiB, about 1.1 s at 1 Gbit/s, so the fault lands in the middle.
FAULT_BLOCKS = 64


@pytest.fixture(scope="module")
def link():
    try:
        with netns_link("1gbit") as made:
            yield made
    except NetnsUnavailable as why:
        pytest.skip(f"this sandbox cannot make network namespaces: {why}")


@pytest.fixture(scope="module")
def peers(link, profiles):
    """("a", "b"): the reader in namespace a, the holder in b, each with a pool of 256 llama-8b blocks. Made after
    the link is calibrated (``profiles``): each peer's NIXL progress thread busy-polls a core, and over UCX TCP
    the calibration's own two peers need the VM's two cores (beside two more, 1 Gbit/s calibrated at 0.80)."""
    a, b = NsPeer(link, 0, "netns-a"), NsPeer(link, 1, "netns-b")
    try:
        descriptors = a.ask("pool", "llama-8b", POOL_BLOCKS, 1), b.ask("pool", "llama-8b", POOL_BLOCKS, 2)
        a.ask("connect", descriptors[1]), b.ask("connect", descriptors[0])
        yield a, b
    finally:
        a.close()
        b.close()


def _random_ids(count: int, seed: int) -> list[int]:
    return torch.randperm(POOL_BLOCKS, generator=torch.Generator().manual_seed(seed))[:count].tolist()


def test_reads_and_writes_are_bitwise_right_and_cross_the_link(link, peers):
    a, b = peers
    remote_ids, local_ids = _random_ids(32, 1), _random_ids(32, 2)
    received = link.rx_bytes(0)
    _seconds, _ = a.ask("read", "netns-b", remote_ids, local_ids, HANG_TIMEOUT_S)
    assert a.ask("digests", local_ids) == b.ask("digests", remote_ids)
    assert link.rx_bytes(0) - received >= 32 * BLOCK_NBYTES  # the bytes crossed the veth (not shared memory)
    sources, targets = _random_ids(16, 3), _random_ids(16, 4)
    received = link.rx_bytes(1)
    a.ask("write", "netns-b", sources, targets, HANG_TIMEOUT_S)
    assert b.ask("digests", targets) == a.ask("digests", sources)
    assert link.rx_bytes(1) - received >= 16 * BLOCK_NBYTES


def _serving_peer(link, descriptor, name: str) -> subprocess.Popen:
    """``kvcopy peer`` in namespace b, once its descriptor file is written whole."""
    serving = subprocess.Popen(link.argv(1, [*KVCOPY_CLI, "peer", "--descriptor", str(descriptor), "--name", name]))
    deadline = time.monotonic() + HANG_TIMEOUT_S
    while not descriptor.exists() or not descriptor.stat().st_size:
        if serving.poll() is not None or time.monotonic() >= deadline:
            serving.terminate()
            serving.wait(HANG_TIMEOUT_S)
            pytest.fail(f"kvcopy peer wrote no descriptor (exit status {serving.returncode})")
        time.sleep(0.2)
    time.sleep(0.5)  # the descriptor is written in one call; let it reach the disk whole
    return serving


# The link measured into a profile already calibrated, run in namespace a (argv: base, descriptor, out):
# add_remote_link, what ``kvcopy calibrate --remote`` runs after the local calibration (the CLI's own path is
# tests/calibration/test_calibrate_network.py's, over a loopback peer). The quick sweep's ranges are capped at
# 16 MiB a read (2 MiB ranges 1 and 8 a read), a quarter of its bytes: at 250 Mbit/s its 64 MiB reads take 2 s
# each.
_ADD_REMOTE_LINK = """
import sys
import kvcopy
from kvcopy.calibration.network import RangeSweep, add_remote_link
base, descriptor, out = sys.argv[1:]
sweep = RangeSweep((16384, 262144, 2 << 20), (1, 8), 16 << 20, 5)
with open(descriptor, "rb") as f:
    add_remote_link(kvcopy.Profile.load(base), f.read(), progress=False, sweep=sweep).save(out)
"""


def _link_fit(profile: kvcopy.Profile):
    return profile.directions["r2h"][REMOTE_METHOD].by_block_nbytes[2 << 20]  # 2 MiB ranges: a llama-8b block


def _calibrate(link, tmp_path, rate: str, base: kvcopy.Profile) -> kvcopy.Profile:
    """The link at ``rate``, measured in namespace a against ``kvcopy peer`` in b, into ``base``: this machine's
    local calibration (its local fits and prefill do not depend on the link: one serves both rates).

    A busy machine only slows a measurement, and the shaping caps it: one below its rate's band is taken again
    (up to MEASURE_TRIES in all) and the fastest kept, so that a test fails on what was measured, not on a
    moment when the 2 cores were taken."""
    descriptor, out = tmp_path / f"{rate}.descriptor", tmp_path / f"{rate}.json"
    serving = _serving_peer(link, descriptor, f"netns-peer-{rate}")
    base.save(out)
    best: kvcopy.Profile | None = None
    lowest = _lowest_rate(rate) * RATES_BIT_S[rate] / 8
    try:
        for attempt in range(MEASURE_TRIES):
            if best is not None:
                if _link_fit(best).beta_bytes_per_s >= lowest:
                    break
                print(f"{rate}: {_link_fit(best).beta_bytes_per_s * 8e-9:.3f} Gbit/s, below its band: measuring again")
            again = tmp_path / f"{rate}-{attempt}.json"
            command = [sys.executable, "-c", _ADD_REMOTE_LINK, str(out), str(descriptor), str(again)]
            done = subprocess.run(link.argv(0, command), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
            assert done.returncode == 0, done.stderr
            measured = kvcopy.Profile.load(again)
            if best is None or _link_fit(measured).beta_bytes_per_s > _link_fit(best).beta_bytes_per_s:
                best = measured
    finally:
        serving.terminate()
        serving.wait(HANG_TIMEOUT_S)
    assert best is not None
    return best


def _lowest_rate(rate: str) -> float:
    """The share of the shaped rate below which a measurement of ``rate`` is taken again (and the test fails)."""
    return CPU_BOUND_FLOOR if rate == "1gbit" else 1 - TOLERANCE


@pytest.fixture(scope="module")
def profiles(link, tmp_path_factory, cpu_calibration):
    """The link calibrated at each rate into this machine's quick local calibration (the link is left at 1
    Gbit/s)."""
    measured: dict[str, kvcopy.Profile] = {}
    try:
        for rate in ("1gbit", "250mbit"):
            link.shape(rate)
            measured[rate] = _calibrate(link, tmp_path_factory.mktemp("calibrate"), rate, cpu_calibration)
    finally:
        link.shape("1gbit")
    return measured


@pytest.mark.parametrize("rate", ["1gbit", "250mbit"])
def test_calibrate_remote_measures_the_shaped_rate(profiles, rate):
    profile = profiles[rate]
    fit = _link_fit(profile)
    print(f"{rate}: 2 MiB ranges at {fit.beta_bytes_per_s * 8 / 1e9:.3f} Gbit/s + {fit.alpha_s * 1e3:.2f} ms; "
          f"{profile.hardware['remote_transport']}")  # fmt: skip
    shaped = RATES_BIT_S[rate] / 8
    # What the link carried in the same run: the calibration's contiguous read (its peak). When even that fell
    # below the band (every try on a machine too busy to push the shaped rate), the fit is held to it instead.
    peak = profile.peaks["r2h"]
    carried = shaped if peak >= _lowest_rate(rate) * shaped else peak
    assert _lowest_rate(rate) * carried <= fit.beta_bytes_per_s <= (1 + TOLERANCE) * shaped
    if rate == "1gbit":
        slow = _link_fit(profiles["250mbit"])
        assert fit.beta_bytes_per_s > 2 * slow.beta_bytes_per_s  # the shaping is what was measured
    assert profile.hardware["remote_transport"].startswith("network")


def _planner(profile: kvcopy.Profile) -> kvcopy.Planner:
    return kvcopy.Planner.from_profile(profile, kvcopy.ModelSpec.preset("llama-3.1-8b"), block_tokens=BLOCK_TOKENS)


def _decide(planner: kvcopy.Planner, tokens: int) -> kvcopy.Decision:
    """The planner's fetch of ``tokens`` as the engine moves them: whole blocks."""
    return planner.decide(tokens, 1, source="peer", load_nbytes=-(-tokens // BLOCK_TOKENS) * BLOCK_NBYTES)


def _measured_fetch(link, peers, rate: str, tokens: int, chunks: int, *, with_reads: bool) -> tuple[float, float]:
    """The medians of three fetches of ``tokens`` (read over the link and reload into a PagedKV) at ``rate``, and
    with ``with_reads`` of three plain reads of the same blocks, each right after a fetch (the link as that fetch
    found it; else 0.0)."""
    a, _ = peers
    blocks = -(-tokens // BLOCK_TOKENS)
    link.shape(rate)
    fetches, reads = [], [0.0]
    try:
        ids = _random_ids(blocks, tokens)
        for _ in range(3):
            fetches.append(a.ask("fetch", "netns-b", ids, ids, chunks, HANG_TIMEOUT_S))
            if with_reads:
                reads.append(a.ask("read", "netns-b", ids, ids, HANG_TIMEOUT_S)[0])
    finally:
        link.shape("1gbit")
    return sorted(fetches)[1], sorted(reads)[len(reads) // 2]


# Every size at 1 Gbit/s; at 250 Mbit/s up to 1024 tokens (128 MiB, 4 s: a thousand times the link's fixed
# cost, as bandwidth-bound as 4096 tokens, which took a minute there).
@pytest.mark.parametrize(
    ("tokens", "rate"), [(256, "1gbit"), (1024, "1gbit"), (4096, "1gbit"), (256, "250mbit"), (1024, "250mbit")]
)
def test_the_planners_fetch_is_the_measured_fetch(link, peers, profiles, rate, tokens):
    """The planner's pipelined fetch (network reads, each reloaded while the next one reads) against the fetch
    itself. The prediction is the calibration's; the machine may be busier now than when it was calibrated (the
    2 cores are shared): then the fetch is measured again beside plain reads of the same blocks, and the
    prediction is held to the fetch by the same factor as the read's prediction to the read, measured under the
    same conditions."""
    planner = _planner(profiles[rate])
    decision = _decide(planner, tokens)
    measured, _ = _measured_fetch(link, peers, rate, tokens, decision.fetch_chunks, with_reads=False)
    print(f"{rate}, {tokens} tokens in {decision.fetch_chunks} chunks: predicted {decision.t_transfer * 1e3:.1f} ms, "
          f"measured {measured * 1e3:.1f} ms ({decision.t_transfer / measured:.3f}x)")  # fmt: skip
    if decision.t_transfer == pytest.approx(measured, rel=TOLERANCE):
        return
    measured, read = _measured_fetch(link, peers, rate, tokens, decision.fetch_chunks, with_reads=True)
    assert planner.fetch is not None
    slowdown = read / planner.fetch.predict(-(-tokens // BLOCK_TOKENS) * BLOCK_NBYTES)
    print(f"  again beside plain reads: fetch {measured * 1e3:.1f} ms, the read {slowdown:.3f}x its prediction")
    assert decision.t_transfer * slowdown == pytest.approx(measured, rel=TOLERANCE)


def test_a_slower_link_moves_the_fetch_threshold_where_the_planner_says(profiles):
    planners = {rate: _planner(profile) for rate, profile in profiles.items()}
    thresholds = {rate: planner.threshold_tokens(source="peer") for rate, planner in planners.items()}
    # On this CPU both are 1 token: recomputing even one token of an 8B model costs more than fetching a
    # block at either rate (a GPU's prefill puts the threshold where the link's rate moves it far).
    # Where the planner says the threshold goes when the link is 4x slower: the 1 Gbit/s planner, its link's
    # bytes/s cut by the rate's ratio. The link calibrated at 250 Mbit/s puts it there.
    slowed = _planner(profiles["1gbit"])
    slowed.fetch = dataclasses.replace(
        slowed.fetch, beta_bytes_per_s=slowed.fetch.beta_bytes_per_s * RATES_BIT_S["250mbit"] / RATES_BIT_S["1gbit"]
    )
    predicted = slowed.threshold_tokens(source="peer")
    print(f"fetch thresholds: {thresholds}, predicted at 250mbit from 1gbit: {predicted}")
    assert None not in (*thresholds.values(), predicted) and thresholds["250mbit"] >= thresholds["1gbit"]
    assert thresholds["250mbit"] == pytest.approx(predicted, rel=TOLERANCE, abs=BLOCK_TOKENS)


@pytest.fixture
def holder(link):
    """A third peer, in namespace b, that a fault test may kill: 64 llama-8b blocks, connected from a."""
    made = []

    def start(peers, seed: int) -> NsPeer:
        a, _ = peers
        peer = NsPeer(link, 1, "netns-holder")
        made.append(peer)
        a.ask("connect", peer.ask("pool", "llama-8b", FAULT_BLOCKS, seed))
        return peer

    yield start
    for peer in made:
        peer.close()


def _start_fault_read(a: NsPeer) -> tuple[list[int], int]:
    """A read of the holder's first FAULT_BLOCKS blocks into a's blocks from 100, left in flight and under
    way: (its local ids, its number)."""
    local = list(range(100, 100 + FAULT_BLOCKS))
    number = a.ask("start", "netns-holder", "read", list(range(FAULT_BLOCKS)), local)
    time.sleep(0.2)
    return local, number


def _until_nothing_quarantined(a: NsPeer) -> None:
    """Polls a's quarantine until NIXL reported every transfer ended (a hang ends at HANG_TIMEOUT_S)."""
    deadline = time.monotonic() + HANG_TIMEOUT_S
    while a.ask("quarantined") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert a.ask("quarantined") == {}


def _failed_wait(a: NsPeer, number: int, timeout: float) -> tuple[PeerError, float]:
    started = time.monotonic()
    with pytest.raises(PeerError) as failed:
        a.ask("wait", number, timeout)
    return failed.value, time.monotonic() - started


def test_a_link_down_mid_read_times_out_quarantines_its_blocks_and_lands_once_up(link, peers, holder):
    a, _ = peers
    held = holder(peers, 5)
    local, number = _start_fault_read(a)
    link.set_up(False)
    try:
        error, waited = _failed_wait(a, number, FAULT_TIMEOUT_S)
        assert error.kind == "RemoteTransferTimeout" and (error.side, error.block_ids) == ("local", local)
        assert FAULT_TIMEOUT_S <= waited < FAULT_TIMEOUT_S + DEADLINE_SLACK_S
        a.ask("drop", number)  # a caller giving up on it: its blocks stay quarantined all the same
        assert a.ask("quarantined") == {"local": local}
        with pytest.raises(PeerError, match=r"blocks \[100, 101\] are in use by an unfinished read"):
            a.ask("start", "netns-holder", "read", [0, 1], [100, 101])
    finally:
        link.set_up(True)
    _until_nothing_quarantined(a)  # NIXL reported it ended: the blocks are free, and the read landed whole
    assert a.ask("digests", local) == held.ask("digests", list(range(FAULT_BLOCKS)))
    a.ask("reconnect", "netns-holder")  # one call makes the connection anew, and it works over the link
    a.ask("read", "netns-holder", [3, 4], [100, 101], HANG_TIMEOUT_S)
    assert a.ask("digests", [100, 101]) == held.ask("digests", [3, 4])


def test_a_peer_killed_mid_read_fails_the_read_and_its_restart_is_one_connect(link, peers, holder):
    a, _ = peers
    held = holder(peers, 6)
    local, number = _start_fault_read(a)
    held.kill()
    error, waited = _failed_wait(a, number, HANG_TIMEOUT_S)
    assert error.kind in ("RemoteTransferError", "RemoteTransferTimeout")
    assert (error.side, error.block_ids) == ("local", local) and waited < HANG_TIMEOUT_S + DEADLINE_SLACK_S
    with pytest.raises(PeerError, match="RemoteTransferError: read failed to start"):
        a.ask("read", "netns-holder", [0], [100], HANG_TIMEOUT_S)
    restarted = holder(peers, 7)  # the same agent name, a new process: a new descriptor, one connect
    _until_nothing_quarantined(a)
    a.ask("read", "netns-holder", list(range(8)), local[:8], HANG_TIMEOUT_S)
    assert a.ask("digests", local[:8]) == restarted.ask("digests", list(range(8)))


# After the quarantine let a block go: how long its reuse is watched for a late write of the old read (at
# 1 Gbit/s the whole read takes about 1.1 s; a write it still had in flight would land well within this).
LATE_WRITE_WATCH_S = 3.0


@pytest.fixture
def reader(link):
    """A reader of its own in namespace a (not the calibrated ``peers``: this test needs no calibration)."""
    peer = NsPeer(link, 0, "netns-reader")
    try:
        peer.ask("pool", "llama-8b", 2 * FAULT_BLOCKS, 9)
        yield peer
    finally:
        peer.close()


def _reuse(a: NsPeer, blocks: list[int], seed: int) -> dict[int, str]:
    """The user writing new bytes into ``blocks`` (those the quarantine let go): their digests, by block."""
    return dict(zip(blocks, a.ask("fill_blocks", blocks, seed), strict=True)) if blocks else {}


def test_a_reconnect_never_frees_blocks_a_dropped_read_still_writes(link, reader, holder):
    """The issue's run: a read dropped while the link is down, a reconnect at once and again right after the
    link is back, and the user reusing only what quarantined() releases. Whatever the old read still writes,
    no reused block changes after its reuse (before the fix, the reconnect let every block go at once, and
    most were overwritten once the link was back)."""
    a = reader
    held = holder((a, None), 8)
    local = list(range(FAULT_BLOCKS))
    number = a.ask("start", "netns-holder", "read", list(range(FAULT_BLOCKS)), local)
    time.sleep(0.2)  # the read under way
    link.set_up(False)
    reused: dict[int, str] = {}
    try:
        error, _ = _failed_wait(a, number, FAULT_TIMEOUT_S)
        assert error.kind == "RemoteTransferTimeout"
        a.ask("drop", number)
        with pytest.raises(PeerError, match="cannot be made anew while transfers to it are unfinished") as refused:
            a.ask("reconnect", "netns-holder")  # at once, the link down: refused, nothing forgotten
        assert refused.value.kind == "ValueError"
        assert a.ask("quarantined") == {"local": local}
    finally:
        link.set_up(True)
    with contextlib.suppress(PeerError):  # right after the link is back: refused while the read still runs
        a.ask("reconnect", "netns-holder")
    free = sorted(set(local) - set(a.ask("quarantined").get("local", [])))
    reused |= _reuse(a, free, 10)
    _until_nothing_quarantined(a)  # NIXL reported the old read ended: every block is the user's again
    reused |= _reuse(a, sorted(set(local) - set(reused)), 11)
    time.sleep(LATE_WRITE_WATCH_S)  # past where the old read could still have landed
    assert a.ask("digests", sorted(reused)) == [reused[i] for i in sorted(reused)]
    assert sorted(reused) == local
    a.ask("reconnect", "netns-holder")  # with nothing in flight, the connection is made anew and works
    a.ask("read", "netns-holder", [3, 4], [100, 101], HANG_TIMEOUT_S)
    assert a.ask("digests", [100, 101]) == held.ask("digests", [3, 4])
