"""A host-local relay takes an update once over tcp:// and hands it to every
engine on its host through shared memory, answering the publisher with the engines' combined answer.

Here two receivers with tests/fakes.py's FakeEngine (no model: it records the bytes it was given) stand
behind a real relay, with real sockets, shared memory and, for the command, a separate relay process. A real vLLM
engine behind a relay actor, compared with a cold-loaded one, is in tests/test_transports.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bridge import wire
from bridge.config import config_from_dict
from bridge.errors import UpdateFailed
from bridge.report import FailureKind
from tests.fakes import FakeEngine
from tests.helpers import plan_manifest, wait_until
from tests.helpers import weights as _weights

SMALL = {"transport": {"bucket_mb": 0.05, "depth": 2}}


@pytest.fixture
def host(start_receiver: Any) -> Any:
    """Two receivers (the host's engines, keeping the bytes they applied; the second refuses version 4)
    behind one relay; ``events`` holds each receiver's (kind, data) events."""
    from inference_side.relay import Relay

    gates = [FakeEngine(keep="bytes"), FakeEngine(keep="bytes", refuse={4})]
    events: list[list[tuple[str, dict[str, Any]]]] = [[], []]
    receivers = [start_receiver(config_from_dict(SMALL), g, e) for g, e in zip(gates, events, strict=True)]
    endpoints = [r.endpoint for r in receivers]
    relay = Relay(endpoints, SMALL, name="relay-test")
    yield {"gates": gates, "relay": relay, "endpoints": endpoints, "receivers": receivers, "events": events}
    relay.shutdown()


def _publish(endpoint: str, weights: list[tuple[str, torch.Tensor]], version: int) -> Any:
    from trainer_side import WeightPublisher

    with WeightPublisher(endpoint, config=config_from_dict(SMALL), transport="zmq") as pub:
        return pub.publish(weights, version)


def test_relay_forwards_one_received_copy_to_every_engine(host: Any) -> None:
    weights = _weights(1)
    report = _publish(host["relay"].endpoint(), weights, 1)
    assert report.ok and len(report.engines) == 1  # the publisher sent the bytes once, to the relay
    relayed = report.engines[0].engine["relayed"]
    assert [r["endpoint"] for r in relayed] == host["endpoints"] and all(r["ok"] for r in relayed)
    for gate in host["gates"]:
        assert gate.applied == [1]
        for name, tensor in weights:
            assert torch.equal(gate.tensors(1)[name], tensor), name
        # the engines mapped the relay's own staging (receive segments), not copies of it
        assert gate.segments and all(s.startswith("wb-recv-") for s in gate.segments), gate.segments
    assert host["gates"][0].segments == host["gates"][1].segments
    assert len(host["gates"][0].segments) >= 2  # small buckets: the update spans several


def test_relay_names_the_engine_that_refused(host: Any) -> None:
    assert _publish(host["relay"].endpoint(), _weights(1), 3).ok
    with pytest.raises(UpdateFailed) as info:
        _publish(host["relay"].endpoint(), _weights(2), 4)
    assert info.value.kinds[host["relay"].endpoint()] is FailureKind.VERSION, info.value.kinds  # passed on by the relay
    # the engine's own refusal, by kind
    assert [(k, d["kind"], d["version"]) for k, d in host["events"][1]] == [("refused", "version", 4)], host["events"]
    assert host["events"][0] == []
    message = str(info.value)
    assert host["endpoints"][1] in message and "version 4 refused by this test engine" in message, message
    assert host["endpoints"][0] not in message.split("relayed to", 1)[-1], message
    assert 4 in host["gates"][0].applied and 4 not in host["gates"][1].applied


def test_relay_refuses_bad_input_before_any_engine_sees_it(host: Any) -> None:
    refused: list[tuple[str, dict[str, Any]]] = []
    host["relay"].receiver.on_event = lambda kind, data: refused.append((kind, data))  # the relay's own receiver
    weights = _weights(1)
    assert _publish(host["relay"].endpoint(), weights, 5).ok
    bad = [(n, t.clone()) for n, t in weights]
    bad[3][1][7, 7] = float("nan")
    with pytest.raises(UpdateFailed, match="model.layers.3.mlp.down_proj.weight"):
        _publish(host["relay"].endpoint(), bad, 6)
    wait_until(lambda: refused, what="the relay's refusal")
    assert [(k, d["kind"], d["version"]) for k, d in refused] == [("refused", "nonfinite", 6)], refused
    for gate in host["gates"]:
        assert 5 in gate.validated and 6 not in gate.validated  # the relay refused it: no engine was even asked


def test_streaming_relay_forwards_a_bucket_before_the_next_one_exists_upstream(host: Any) -> None:
    """With sync.mode: streaming the relay hands each verified bucket on at once: the engines hold bucket 0
    of the update while the upstream publisher has not sent bucket 1 yet."""
    weights = _weights(4)
    with RawUpstream(host, weights, version=8) as up:
        up.send(0)
        up.wait_engines_staged(1)
        for index in range(1, up.buckets):
            up.send(index)
        up.client.send(wire.End(version=8))
        ack = up.client.until(wire.Ack)
        assert ack.ok, ack.reason
    for gate in host["gates"]:
        for name, tensor in weights:
            assert torch.equal(gate.tensors(8)[name], tensor), name


def test_streaming_relay_passes_an_upstream_abort_to_its_engines(host: Any) -> None:
    with RawUpstream(host, _weights(5), version=9) as up:
        up.send(0)
        up.wait_engines_staged(1)
        up.client.send(wire.Abort(version=9, reason="trainer stopped"))
        up.wait(lambda: not any(s["version"] == 9 for r in host["receivers"] for s in r.summary()))
        weights = _weights(6)
        assert _publish(up.relay.endpoint(), weights, 10).ok  # the relay is free for the next update
    for gate in host["gates"]:
        assert 9 not in gate.applied and torch.equal(gate.tensors(10)[weights[0][0]], weights[0][1])
    for events in host["events"]:  # each engine was told to drop the update
        assert [(k, d["kind"], d["version"]) for k, d in events] == [("aborted", "aborted", 9)], events


def test_relay_shuts_down_promptly_with_a_streaming_update_open(host: Any) -> None:
    """Stopping a relay mid-update (Ctrl-C, actor shutdown) must not hang on the open forward, and its
    engines are told to drop the update."""
    import time

    with RawUpstream(host, _weights(7), version=11) as up:
        up.send(0)
        up.wait_engines_staged(1)
        t0 = time.monotonic()
        up.relay.shutdown()
        assert time.monotonic() - t0 < 10
        up.wait(lambda: not any(s["version"] == 11 for r in host["receivers"] for s in r.summary()))
    for gate in host["gates"]:
        assert 11 not in gate.applied
    for events in host["events"]:  # each engine was told to drop the update
        assert [(k, d["kind"], d["version"]) for k, d in events] == [("aborted", "aborted", 11)], events


def test_a_receiver_stopped_mid_load_still_aborts_the_open_streaming_update(host: Any, monkeypatch: Any) -> None:
    """Stopping a receiver cancels its queued loads but never the abort queued behind a load already running:
    a lost abort leaves the gate's streaming update open (an engine mid-reload, a relay's lock held)."""
    import threading

    with RawUpstream(host, _weights(12), version=13) as up:
        up.send(0)
        up.wait_engines_staged(1)
        gate = up.relay.gate
        assert gate.forwarding == 13  # the relay's forward of the update is open
        entered, release = threading.Event(), threading.Event()
        load = gate.load

        def slow_load(manifest: wire.Manifest, bucket: Any) -> Any:
            entered.set()
            release.wait(10)
            return load(manifest, bucket)

        monkeypatch.setattr(gate, "load", slow_load)
        up.send(1)
        assert entered.wait(10)
        threading.Timer(0.5, release.set).start()
        up.relay.receiver.stop()  # the apply thread is busy loading bucket 1: the abort queues behind it
        up.wait(lambda: gate.forwarding is None)  # the abort ran and ended the gate's update
        up.wait(lambda: not any(s["version"] == 13 for r in host["receivers"] for s in r.summary()))
    for g in host["gates"]:
        assert 13 not in g.applied


def test_closing_the_relay_gate_ends_a_forward_left_open(host: Any) -> None:
    """close() ends a streaming forward whose abort never came, instead of waiting on it for ever."""
    import threading

    with RawUpstream(host, _weights(14), version=15) as up:
        up.send(0)
        up.wait_engines_staged(1)
        closing = threading.Thread(target=up.relay.gate.close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "RelayGate.close() waited on the open forward"
        up.wait(lambda: not any(s["version"] == 15 for r in host["receivers"] for s in r.summary()))
    for g in host["gates"]:
        assert 15 not in g.applied
    for events in host["events"]:  # each engine was told to drop the update
        assert [(k, d["kind"], d["version"]) for k, d in events] == [("aborted", "aborted", 15)], events


def test_closing_the_relay_does_not_wait_for_engines_still_applying() -> None:
    """A staged forward waiting for its engines' answers (up to deadlines.ack_s) is aborted by close():
    the relay shuts down promptly and the publisher upstream hears that the update failed."""
    import threading
    import time

    from inference_side.receiver import SyncReceiver
    from inference_side.relay import Relay

    entered, release = threading.Event(), threading.Event()

    def applying(manifest: wire.Manifest) -> None:  # the engine applies until the test releases it
        entered.set()
        release.wait(60)

    receiver = SyncReceiver(FakeEngine(on_finish=applying), config_from_dict(SMALL))
    relay = Relay([receiver.start()], SMALL, name="relay-slow")
    outcome: list[Any] = []
    sender = threading.Thread(target=lambda: outcome.append(_try_publish(relay.endpoint(), _weights(16), 17)), daemon=True)
    try:
        sender.start()
        assert entered.wait(30)  # the engine is applying; the relay's forward waits for its answer
        closing = threading.Thread(target=relay.shutdown, daemon=True)
        t0 = time.monotonic()
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "the relay's shutdown waited for its engine to finish applying"
        assert time.monotonic() - t0 < 10
        sender.join(30)
        assert outcome and isinstance(outcome[0], UpdateFailed), outcome
    finally:
        release.set()
        relay.shutdown()
        receiver.stop()


def _try_publish(endpoint: str, weights: list[tuple[str, torch.Tensor]], version: int) -> Any:
    try:
        return _publish(endpoint, weights, version)
    except UpdateFailed as exc:
        return exc


class RawUpstream:
    """A streaming relay in front of the host's receivers, fed bucket by bucket by a raw ZMQ peer."""

    def __init__(self, host: Any, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        from inference_side.relay import Relay
        from tests.rawclient import RawClient
        from trainer_side.packing import make_plan

        self.host, self.version = host, version
        self.plan, self.tensors = make_plan(weights, "bfloat16", 20_000)
        self.buckets = len(self.plan.bucket_sizes)
        assert self.buckets >= 3
        manifest = plan_manifest(self.plan, version, publisher="raw")
        self.relay = Relay(host["endpoints"], {**SMALL, "sync": {"mode": "streaming"}}, name="relay-streaming")
        self.client = RawClient(self.relay.endpoint())
        self.client.send(wire.Begin(manifest))
        self.client.until(wire.Credit)

    def send(self, index: int) -> None:
        from trainer_side.packing import pack_bucket

        out = torch.empty(self.plan.bucket_sizes[index], dtype=torch.uint8)
        sums = pack_bucket(self.plan, self.tensors, index, out)
        self.client.send(wire.BucketHeader(version=self.version, index=index, checksums=tuple(sums)), out.numpy().tobytes())

    def wait(self, cond: Any, timeout: float = 10) -> None:
        wait_until(cond, timeout, lambda: f"a condition; receivers hold {[r.summary() for r in self.host['receivers']]}")

    def wait_engines_staged(self, count: int) -> None:
        """Every engine's receiver holds ``count`` buckets of this update."""
        self.wait(lambda: all(any(s["version"] == self.version and s["staged"] >= count for s in r.summary())
                              for r in self.host["receivers"]))

    def __enter__(self) -> RawUpstream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.relay.shutdown()


def test_relay_refuses_engines_it_cannot_reach_through_shared_memory() -> None:
    from bridge.errors import ConfigError
    from inference_side.receiver import SyncReceiver
    from inference_side.relay import Relay

    rx = SyncReceiver(FakeEngine(transports=("zmq",), host="elsewhere"), config_from_dict(SMALL))
    try:
        with pytest.raises(ConfigError, match="do not take the shm transport"):
            Relay([rx.start()], SMALL)
    finally:
        rx.stop()


def test_relay_command_runs_a_relay_process(host: Any) -> None:
    """`weight-bridge relay` in its own process, in front of the same two receivers."""
    import subprocess
    import sys

    from tests.helpers import ROOT, child_env

    cmd = [sys.executable, "-m", "apps.cli", "--log-level", "WARNING", "relay", "--name", "relay-cli"]
    for endpoint in host["endpoints"]:
        cmd += ["--engine", endpoint]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=child_env())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("weight-bridge relay tcp://"), (line, proc.stderr.read() if proc.poll() is not None else "")
        weights = _weights(9)
        assert _publish(line.split()[2], weights, 7).ok
        for gate in host["gates"]:
            assert torch.equal(gate.tensors(7)[weights[0][0]], weights[0][1])
    finally:
        proc.terminate()
        proc.wait(30)
