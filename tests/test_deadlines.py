"""Every phase of a sync has a deadline and a publisher never outruns its credits, at the transport level:
a real publisher and a real receiver (or a raw ZMQ peer where a misbehaving engine is needed) over real sockets; the engine
behind the receiver is tests/fakes.py's FakeEngine, since no model is involved."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import pytest
import torch
import zmq

from bridge import wire
from bridge.config import BridgeConfig, config_from_dict
from bridge.errors import DeadlineExceeded, UpdateFailed
from bridge.report import FailureKind
from inference_side import receiver as receiver_mod
from inference_side import session as session_mod
from tests.fakes import FakeEngine
from tests.helpers import free_port, spec
from tests.rawclient import RawClient
from trainer_side import WeightPublisher

# 12 tensors of 4 KiB in 4 KiB buckets: 12 buckets
WEIGHTS = [(f"model.layers.{i}.mlp.weight", torch.full((2048,), float(i), dtype=torch.bfloat16)) for i in range(12)]
SMALL = {"transport": {"bucket_mb": 4096 / 2**20, "depth": 2}}


def cfg(**deadlines: float) -> BridgeConfig:
    return config_from_dict({**SMALL, "deadlines": {"heartbeat_s": 0.2, **deadlines}})


def engine(apply_s: float = 0.0) -> FakeEngine:
    """The engine behind a receiver here: takes ZMQ only, applies for ``apply_s`` seconds."""
    return FakeEngine(transports=("zmq",), finish_delay_s=apply_s)


class RawEngine:
    """A raw ROUTER peer: answers hello, grants ``credits`` at begin, then does only what the test says."""

    def __init__(self, credits: int = 1) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.credits = credits
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            frames = self.sock.recv_multipart()
            msg = wire.decode(frames[1])
            self.seen.append(msg.type)
            if isinstance(msg, wire.Hello):
                self.sock.send_multipart([frames[0], wire.encode(engine().info())])
            elif isinstance(msg, wire.Begin):
                self.begin(frames[0], msg.manifest.version)

    def begin(self, identity: bytes, version: int) -> None:
        if self.credits:
            self.sock.send_multipart([identity, wire.encode(wire.Credit(version=version, n=self.credits))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


# ---- deadlines, publisher side -------------------------------------------------------------------

def test_connect_deadline() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens
    with WeightPublisher([endpoint], config=cfg(connect_s=1)) as pub:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=rf"connect: no answer within 1.0s from \['{endpoint}'\]"):
            pub.publish(WEIGHTS, version=1)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(("credits", "phase"), [(0, "manifest"), (1, "bucket 1")])
def test_manifest_and_bucket_deadlines(credits: int, phase: str) -> None:
    """An engine that never grants (more) credit: the publisher gives up at the phase's deadline and aborts."""
    peer = RawEngine(credits=credits)
    try:
        with WeightPublisher([peer.endpoint], config=cfg(manifest_s=1, bucket_s=1)) as pub:
            t0 = time.monotonic()
            with pytest.raises(UpdateFailed) as info:
                pub.publish(WEIGHTS, version=7)
            took = time.monotonic() - t0
        reason = info.value.reasons[peer.endpoint]
        assert info.value.kinds[peer.endpoint] is FailureKind.TIMEOUT, info.value.kinds
        # the phase that timed out is in the wording only
        assert reason == f"DeadlineExceeded: {phase}: no answer within 1.0s from ['{peer.endpoint}']", reason
        assert took < 5
        end = time.monotonic() + 5
        while "abort" not in peer.seen and time.monotonic() < end:
            time.sleep(0.05)
        assert peer.seen[-1] == "abort", peer.seen  # the engine is told to drop the update
        assert peer.seen.count("bucket") == credits
    finally:
        peer.close()


