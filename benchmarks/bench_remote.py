"""Blocks between two processes over NIXL (UCX): kvcopy's coalesced transfer against the alternatives.

Two local processes (on one machine: the loopback path, labelled as such), each with a page-first
HostKVPool of PLANES planes. For each plane-block size, one call reads BLOCKS random blocks three ways:
- ``kvcopy read``: KVPeer.read, one NIXL transfer whose descriptors kvcopy's range planner coalesced;
- ``per-block NIXL loop``: one NIXL transfer per block, each waited for (what a caller without kvcopy writes);
- ``contiguous (limit)``: one NIXL transfer of the same bytes as one range.
Each row: the median of REPEATS calls, GB/s and the ratio to the limit, with the machine's identity.
``--memory gpu``: the same between GPU memory of the two processes (each an engine cache, a PagedKV whose
blocks are contiguous, registered as NIXL VRAM; needs a CUDA device and UCX built with CUDA).
``--netns RATE``: the two processes in two network namespaces made for the run, joined by a veth pair shaped
with tbf to RATE (1gbit or 250mbit; benchmarks/netns.py), UCX over TCP: the bytes cross a real network stack
(checked on the interface counters, and said in the output), which on one machine they otherwise do not.
Needs root and iproute2.

    .venv/bin/python benchmarks/bench_remote.py [--sizes 2,8,32,128] [--blocks 64] [--repeats 5] [--csv out.csv]
                                                [--memory host|gpu] [--netns 1gbit|250mbit]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import multiprocessing
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

import kvcopy
from kvcopy.calibration.machine import machine_identity
from kvcopy.calibration.network import interface_rx_bytes
from kvcopy.calibration.timing import measure
from kvcopy.nixl.registration import registration_of
from kvcopy.remote import KVPeer, RemotePool, RemoteTransfer
from kvcopy.tools.bench import IDENTITY_COLUMNS

from netns import RATES_BIT_S, NetnsUnavailable, netns_link

PLANES = 8  # planes per block: a page-first block is one region of PLANES plane-blocks
WAIT_S = 120  # generous: a loaded machine may take seconds per call
COLUMNS = (
    "link",
    "transport",
    "method",
    "plane_block_bytes",
    "num_blocks",
    "bytes",
    "descriptors",
    "median_s",
    "gbps",
    "x_limit",
    "x_rate",
)


def _cache(plane_block_bytes: int, num_blocks: int, seed: int, memory: str) -> tuple[object, torch.Tensor]:
    """(what a KVPeer registers, its bytes): a page-first HostKVPool, or on the GPU an engine cache whose
    blocks are contiguous (PLANES plane-blocks each, as in a page-first pool)."""
    data = torch.randint(
        0,
        256,
        (num_blocks * PLANES * plane_block_bytes,),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    if memory == "gpu":
        raw = data.cuda().view(num_blocks, PLANES * plane_block_bytes)
        planes = [raw[:, i * plane_block_bytes : (i + 1) * plane_block_bytes] for i in range(PLANES)]
        return kvcopy.PagedKV.from_planes(planes), raw.view(-1)
    like = kvcopy.PagedKV.from_planes([torch.empty(1, plane_block_bytes, dtype=torch.uint8) for _ in range(PLANES)])
    pool = kvcopy.HostKVPool(like, num_blocks, pin_memory=False)
    pool.buffer.copy_(data)
    return pool, pool.buffer


def _serve(conn, memory: str) -> None:
    peer = None
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:  # the reader is gone
            command = "exit"
        if peer is not None:
            peer.close()
            peer = None
        if command == "exit":
            return
        kv, raw = _cache(*args, seed=1, memory=memory)
        peer = KVPeer(kv, f"remote-{args[0]}")
        conn.send(peer.descriptor())
        peer.connect(conn.recv())
        conn.send(raw.cpu().numpy().tobytes())


def _recv(conn) -> object:
    """The serving process's next message; SystemExit saying so once it is gone or silent for WAIT_S."""
    if not conn.poll(WAIT_S):
        raise SystemExit(f"the serving process sent nothing for {WAIT_S} s")
    try:
        return conn.recv()
    except EOFError:  # every copy of its end is closed: it exited
        raise SystemExit("the serving process is gone (its error, if any, is above)") from None


