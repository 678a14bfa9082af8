"""Issue 4, transport level: the collective data plane (gloo on CPU; NCCL through the same code on GPU).

Real processes, a real private TCPStore, real gloo groups: one sender broadcasts buckets to two
receivers, each receiver checks every byte (crc32c of what arrived equals the sender's); a receiver
whose sender never sends gets a TransportError naming the timeout instead of hanging; the process's
default torch.distributed group stays uninitialised (the link never touches global groups).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

import pytest

SIZES = [1 << 20, 3 << 20, 12345]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _receiver(backend: str, port: int, rank: int, world: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from bridge.checksums import function
    from bridge.transports.collective_plane import CollectiveLink

    crc = function("crc32c")
    link = CollectiveLink(backend, "127.0.0.1", port, rank, world, timeout_s=60)
    sums = []
    for size in SIZES:
        buf = torch.zeros(size, dtype=torch.uint8, device=link.device)
        link.broadcast(buf)
        sums.append(crc(memoryview(buf.cpu().numpy())))
    out.put((rank, sums, dist.is_initialized()))
    link.close()


def _sender(backend: str, port: int, world: int, out: Any) -> None:
    import torch

    from bridge.checksums import function
    from bridge.transports.collective_plane import CollectiveLink

    crc = function("crc32c")
    link = CollectiveLink(backend, "127.0.0.1", port, 0, world, timeout_s=60)
    gen = torch.Generator().manual_seed(4)
    sums = []
    for size in SIZES:
        buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        sums.append(crc(memoryview(buf.numpy())))
        link.broadcast(buf.to(link.device))
    out.put((0, sums, False))
    link.close()


def _broadcast_to_two(backend: str) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, world = _free_port(), 3
    procs = [ctx.Process(target=_sender, args=(backend, port, world, out))]
    procs += [ctx.Process(target=_receiver, args=(backend, port, r, world, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    results = dict((rank, (sums, inited)) for rank, sums, inited in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"
    assert results[1][0] == results[0][0] and results[2][0] == results[0][0], "bytes differ after the broadcast"
    assert not results[1][1] and not results[2][1], "the link initialised torch.distributed's default group"


def test_gloo_broadcast_to_two_receivers_bit_exact() -> None:
    _broadcast_to_two("gloo")


@pytest.mark.gpu
def test_nccl_broadcast_to_two_receivers_bit_exact() -> None:
    import torch

    if torch.cuda.device_count() < 3:
        pytest.skip("NCCL needs one GPU per rank: 3 GPUs for a sender and two receivers")
    _broadcast_to_two("nccl")


def _lonely_receiver(port: int, out: Any) -> None:
    import torch

    from bridge.errors import TransportError
    from bridge.transports.collective_plane import CollectiveLink

    link = CollectiveLink("gloo", "127.0.0.1", port, 1, 2, timeout_s=3)
    t0 = time.monotonic()
    try:
        link.broadcast(torch.zeros(16, dtype=torch.uint8))
        out.put(("no error", 0.0))
    except TransportError as exc:
        out.put((str(exc), time.monotonic() - t0))


def _silent_sender(port: int, done: Any) -> None:
    from bridge.transports.collective_plane import CollectiveLink

    link = CollectiveLink("gloo", "127.0.0.1", port, 0, 2, timeout_s=3)
    done.wait(60)  # joins the group, never sends
    link.close()


def test_gloo_receiver_times_out_with_clear_error() -> None:
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    port = _free_port()
    sender = ctx.Process(target=_silent_sender, args=(port, done))
    receiver = ctx.Process(target=_lonely_receiver, args=(port, out))
    sender.start()
    receiver.start()
    try:
        message, waited = out.get(timeout=120)
    finally:
        done.set()
        for p in (sender, receiver):
            p.join(30)
    assert "timed out" in message or "failed or timed out" in message, message
    assert "rank 1" in message and "bucket" in message, message
    assert waited < 30, f"gave up only after {waited:.1f}s"


def test_unknown_backend_is_a_config_error() -> None:
    from bridge.errors import ConfigError
    from bridge.transports.collective_plane import CollectiveLink

    with pytest.raises(ConfigError, match="unknown collective backend 'mpi'"):
        CollectiveLink("mpi", "127.0.0.1", 0, 0, 2)


if __name__ == "__main__":  # scripts/gpu_nccl_check.sh: python -m tests.test_collective_plane nccl
    import sys

    _broadcast_to_two(sys.argv[1] if len(sys.argv) > 1 else "gloo")
    print(f"{sys.argv[1] if len(sys.argv) > 1 else 'gloo'} collective plane: broadcast to two receivers bit-exact")