def test_ack_deadline(start_receiver: Any) -> None:
    """The engine applies for longer than the publisher's ack deadline (heartbeats keep coming)."""
    rx = start_receiver(cfg(), engine(apply_s=3.0))
    with WeightPublisher([rx.endpoint], config=cfg(ack_s=1)) as pub:
        t0 = time.monotonic()
        with pytest.raises(UpdateFailed) as info:
            pub.publish(WEIGHTS, version=1)
    assert info.value.kinds[rx.endpoint] is FailureKind.TIMEOUT, info.value.kinds
    assert info.value.reasons[rx.endpoint] == "DeadlineExceeded: apply: no acknowledgement within 1.0s"
    assert time.monotonic() - t0 < 2.5


def test_silent_engine_presumed_dead() -> None:
    """Takes every bucket, then neither acks nor heartbeats: dead, found within max(3 heartbeats, 5 s)."""
    peer = RawEngine(credits=100)
    try:
        with WeightPublisher([peer.endpoint], config=cfg()) as pub:
            t0 = time.monotonic()
            with pytest.raises(UpdateFailed) as info:
                pub.publish(WEIGHTS, version=1)
            took = time.monotonic() - t0
    finally:
        peer.close()
    assert "no heartbeat): presumed dead" in info.value.reasons[peer.endpoint]
    assert 5 <= took < 8


# ---- deadlines, receiver side --------------------------------------------------------------------

def test_receiver_bucket_deadline_drops_session(start_receiver: Any) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    gate = engine()
    rx = start_receiver(cfg(bucket_s=0.5), gate, events)
    client = RawClient(rx.endpoint, identity=b"stalls")
    try:
        norm = spec("model.norm.weight", "bfloat16", (8,))
        client.send(wire.Begin(wire.Manifest(version=3, tensors=(norm,), bucket_sizes=(16,))))
        client.until(wire.Credit, timeout=5)
        assert rx.summary() == [{"version": 3, "staged": 0, "buckets": 1, "bytes": 0, "applying": False}]
        deadline = time.monotonic() + 5
        while rx.summary() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.close()
    assert rx.summary() == []
    assert events == [("timeout", {"version": 3, "reason": "no data for 0.5s", "kind": "timeout"})]
    assert gate.applied == []


def test_receiver_apply_deadline(start_receiver: Any) -> None:
    """An apply running past apply_s + verify_s releases the publisher with a clear error."""
    events: list[tuple[str, dict[str, Any]]] = []
    rx = start_receiver(cfg(apply_s=0.5, verify_s=0.5), engine(apply_s=3.0), events)
    with WeightPublisher([rx.endpoint], config=cfg()) as pub:
        t0 = time.monotonic()
        with pytest.raises(UpdateFailed) as info:
            pub.publish(WEIGHTS, version=4)
    assert info.value.kinds[rx.endpoint] is FailureKind.TIMEOUT, info.value.kinds  # the receiver's Ack's kind
    assert info.value.reasons[rx.endpoint] == ("DeadlineExceeded: apply of version 4 still running after 1.0s "
                                              "(deadlines.apply_s + deadlines.verify_s)")
    assert time.monotonic() - t0 < 2.5
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:  # the event is recorded just after the ack goes out
        time.sleep(0.05)
    assert [(k, d["kind"], d["version"]) for k, d in events] == [("timeout", "timeout", 4)]


def test_refusal_is_the_only_answer_to_buckets_already_in_flight(start_receiver: Any) -> None:
    """Bucket 0 fails its checksum while bucket 1 and End are already on the wire: the publisher hears one
    answer, the refusal naming the real cause, not a second one about buckets arriving outside an update."""
    import zlib

    gate = engine()
    rx = start_receiver(cfg(), gate)
    client = RawClient(rx.endpoint, identity=b"in-flight")
    try:
        specs = (spec("model.a.weight", "bfloat16", (8,), 0), spec("model.b.weight", "bfloat16", (8,), 1))
        client.send(wire.Begin(wire.Manifest(version=5, tensors=specs, bucket_sizes=(16, 16))))
        assert client.until(wire.Credit, timeout=5).n == 2
        payload = bytes(range(16))
        client.send(wire.BucketHeader(version=5, index=0, checksums=(zlib.crc32(payload) ^ 1,)), payload)
        client.send(wire.BucketHeader(version=5, index=1, checksums=(zlib.crc32(payload),)), payload)
        client.send(wire.End(version=5))
        answers = []
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            if client.sock.poll(50):
                answers.append(wire.decode(client.sock.recv_multipart()[0]))
        acks = [a for a in answers if isinstance(a, wire.Ack)]
        assert len(acks) == 1, acks
        assert not acks[0].ok and acks[0].kind == "checksum" and "model.a.weight" in acks[0].reason, acks
        # the publisher's next update is heard as usual
        client.send(wire.Begin(wire.Manifest(version=6, tensors=specs, bucket_sizes=(16, 16))))
        assert client.until(wire.Credit, timeout=5).n == 2
    finally:
        client.close()
    assert gate.applied == []


