"""The fleet's parts without vLLM: placement and publish policy (pure), the model spec, and a relay's membership:
an engine joining gets the relay's kept version first (real relay, receivers, sockets and shared memory;
tests/fakes.py's FakeEngine keeps the bytes it applied), a peer relay is seeded over ZMQ, an engine leaves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from apps.fleet import plan_placement, policy_holds
from bridge.checkpoint import TABLE_FILE, ModelSpec, read_tensor_table
from bridge.config import config_from_dict
from bridge.errors import FleetError, UpdateFailed
from tests.fakes import FakeEngine
from tests.helpers import weights as _weights

SMALL = {"transport": {"bucket_mb": 0.05, "depth": 2}}


@pytest.mark.parametrize(("nodes", "load", "count", "placed"), [
    (["h", "a", "b"], {}, 3, ["h", "a", "b"]),
    (["h", "a", "b"], {}, 5, ["h", "a", "b", "h", "a"]),
    (["h", "a", "b"], {"h": 2, "a": 1}, 2, ["b", "a"]),
    (["a"], {"a": 4}, 2, ["a", "a"]),
    (["h", "a"], {"x": 9}, 1, ["h"]),  # engines on a node no longer eligible do not count
])
def test_plan_placement_fills_the_emptiest_node_first(nodes: list[str], load: dict[str, int], count: int,
                                                      placed: list[str]) -> None:
    assert plan_placement(nodes, load, count) == placed


def test_plan_placement_without_nodes_names_the_problem() -> None:
    with pytest.raises(FleetError, match="no node can host an engine"):
        plan_placement([], {}, 1)


@pytest.mark.parametrize(("policy", "current", "members", "quorum", "holds"), [
    ("all", 3, 3, None, True), ("all", 2, 3, None, False), ("all", 0, 0, None, False),
    ("quorum", 2, 3, None, True), ("quorum", 1, 3, None, False), ("quorum", 2, 4, None, False),
    ("quorum", 1, 4, 1, True), ("quorum", 0, 0, None, False),
])
def test_policy_holds(policy: str, current: int, members: int, quorum: int | None, holds: bool) -> None:
    assert policy_holds(policy, current, members, quorum) is holds


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(FleetError, match="unknown publish policy 'most'"):
        policy_holds("most", 1, 1)


def test_model_spec_carries_config_and_table_but_no_weights(tmp_path: Path) -> None:
    from devtools.tiny_models import make_checkpoint

    checkpoint = make_checkpoint("tiny", tmp_path / "ck")
    spec = ModelSpec.from_checkpoint(checkpoint)
    assert "config.json" in dict(spec.files)
    written = spec.write(tmp_path / "spec")
    assert not list(written.glob("*.safetensors")) and (written / TABLE_FILE).exists()
    assert read_tensor_table(written) == read_tensor_table(checkpoint)
    assert sum(len(t) for _, t in spec.files) < 10_000  # small enough to pass as an argument


@pytest.fixture
def node(start_receiver: Any) -> Any:
    """A relay with one engine; a second engine waits to join."""
    from inference_side.relay import Relay

    gates = [FakeEngine(keep="bytes"), FakeEngine(keep="bytes")]
    receivers = [start_receiver(config_from_dict(SMALL), g) for g in gates]
    relay = Relay([receivers[0].endpoint], SMALL, name="relay-a", names=["e0"])
    yield {"gates": gates, "endpoints": [r.endpoint for r in receivers], "relay": relay}
    relay.shutdown()


def _publish(endpoint: str, weights: list[tuple[str, torch.Tensor]], version: int) -> Any:
    from trainer_side import WeightPublisher

    with WeightPublisher(endpoint, config=config_from_dict(SMALL), transport="zmq") as pub:
        return pub.publish(weights, version)


def test_a_joining_engine_gets_the_relays_version_first_then_takes_part(node: Any) -> None:
    relay, (first, late) = node["relay"], node["gates"]
    weights = _weights(7)
    assert _publish(relay.endpoint(), weights, 3).ok
    assert relay.latest() == 3 and late.applied == []
    joined = relay.join("e1", node["endpoints"][1])
    assert joined["version"] == 3 and joined["verified"] and joined["bytes"] == sum(t.nbytes for _, t in weights)
    assert late.applied == [3]
    for name, tensor in weights:
        assert torch.equal(late.tensors(3)[name], tensor), name
    assert _publish(relay.endpoint(), _weights(8), 4).ok  # the next version reaches both
    assert first.applied == [3, 4] and late.applied == [3, 4]
    assert relay.status()["names"] == ["e0", "e1"] and relay.status()["versions"] == [4, 4]
    # it leaves (only at the endpoint it had): the next version does not reach it
    assert not relay.leave("e1", "ipc:///elsewhere") and relay.leave("e1", node["endpoints"][1])
    assert _publish(relay.endpoint(), _weights(9), 5).ok
    assert first.applied == [3, 4, 5] and late.applied == [3, 4]


def test_a_relay_keeps_the_version_when_an_engine_refuses_and_a_peer_relay_is_seeded(start_receiver: Any) -> None:
    from inference_side.relay import Relay

    gate = FakeEngine(keep="bytes", refuse={2})
    rx = start_receiver(config_from_dict(SMALL), gate)
    relay = Relay([rx.endpoint], SMALL, name="relay-a")
    empty = Relay([], SMALL, name="relay-b", dtype="bfloat16")  # a node with no engine yet
    try:
        assert _publish(relay.endpoint(), _weights(1), 1).ok
        with pytest.raises(UpdateFailed, match="refused"):
            _publish(relay.endpoint(), _weights(2), 2)
        assert relay.latest() == 2  # received and verified here, whatever the engine answered
        seeded = relay.seed(empty.endpoint())
        assert seeded["version"] == 2 and empty.latest() == 2
        late = FakeEngine(keep="bytes")
        late_rx = start_receiver(config_from_dict(SMALL), late)
        assert empty.join("late", late_rx.endpoint)["version"] == 2
        for name, tensor in _weights(2):
            assert torch.equal(late.tensors(2)[name], tensor), name
    finally:
        relay.shutdown()
        empty.shutdown()
