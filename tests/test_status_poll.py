"""Operators poll an engine over its receiver's own endpoint (``wire.StatusRequest``): a ``RecordingGate`` keeps
a record of every update (ok, or refused with its kind), the receiver answers with the engine's status and
records, ``ReceiverSource`` feeds them to the dashboard's poller. No model: a ``FakeEngine`` stands behind a
real receiver and a real publisher sends to it."""

from __future__ import annotations

from typing import Any

import pytest

from apps.dashboard.poller import Poller, ReceiverSource
from apps.metrics import MetricsHub
from bridge.config import config_from_dict
from bridge.errors import BridgeError, UpdateFailed
from bridge.report import FailureKind
from inference_side.ledger import Ledger, RecordingGate
from tests.fakes import FakeEngine
from tests.helpers import free_port, weights
from trainer_side.publisher import WeightPublisher


def _config(mode: str = "staged") -> Any:
    return config_from_dict({"sync": {"mode": mode}, "transport": {"kind": "zmq"}})


@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_receiver_answers_status_and_records_of_each_update(start_receiver: Any, mode: str) -> None:
    ledger = Ledger("fake-engine")
    fake = FakeEngine(transports=("zmq",))
    config = _config(mode)
    events: list[tuple[str, dict[str, Any]]] = []
    rx = start_receiver(config, RecordingGate(fake, ledger, streaming=mode == "streaming"), events)
    rx.on_event = lambda kind, data: (events.append((kind, data)), ledger.event(kind, data))
    rx.status = lambda since: ({"engine": ledger.engine, "version": fake.version, "tp_size": 1, "dtype": "bfloat16"},
                               ledger.dicts(since))
    with WeightPublisher([rx.endpoint], config=config) as pub:
        report = pub.publish(weights(1), 1)
        with pytest.raises(UpdateFailed) as info:
            pub.publish(weights(2, poison="model.layers.3.mlp.down_proj.weight"), 2)
    assert FailureKind.NONFINITE in info.value.kinds.values()
    # the publisher's ack carries the engine's record, as InferenceServer's does
    acked = report.engines[0]
    assert acked.ok and acked.engine["engine"] == "fake-engine" and acked.engine["tensors"] == 6

    source = ReceiverSource(rx.endpoint.removeprefix("tcp://"))
    try:
        status, records = source()
        assert status["engine"] == "fake-engine" and status["version"] == 1 and source.name == "fake-engine"
        assert [(r["version"], r["ok"], r["kind"]) for r in records] == [(1, True, ""), (2, False, "nonfinite")]
        ok = records[0]
        assert ok["bytes"] == sum(t.numel() * 2 for _, t in weights(1)) and ok["tensors"] == 6
        assert ok["transport"] == "zmq" and ok["seconds"]["total"] > 0 and ok["seconds"]["apply"] >= 0
        if mode == "streaming":
            assert "stream_total" in ok["seconds"]
        assert "model.layers.3.mlp.down_proj.weight" in records[1]["reason"]

        hub = MetricsHub()
        poller = Poller(hub, [source])
        assert poller.poll_once() == 2
        assert poller.poll_once() == 0  # asked again: no record counted twice
        view = hub.engines()["engines"]
        assert [(e["engine"], e["version"], e["syncs"], e["failures"]) for e in view] == [("fake-engine", 1, 2, 1)]
        text = hub.render().decode()
        assert 'weight_bridge_syncs_total{engine="fake-engine",result="ok"} 1.0' in text
        assert 'weight_bridge_sync_failures_total{engine="fake-engine",reason="nonfinite"} 1.0' in text
    finally:
        source.close()
    assert not [e for e in events if e[0] == "refused" and e[1].get("version") == 0], "the status poll was refused"


def test_a_receiver_without_a_status_provider_answers_from_its_engine_info(start_receiver: Any) -> None:
    rx = start_receiver(_config(), FakeEngine(transports=("zmq",), version=3))
    source = ReceiverSource(rx.endpoint)
    try:
        status, records = source()
    finally:
        source.close()
    assert status["version"] == 3 and status["endpoint"] == rx.endpoint and records == []
    assert status["engine"].endswith(f":{rx.endpoint.rsplit(':', 1)[1]}")


def test_an_engine_that_does_not_answer_is_unreachable_on_the_dashboard() -> None:
    hub = MetricsHub()
    source = ReceiverSource(f"127.0.0.1:{free_port()}", timeout_s=0.5)
    try:
        assert Poller(hub, [source]).poll_once() == 0
    finally:
        source.close()
    [engine] = hub.engines()["engines"]
    assert engine["engine"] == source.endpoint and engine["health"] == "unreachable"
    assert "TimeoutError" in engine["unreachable_reason"]


def test_a_status_that_cannot_be_sent_is_reported_and_the_receiver_keeps_working(start_receiver: Any) -> None:
    fake = FakeEngine(transports=("zmq",))
    rx = start_receiver(_config(), fake)
    rx.status = lambda since: ({"engine": "e", "bad": {1, 2}}, [])  # a set: not msgpack
    source = ReceiverSource(rx.endpoint)
    try:
        with pytest.raises(BridgeError, match="could not report its status: TypeError"):
            source()
        rx.status = None
        assert source()[0]["version"] == 0
    finally:
        source.close()
    with WeightPublisher([rx.endpoint], config=_config()) as pub:
        assert pub.publish(weights(1), 1).ok