def test_receiver_remembers_refusals_of_the_latest_publishers_only(start_receiver: Any, monkeypatch: Any) -> None:
    """Each refused publisher is remembered (so its buckets already in flight are dropped quietly), but only
    the latest REFUSED_KEEP of them: a long run that meets many short-lived publishers holds no more."""
    import zlib

    monkeypatch.setattr(session_mod, "REFUSED_KEEP", 2)
    rx = start_receiver(cfg(), engine())
    one = spec("model.a.weight", "bfloat16", (8,))
    payload = bytes(range(16))
    clients = [RawClient(rx.endpoint, identity=f"refused-{i}".encode()) for i in range(4)]
    try:
        for client in clients:
            client.send(wire.Begin(wire.Manifest(version=5, tensors=(one,), bucket_sizes=(16,))))
            client.until(wire.Credit, timeout=5)
            client.send(wire.BucketHeader(version=5, index=0, checksums=(zlib.crc32(payload) ^ 1,)), payload)
            ack = client.until(wire.Ack, timeout=5)
            assert not ack.ok and ack.kind == "checksum", ack
        assert list(rx._refused) == [b"refused-2", b"refused-3"]
        clients[3].send(wire.End(version=5))  # late, from the latest refused publisher: dropped quietly
        assert not clients[3].sock.poll(500)
    finally:
        for client in clients:
            client.close()


class TwiceRefusingEngine(RawEngine):
    """Answers Begin with a refusal, then at once with a second one, as a receiver did when buckets already
    on the wire reached it after it had refused the update."""

    def begin(self, identity: bytes, version: int) -> None:
        for kind, reason in (("checksum", "ChecksumError: the cause"), ("wire", "bucket 1 arrived outside an update")):
            self.sock.send_multipart([identity, wire.encode(wire.Ack(version=version, ok=False, reason=reason, kind=kind))])