def _raw_read(peer: KVPeer, remote, ranges: list[tuple[int, int, int]], here: object) -> None:
    """One NIXL READ of ``ranges`` ((remote address, local address, bytes)), waited for; ``here``: the local
    registration (its NIXL memory kind and device id)."""
    agent = peer._agent  # the baselines use the same agent, without kvcopy's planning
    there = remote.layout
    local = agent.get_xfer_descs([(dst, n, here.device_id) for _, dst, n in ranges], here.memory)
    far = agent.get_xfer_descs([(src, n, there.device_id) for src, _, n in ranges], there.memory)
    handle = agent.initialize_xfer("READ", local, far, remote.agent)
    agent.transfer(handle)
    while (state := agent.check_xfer_state(handle)) == "PROC":
        pass
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer ended {state}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,8,32,128", help="plane-block sizes in KiB")
    parser.add_argument("--blocks", type=int, default=64, help="random blocks per call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--csv", help="also write the rows here")
    parser.add_argument("--memory", choices=("host", "gpu"), default="host", help="host pools, or GPU caches")
    parser.add_argument(
        "--netns", choices=sorted(RATES_BIT_S), help="between two network namespaces over a veth shaped to this rate"
    )
    # Inside the namespaces: this script again, as the reader or the holder, over a socket handed down.
    parser.add_argument("--role", choices=("reader", "holder"), help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _over_netns(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs the holder in one new namespace and the reader (this script's body) in the other."""
    holder_end, reader_end = socket.socketpair()
    with netns_link(args.netns) as link:
        holder = subprocess.Popen(
            link.argv(1, [sys.executable, __file__, *argv, "--role", "holder", "--fd", str(holder_end.fileno())]),
            pass_fds=(holder_end.fileno(),),
        )
        holder_end.close()
        try:
            reader = subprocess.run(
                link.argv(0, [sys.executable, __file__, *argv, "--role", "reader", "--fd", str(reader_end.fileno())]),
                pass_fds=(reader_end.fileno(),),
                check=False,
            )
        finally:
            reader_end.close()
            try:
                holder.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait(WAIT_S)
    return reader.returncode


def _read_calls(
    peer: KVPeer,
    remote: RemotePool,
    remote_ids: torch.Tensor,
    local_ids: torch.Tensor,
    contiguous: list[tuple[int, int, int]],
    per_block: list[list[tuple[int, int, int]]],
    here: object,
    last: dict[str, RemoteTransfer],
) -> dict[str, Callable[[], object]]:
    """The calls timed, each reading the same blocks: one contiguous range (the limit), kvcopy's read (its
    transfer left in ``last["t"]``), and one NIXL read per block."""

    def kvcopy_read() -> None:
        last["t"] = peer.read(remote, remote_ids, local_ids)
        last["t"].wait(WAIT_S)

    return {
        "contiguous (limit)": lambda: _raw_read(peer, remote, contiguous, here),
        "kvcopy read": kvcopy_read,
        "per-block NIXL loop": lambda: [_raw_read(peer, remote, r, here) for r in per_block],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.role == "holder":
        _serve(Connection(args.fd), args.memory)
        return 0
    if args.netns and args.role is None:
        try:
            return _over_netns(args, argv)
        except NetnsUnavailable as why:
            raise SystemExit(f"--netns: this machine cannot make network namespaces: {why}") from None
    gpu = args.memory == "gpu"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--memory gpu: no CUDA device visible")
    identity = machine_identity(torch.device("cuda" if gpu else "cpu"))
    if args.netns:
        link = f"two network namespaces on one machine, a veth pair shaped to {args.netns} (tbf), {args.memory} memory"
        parent, server = Connection(args.fd), None
    else:
        link = f"loopback (two processes, one machine), {args.memory} memory"
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        server = ctx.Process(target=_serve, args=(child, args.memory), daemon=True)
        server.start()
        child.close()  # the server's end, only there: when the server dies, a read of parent sees its end closed
    rows = []
    transport = ""
    try:
        for kib in (int(k) for k in args.sizes.split(",")):
            plane_block = kib * 1024
            num_blocks = 2 * args.blocks
            parent.send(("pool", plane_block, num_blocks))
            descriptor = _recv(parent)
            local, local_bytes = _cache(plane_block, num_blocks, seed=2, memory=args.memory)
            here = registration_of(local)
            with KVPeer(local, f"local-{kib}") as peer:
                remote = peer.connect(descriptor)
                parent.send(peer.descriptor())
                expected = torch.frombuffer(bytearray(_recv(parent)), dtype=torch.uint8)
                g = torch.Generator().manual_seed(kib)
                remote_ids = torch.randperm(num_blocks, generator=g)[: args.blocks]
                local_ids = torch.randperm(num_blocks, generator=g)[: args.blocks]
                block = PLANES * plane_block
                far_base, near_base = remote.layout.planes[0][0], local_bytes.data_ptr()
                per_block = [
                    [(far_base + r * block, near_base + q * block, block)]
                    for r, q in zip(remote_ids.tolist(), local_ids.tolist(), strict=True)
                ]
                contiguous = [(far_base, near_base, args.blocks * block)]
                last: dict[str, RemoteTransfer] = {}
                calls = _read_calls(peer, remote, remote_ids, local_ids, contiguous, per_block, here, last)
                # one warm-up call each: connection setup and first touches
                timed = {name: measure(call, warmup=1, repeats=args.repeats).median for name, call in calls.items()}
                local_bytes.zero_()
                received = interface_rx_bytes()
                calls["kvcopy read"]()  # checked last, after the other calls wrote the same local blocks
                crossed = (interface_rx_bytes() or 0) - (received or 0)
                transport = f"{crossed / (args.blocks * block):.2f}x the bytes read crossed a network interface"
                got = local_bytes.cpu()
                for r, q in zip(remote_ids.tolist(), local_ids.tolist(), strict=True):
                    if not torch.equal(got[q * block : (q + 1) * block], expected[r * block : (r + 1) * block]):
                        raise SystemExit(f"block {r} -> {q}: bytes differ")
                nbytes = args.blocks * block
                descriptors = {
                    "contiguous (limit)": 1,
                    "kvcopy read": last["t"].num_descriptors,
                    "per-block NIXL loop": args.blocks,
                }
                for name, seconds in timed.items():
                    rows.append(
                        {
                            "link": link,
                            "transport": transport,
                            "method": name,
                            "plane_block_bytes": plane_block,
                            "num_blocks": args.blocks,
                            "bytes": nbytes,
                            "descriptors": descriptors[name],
                            "median_s": seconds,
                            "gbps": nbytes / seconds / 1e9,
                            "x_limit": timed["contiguous (limit)"] / seconds,
                            "x_rate": nbytes * 8 / seconds / RATES_BIT_S[args.netns] if args.netns else "",
                        }
                    )
    finally:
        with contextlib.suppress(OSError):  # a server that is gone needs no exit
            parent.send(("exit",))
        if server is not None:
            server.join(WAIT_S)
    print(
        f"kvcopy remote bench on {identity.get('device_name')} ({identity.get('host_cores')} cores), "
        f"{identity.get('date')}: {args.blocks} random page-first blocks of {PLANES} planes per call, "
        f"{link} over NIXL/UCX, median of {args.repeats}; in the last checked read {transport}"
    )
    rate = f" {'x ' + args.netns:>12}" if args.netns else ""
    print(f"{'KiB/plane-block':>15} {'method':<22} {'descr.':>6} {'ms':>9} {'GB/s':>7} {'x limit':>8}{rate}")
    for r in rows:
        print(
            f"{r['plane_block_bytes'] // 1024:>15} {r['method']:<22} {r['descriptors']:>6} "
            f"{r['median_s'] * 1e3:>9.2f} {r['gbps']:>7.3f} {r['x_limit']:>8.2f}"
            + (f" {r['x_rate']:>12.2f}" if args.netns else "")
        )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*IDENTITY_COLUMNS, *COLUMNS])
            writer.writeheader()
            for r in rows:
                writer.writerow({**{k: identity.get(k, "") for k in IDENTITY_COLUMNS}, **r})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
