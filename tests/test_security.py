"""Security at the transport level (real sockets, real receiver and publisher; the engine is a
FakeEngine of tests/fakes.py since no model is involved): loopback by default, CURVE refuses a publisher without
the key, nothing is ever unpickled. (Dashboard and /metrics read-only: tests/test_dashboard.py.)"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from bridge import wire
from bridge.config import BridgeConfig, config_from_dict
from bridge.errors import TransportError, WireError
from tests.fakes import FakeEngine
from tests.helpers import ROOT
from tests.rawclient import RawClient
from trainer_side import WeightPublisher

WEIGHTS = [("model.norm.weight", torch.ones(8, dtype=torch.bfloat16))]


@pytest.fixture
def receiver(start_receiver: Any) -> Any:
    """start(config) -> a receiver and the engine behind it (takes ZMQ only, records what reached it)."""

    def start(config: BridgeConfig) -> tuple[Any, FakeEngine]:
        gate = FakeEngine(transports=("zmq",))
        return start_receiver(config, gate), gate

    return start


def test_receiver_binds_loopback_by_default(receiver: Any) -> None:
    rx, _ = receiver(config_from_dict({}))
    assert rx.endpoint.startswith("tcp://127.0.0.1:"), rx.endpoint
    port = int(rx.endpoint.rpartition(":")[2])
    listening = [c for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [c.laddr.ip for c in listening] == ["127.0.0.1"], listening


def test_ipc_endpoint_lives_in_a_private_directory_removed_at_stop(receiver: Any) -> None:
    """The ipc:// socket file sits in a 0700 directory (other users cannot connect); a publisher on this
    host updates through it; the directory is gone once the receiver stops."""
    import stat

    rx, gate = receiver(config_from_dict({}))
    assert rx.ipc_endpoint.startswith("ipc://"), rx.ipc_endpoint
    sock_path = Path(rx.ipc_endpoint[len("ipc://"):])
    assert sock_path.exists()
    assert stat.S_IMODE(sock_path.parent.stat().st_mode) == 0o700
    with WeightPublisher(rx.ipc_endpoint) as pub:
        assert pub.publish([("model.norm.weight", torch.ones(8, dtype=torch.bfloat16))], 1).ok
    assert gate.applied == [1] and list(gate.received[1]) == ["model.norm.weight"]
    rx.stop()
    assert not sock_path.parent.exists()


def test_no_ipc_endpoint_when_disabled(receiver: Any) -> None:
    rx, _ = receiver(config_from_dict({"transport": {"listen_ipc": False}}))
    assert rx.ipc_endpoint == ""


def _curve_config(**deadlines: float) -> tuple[BridgeConfig, str]:
    import zmq

    public, secret = zmq.curve_keypair()
    cfg = config_from_dict({"transport": {"curve_server_secret": secret.decode(), "curve_server_public": public.decode()},
                            "deadlines": {"connect_s": 2, **deadlines}})
    return cfg, public.decode()


def test_curve_refuses_publisher_without_key_and_applies_nothing(receiver: Any) -> None:
    from trainer_side import WeightPublisher

    server_cfg, _ = _curve_config()
    rx, gate = receiver(server_cfg)
    client_cfg = config_from_dict({"deadlines": {"connect_s": 2}})
    with WeightPublisher([rx.endpoint], config=client_cfg) as pub:
        with pytest.raises(TransportError) as info:
            pub.publish(WEIGHTS, version=1)
    assert str(info.value) == (f"connection refused by 1 engine(s): {rx.endpoint}: security mechanisms differ "
                               "(CURVE on one side only): set transport.curve_server_public to the engine's CURVE public key")
    assert gate.validated == [] and gate.applied == []


def test_curve_refuses_publisher_with_wrong_key(receiver: Any) -> None:
    import zmq

    from trainer_side import WeightPublisher

    server_cfg, _ = _curve_config()
    rx, gate = receiver(server_cfg)
    wrong = zmq.curve_keypair()[0].decode()
    with WeightPublisher([rx.endpoint], config=config_from_dict({"deadlines": {"connect_s": 2}}),
                         curve_server_public=wrong) as pub:
        with pytest.raises(TransportError, match="CURVE authentication failed: wrong server key"):
            pub.publish(WEIGHTS, version=1)
    assert gate.validated == [] and gate.applied == []


def test_curve_accepts_publisher_with_key(receiver: Any) -> None:
    from trainer_side import WeightPublisher

    server_cfg, public = _curve_config()
    rx, gate = receiver(server_cfg)
    with WeightPublisher([rx.endpoint], config=config_from_dict({}), curve_server_public=public) as pub:
        report = pub.publish(WEIGHTS, version=1)
    assert report.ok
    assert gate.applied == [1] and list(gate.received[1]) == ["model.norm.weight"]


class _Tripwire:
    """Unpickling this object would create a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


def test_pickle_payloads_are_never_unpickled(tmp_path: Path, receiver: Any) -> None:
    trip = tmp_path / "unpickled"
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        payload = pickle.dumps({"type": "begin", "manifest": _Tripwire(trip)}, protocol=protocol)
        with pytest.raises(WireError, match="malformed or truncated header"):
            wire.decode(payload)
    # and on the socket: refused with a clear reason, nothing validated or applied
    rx, gate = receiver(config_from_dict({}))
    client = RawClient(rx.endpoint, identity=b"pickler")
    try:
        client.send(pickle.dumps(_Tripwire(trip)))
        ack = client.until(wire.Ack, timeout=10)
    finally:
        client.close()
    assert not ack.ok and ack.kind == "wire" and "malformed" in ack.reason, ack
    assert not trip.exists(), "a pickle payload was unpickled"
    assert gate.validated == [] and gate.applied == []


def test_no_pickle_on_any_wire_path() -> None:
    """No module that touches the wire can unpickle: no pickle, no torch.load, no allow_pickle."""
    banned = ("import pickle", "cloudpickle", "torch.load(", "allow_pickle=True", "pickle.loads", "dill")
    offenders = []
    for pkg in ("bridge", "trainer_side", "inference_side"):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            offenders += [f"{path.relative_to(ROOT)}: {b}" for b in banned if b in text]
    assert offenders == []
