"""The collective data plane's link delivers every byte or fails naming why (gloo on CPU; NCCL, same code, on GPU).

Real processes, a real private TCPStore, real gloo groups: one sender broadcasts buckets to two
receivers, each receiver checks every byte (crc32c of what arrived equals the sender's); a receiver
whose sender never sends gets a TransportError naming the timeout instead of hanging; the process's
default torch.distributed group stays uninitialised (the link never touches global groups).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.fakes import FakeEngine
from tests.helpers import free_port, wait_until, weights

SIZES = [1 << 20, 3 << 20, 12345]


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
    port, world = free_port(), 3
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
    port = free_port()
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


# ---- the plane behind the publisher and the receiver -------------------------------------------------
# Real WeightPublisher and SyncReceivers over real sockets and a real gloo group; the engine behind each
# receiver is a FakeEngine (tests/fakes.py) that compares every byte it loads with what the trainer published.

def _weights(version: int, poison: str = "") -> list[tuple[str, Any]]:
    return weights(version, count=12, shape=lambda i: (3000 + 17 * i,), name="model.layers.{i}.mlp.weight", poison=poison)


def _small() -> Any:
    from bridge.config import config_from_dict

    return config_from_dict({"transport": {"bucket_mb": 0.02, "depth": 2}, "deadlines": {"connect_s": 20, "bucket_s": 20}})


@contextmanager
def _receivers(n: int) -> Iterator[tuple[list[Any], list[FakeEngine], list[list[tuple[str, dict[str, Any]]]]]]:
    """``n`` receivers taking the collective planes, their engines and each one's (kind, data) events;
    stopped afterwards, when no engine may have seen the contract broken."""
    from inference_side.receiver import SyncReceiver

    config = _small()
    gates = [FakeEngine(transports=("zmq", "gloo", "nccl")) for _ in range(n)]
    events: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in range(n)]
    rxs = [SyncReceiver(g, config, on_event=lambda k, d, e=e: e.append((k, d))) for g, e in zip(gates, events, strict=True)]
    try:
        for rx in rxs:
            rx.start()
        yield rxs, gates, events
    finally:
        for rx in rxs:
            rx.stop()
    assert [g.violations for g in gates] == [[] for _ in gates]


def test_gloo_plane_publisher_to_two_receivers_bit_exact_link_kept() -> None:
    """Three versions to two receivers over one gloo link (rank 0 -> ranks 1, 2): every byte each receiver
    staged equals what was published, and the link is made once, not once per update."""
    _plane_to_two_receivers("gloo")


@pytest.mark.gpu
def test_nccl_plane_publisher_to_two_receivers_bit_exact_link_kept() -> None:
    """The same through NCCL (one GPU per rank: 3 GPUs); receives land in GPU buffers, copied to the segments."""
    import torch

    if torch.cuda.device_count() < 3:
        pytest.skip("NCCL needs one GPU per rank: 3 GPUs for a publisher and two receivers")
    _plane_to_two_receivers("nccl")


@pytest.mark.gpu
def test_nccl_ranks_sharing_one_gpu_fail_the_update_and_zmq_still_applies() -> None:
    """On a host with one GPU the publisher's and the receiver's NCCL ranks land on the same device, which
    NCCL refuses: the update fails within its deadlines naming that, nothing is applied, and the receiver
    takes the next update over ZMQ."""
    import torch

    from bridge.errors import UpdateFailed
    from trainer_side import WeightPublisher

    if torch.cuda.device_count() != 1:
        pytest.skip("needs a host with exactly one GPU, which both ranks then share")
    with _receivers(1) as (rxs, gates, _):
        with WeightPublisher(rxs[0].endpoint, config=_small(), transport="nccl") as pub:
            with pytest.raises(UpdateFailed, match="(?i)duplicate GPU"):
                pub.publish(_weights(1), 1)
        assert gates[0].applied == []
        named = _weights(2)
        gates[0].expect(named)
        with WeightPublisher(rxs[0].endpoint, config=_small(), transport="zmq") as pub:
            assert pub.publish(named, 2).ok
        assert gates[0].applied == [2]


def _plane_to_two_receivers(backend: str) -> None:
    from trainer_side import WeightPublisher

    with _receivers(2) as (rxs, gates, _):
        with WeightPublisher([rx.endpoint for rx in rxs], config=_small(),
                             transport=backend) as pub:
            for version in (1, 2, 3):
                named = _weights(version)
                for g in gates:
                    g.expect(named)
                report = pub.publish(named, version)
                assert report.ok and len(report.engines) == 2, report
            links_made = pub._planes[backend].links_made  # type: ignore[attr-defined]
        assert [g.applied for g in gates] == [[1, 2, 3], [1, 2, 3]]
        assert links_made == 1, f"{links_made} gloo links made for three good updates"


def test_gloo_plane_refused_mid_update_then_recovers() -> None:
    """Bucket 3 of 12 holds NaN: the receiver refuses the update naming the tensor, still drains the
    buckets already on the link, applies nothing; the next update (on a new link) is applied bit-exact."""
    from bridge.errors import UpdateFailed
    from trainer_side import WeightPublisher

    with _receivers(1) as (rxs, gates, events):
        with WeightPublisher(rxs[0].endpoint, config=_small(), transport="gloo") as pub:
            bad = "model.layers.3.mlp.weight"
            with pytest.raises(UpdateFailed, match=bad):
                pub.publish(_weights(1, poison=bad), 1)
            wait_until(lambda: events[0], what="the receiver's refusal")
            assert [(k, d["kind"], d["version"]) for k, d in events[0]] == [("refused", "nonfinite", 1)], events
            assert gates[0].applied == []
            named = _weights(2)
            gates[0].expect(named)
            assert pub.publish(named, 2).ok
            links_made = pub._planes["gloo"].links_made  # type: ignore[attr-defined]
        assert gates[0].applied == [2]
        assert links_made == 2, "a failed update must drop the link; the next one offers a new link"


def test_gloo_plane_refused_when_the_engine_does_not_offer_it() -> None:
    from bridge.config import config_from_dict
    from bridge.errors import TransportError
    from inference_side.receiver import SyncReceiver
    from trainer_side import WeightPublisher

    rx = SyncReceiver(FakeEngine(transports=("zmq",)), config_from_dict({}))
    rx.start()
    try:
        with WeightPublisher(rx.endpoint, transport="gloo") as pub, pytest.raises(TransportError, match="transport 'gloo' is not offered"):
            pub.publish(_weights(1), 1)
    finally:
        rx.stop()


def test_gloo_plane_listens_on_loopback_only_by_default() -> None:
    """With the default config every socket the gloo link opens (the publisher's private store and each
    rank's gloo pairs) listens on 127.0.0.1: nothing is reachable from another host unless configured."""
    import psutil

    from trainer_side import WeightPublisher

    with _receivers(1) as (rxs, gates, _):
        before = {c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        with WeightPublisher(rxs[0].endpoint, config=_small(), transport="gloo") as pub:
            named = _weights(1)
            gates[0].expect(named)
            assert pub.publish(named, 1).ok
            opened = [c.laddr for c in psutil.Process().net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN and c.laddr not in before]
    assert opened, "the gloo link opened no listening socket?"
    assert all(addr.ip == "127.0.0.1" for addr in opened), opened


def test_unknown_backend_is_a_config_error() -> None:
    from bridge.errors import ConfigError
    from bridge.transports.collective_plane import CollectiveLink

    with pytest.raises(ConfigError, match="unknown collective backend 'mpi'"):
        CollectiveLink("mpi", "127.0.0.1", 0, 0, 2)


if __name__ == "__main__":  # scripts/gpu_nccl_check.sh: python -m tests.test_collective_plane nccl
    import sys

    backend = sys.argv[1] if len(sys.argv) > 1 else "gloo"
    _broadcast_to_two(backend)
    print(f"{backend} collective link: broadcast to two receivers bit-exact")
    _plane_to_two_receivers(backend)
    print(f"{backend} data plane: publisher -> two receivers, three versions bit-exact, one link")