def test_refusals_and_aborts_are_filed_under_the_version_their_sender_meant(start_receiver: Any) -> None:
    """What ends an engine's wait for a version (the weight_bridge backend's update_weights ends on an event
    naming it): a stray peer's garbage is refused under version 0 (no update); a malformed Begin under the
    version its manifest names; a publisher whose send failed before its Begin (``abandon``) makes an
    "aborted" event of that version, none once that send's Begin went out, and one again when a retry of a
    refused version fails before its own Begin."""
    events: list[tuple[str, dict[str, Any]]] = []
    rx = start_receiver(cfg(), engine(), events)

    def seen(kind: str, version: int) -> list[dict[str, Any]]:
        return [d for k, d in events if k == kind and d["version"] == version]

    def until(kind: str, version: int) -> dict[str, Any]:
        deadline = time.monotonic() + 5
        while not seen(kind, version) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen(kind, version), (kind, version, events)
        return seen(kind, version)[0]

    stray = RawClient(rx.endpoint, identity=b"stray")
    try:
        stray.send(b"\xc1 not our protocol")
        assert stray.until(wire.Ack, timeout=5).version == 0
        assert until("refused", 0)["kind"] == "wire"
        norm = spec("model.norm.weight", "bfloat16", (8,))
        broken = wire.Manifest(version=7, tensors=(norm,), bucket_sizes=(16,)).to_wire()
        broken["tensors"] = "not a list"
        stray.send(msgpack.packb({"type": "begin", "manifest": broken}, use_bin_type=True))
        assert stray.until(wire.Ack, timeout=5).version == 7
        assert until("refused", 7)["kind"] == "wire"
    finally:
        stray.close()

    def raising() -> Any:
        yield WEIGHTS[0]
        raise RuntimeError("the trainer's weights could not be read")

    with WeightPublisher([rx.endpoint], config=cfg()) as pub:
        pub.publish(WEIGHTS, version=1)
        pub.abandon(1, "its Begin went out: the engine heard of version 1 from the send itself")
        pub.abandon(2, "the trainer's weights raised before the Begin")
        assert until("aborted", 2)["reason"] == "the trainer's weights raised before the Begin"
        with pytest.raises(UpdateFailed):
            pub.publish([(n, t.clone().fill_(float("nan"))) if i == 3 else (n, t) for i, (n, t) in enumerate(WEIGHTS)], 3)
        assert until("refused", 3)["kind"] == "nonfinite"
        with pytest.raises(RuntimeError, match="could not be read"):
            pub.publish(raising(), 3)  # the retry of version 3 fails before its own Begin
        pub.abandon(3, "the retry's weights raised")
        assert until("aborted", 3)["reason"] == "the retry's weights raised"
    time.sleep(0.2)
    assert not seen("aborted", 1) and not seen("aborted", 7), events
    assert [k for k, _ in events] == ["refused", "refused", "aborted", "refused", "aborted"], events


def test_publisher_reports_the_first_refusal() -> None:
    peer = TwiceRefusingEngine()
    try:
        with WeightPublisher([peer.endpoint], config=cfg()) as pub, pytest.raises(UpdateFailed) as info:
            pub.publish(WEIGHTS, version=2)
    finally:
        peer.close()
    assert info.value.reasons[peer.endpoint] == "ChecksumError: the cause"
    assert info.value.kinds[peer.endpoint] is FailureKind.CHECKSUM, info.value.kinds


# ---- back-pressure ---------------------------------------------------------------------------------

def test_slow_receiver_back_pressure(start_receiver: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that takes 0.1 s per bucket: the publisher never has more than transport.depth buckets
    in flight (sent, credit not yet back), so nothing piles up in its queues or in the socket buffers."""
    real_verify = receiver_mod.verify_bucket
    real_decode = wire.decode
    real_send = WeightPublisher._send
    state = {"credits": 0, "sent": 0, "max_in_flight": 0}

    def slow_verify(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.1)
        real_verify(*args, **kwargs)

    def counting_decode(data: Any, *args: Any, **kwargs: Any) -> Any:
        msg = real_decode(data, *args, **kwargs)
        if isinstance(msg, wire.Credit) and threading.current_thread().name != "wb-receiver":
            state["credits"] += msg.n  # credits as the publisher receives them
        return msg

    def counting_send(self: WeightPublisher, peer: Any, msg: wire.Message, frames: tuple[Any, ...] = ()) -> None:
        if isinstance(msg, wire.BucketHeader):
            state["sent"] += 1
            in_flight = state["sent"] - (state["credits"] - 2)  # the first 2 credits are the window itself
            state["max_in_flight"] = max(state["max_in_flight"], in_flight)
        real_send(self, peer, msg, frames)

    monkeypatch.setattr(receiver_mod, "verify_bucket", slow_verify)
    monkeypatch.setattr(wire, "decode", counting_decode)
    monkeypatch.setattr(WeightPublisher, "_send", counting_send)
    gate = engine()
    rx = start_receiver(cfg(), gate)
    with WeightPublisher([rx.endpoint], config=cfg()) as pub:
        t0 = time.monotonic()
        report = pub.publish(WEIGHTS, version=1)
        took = time.monotonic() - t0
    assert report.ok and gate.applied == [1]
    assert state["sent"] == 12
    assert state["max_in_flight"] == 2, state  # transport.depth, never more
    assert took >= 12 * 0.1  # the publisher waited for the slow receiver instead of queueing everything
