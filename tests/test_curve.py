"""Off loopback, safely (bridge/curve.py): a receiver or relay bound to this host's own network address takes
CURVE connections from the publishers whose keys it lists and refuses every other peer at the handshake,
before anything reaches the engine; the publisher (or a status poller) learns why at once, not at a deadline.

Real processes and sockets: receivers in processes of their own (tests/recording_receiver.py, a FakeEngine
behind a real SyncReceiver), a relay started as ``weight-bridge relay``, keys made with ``weight-bridge keys``
and passed as files. Binding the node's address without keys is refused unless the config opts out."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from bridge.config import TransportConfig, config_from_dict
from bridge.curve import is_loopback, load_key, on_this_host, server_curve, write_keypair
from bridge.errors import BridgeError, ConfigError, TransportError
from tests import recording_receiver as recording
from tests.fakes import FakeEngine
from tests.helpers import ROOT, child_env, weights
from trainer_side import WeightPublisher

PORTS = iter(range(18520, 18560))
FAST = 5.0  # a refused handshake is reported within this, while the connect deadline is 30 s
NAMED = weights(3, count=3, shape=(64, 64))


def _node_address() -> str:
    """This host's own IPv4 address on a network interface (not loopback)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return str(a.address)
    pytest.skip("this host has no network address other than loopback")


@pytest.fixture(scope="module")
def node() -> str:
    return _node_address()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: Any) -> dict[str, Path]:
    """Key pairs made by ``weight-bridge keys``: receivers (the server pair), trainer (accepted), intruder (not)."""
    folder = tmp_path_factory.mktemp("keys")
    for name in ("receivers", "trainer", "intruder"):
        proc = subprocess.run([sys.executable, "-m", "apps.cli", "keys", name, "--dir", str(folder)], cwd=ROOT,
                              env=child_env(), capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "public key " in proc.stdout and f"{name}.key_secret" in proc.stdout
    return {p.name: p for p in folder.iterdir()}


def _server(node: str, keys: dict[str, Path]) -> dict[str, Any]:
    return {"transport": {"bind_host": node, "curve_server_secret": str(keys["receivers.key_secret"]),
                          "curve_clients": [str(keys["trainer.key"])]}}


def _publisher(**transport: Any) -> dict[str, Any]:
    return {"transport": transport, "deadlines": {"connect_s": 30}}


@pytest.fixture(scope="module")
def receiver(node: str, keys: dict[str, Path]) -> Iterator[tuple[str, list[Any]]]:
    """A receiver process bound to the node's address with CURVE; yields its endpoint and the process list
    (the test that needs what reached the engine stops it)."""
    procs, (endpoint,) = recording.start(_server(node, keys), port=next(PORTS))
    yield endpoint, procs
    if procs[0].poll() is None:
        recording.stop(procs)


def _refused(endpoint: str, config: dict[str, Any], match: str) -> None:
    t0 = time.monotonic()
    with WeightPublisher([endpoint], config=config_from_dict(config)) as pub:
        with pytest.raises(TransportError, match=match) as info:
            pub.publish(NAMED, version=1)
    assert time.monotonic() - t0 < FAST, f"refused only after {time.monotonic() - t0:.1f}s"
    assert str(info.value).startswith(f"connection refused by 1 engine(s): {endpoint}: ")


def test_key_files_from_the_cli(keys: dict[str, Path]) -> None:
    import zmq
    from zmq.auth import load_certificate

    public, secret = load_certificate(keys["trainer.key_secret"])
    assert secret is not None and zmq.curve_public(secret) == public
    assert load_certificate(keys["trainer.key"]) == (public, None)
    assert stat.S_IMODE(keys["trainer.key_secret"].stat().st_mode) == 0o600
    assert load_key(str(keys["trainer.key_secret"]), "k", secret=True) == secret.decode()
    assert load_key(str(keys["trainer.key_secret"]), "k", secret=False) == public.decode()
    with pytest.raises(ConfigError, match="holds no secret key"):
        load_key(str(keys["trainer.key"]), "transport.curve_client_secret", secret=True)
    with pytest.raises(ConfigError, match="exists already"):
        write_keypair(keys["trainer.key"].parent, "trainer")


def test_publisher_with_its_key_syncs_through_curve(receiver: tuple[str, list[Any]], node: str,
                                                    keys: dict[str, Path]) -> None:
    endpoint, _ = receiver
    assert endpoint.startswith(f"tcp://{node}:")
    config = _publisher(curve_server_public=str(keys["receivers.key"]), curve_client_secret=str(keys["trainer.key_secret"]))
    with WeightPublisher([endpoint], config=config_from_dict(config)) as pub:
        report = pub.publish(NAMED, version=5)
    assert report.ok, report
    assert report.engines[0].engine["crc32"].keys() == {name for name, _ in NAMED}


@pytest.mark.parametrize(("who", "match"), [
    ("plain", "security mechanisms differ .* set transport.curve_server_public"),
    ("no-own-key", "accepts only the keys in its transport.curve_clients and this side has none"),
    ("intruder", r"does not accept this side's key \S+ \(add it to the receiver's transport.curve_clients\)"),
    ("wrong-server-key", "wrong server key"),
])
def test_unauthenticated_publishers_are_refused_at_once(receiver: tuple[str, list[Any]], keys: dict[str, Path],
                                                        who: str, match: str) -> None:
    endpoint, _ = receiver
    config = {"plain": _publisher(),
              "no-own-key": _publisher(curve_server_public=str(keys["receivers.key"])),
              "intruder": _publisher(curve_server_public=str(keys["receivers.key"]),
                                     curve_client_secret=str(keys["intruder.key_secret"])),
              "wrong-server-key": _publisher(curve_server_public=str(keys["intruder.key"]),
                                             curve_client_secret=str(keys["trainer.key_secret"]))}[who]
    _refused(endpoint, config, match)


@pytest.fixture
def bare_curve_server() -> Iterator[tuple[str, str]]:
    """A ZeroMQ CURVE server socket with no ZAP handler (a foreign service, or a receiver of another build):
    after refusing a plain client's handshake it answers with a ZMTP error, and libzmq then drops the client's
    session for good (the receiver's ZAP path usually makes the client reconnect instead). Yields its endpoint
    and public key."""
    import zmq

    public, secret = zmq.curve_keypair()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_server = True
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}", public.decode()
    sock.close(0)


@pytest.mark.timeout(120)
def test_a_publisher_refused_before_its_first_send_fails_at_once(bare_curve_server: tuple[str, str]) -> None:
    """A send made after the refused session was dropped has no connection to wait for: the publisher must
    report the refusal, not block (a blocking send once hung the suite until pytest's 900 s timeout). The
    refusal lands about 20 ms after connecting; four publishers each wait 0.5 s before their first send."""
    endpoint, _ = bare_curve_server
    for _ in range(4):
        with WeightPublisher([endpoint], config=config_from_dict(_publisher())) as pub:
            time.sleep(0.5)
            t0 = time.monotonic()
            with pytest.raises(TransportError, match="security mechanisms differ .* set transport.curve_server_public") as info:
                pub.publish(NAMED, version=1)
            assert time.monotonic() - t0 < FAST, f"refused only after {time.monotonic() - t0:.1f}s"
        assert str(info.value).startswith(f"connection refused by 1 engine(s): {endpoint}: ")


def test_status_requests_need_an_accepted_key(receiver: tuple[str, list[Any]], keys: dict[str, Path]) -> None:
    from apps.dashboard.poller import ReceiverSource

    endpoint, _ = receiver
    good = ReceiverSource(endpoint, timeout_s=30, curve_server_public=str(keys["receivers.key"]),
                          curve_client_secret=str(keys["trainer.key_secret"]))
    try:
        status, _ = good()
    finally:
        good.close()
    assert status["endpoint"] == endpoint
    for client_secret in ("", str(keys["intruder.key_secret"])):
        bad = ReceiverSource(endpoint, timeout_s=30, curve_server_public=str(keys["receivers.key"]),
                             curve_client_secret=client_secret)
        t0 = time.monotonic()
        try:
            with pytest.raises(BridgeError, match="refused the status request: CURVE authentication failed"):
                bad()
        finally:
            bad.close()
        assert time.monotonic() - t0 < FAST


def test_nothing_from_refused_peers_reached_the_engine(receiver: tuple[str, list[Any]]) -> None:
    """Runs after the tests above (same module receiver): only the accepted publisher's version got through."""
    _, procs = receiver
    (seen,) = recording.stop(procs)
    assert seen == {"validated": [5], "applied": [5]}, seen


@pytest.mark.parametrize(("transport", "message"), [
    ({}, "without transport.curve_server_secret and transport.curve_clients the receiver would take updates "
         "from any peer"),
    ({"curve_server_secret": "receivers.key_secret"}, "without transport.curve_clients the receiver"),
])
def test_binding_the_node_address_without_keys_is_refused(node: str, keys: dict[str, Path], transport: dict[str, str],
                                                          message: str) -> None:
    from inference_side.receiver import SyncReceiver

    transport = {k: str(keys[v]) for k, v in transport.items()}
    rx = SyncReceiver(FakeEngine(), config_from_dict({"transport": {"bind_host": node, **transport}}))
    with pytest.raises(ConfigError, match=message) as info:
        rx.start()
    assert "weight-bridge keys" in str(info.value) and "allow_unauthenticated" in str(info.value)
    rx.stop()
    port = next(PORTS)
    proc = subprocess.run([sys.executable, "-m", "apps.cli", "relay", "--engine", "tcp://127.0.0.1:1", "--port", str(port),
                           "--config", "/dev/stdin"], input=yaml.safe_dump({"transport": {"bind_host": node, **transport}}),
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "weight-bridge relay: error: transport.bind_host is" in proc.stderr, proc.stderr


def test_opting_out_binds_the_node_address_without_keys(node: str, start_receiver: Any) -> None:
    gate = FakeEngine()
    rx = start_receiver(config_from_dict({"transport": {"bind_host": node, "allow_unauthenticated": True}}), gate)
    assert rx.endpoint.startswith(f"tcp://{node}:")
    with WeightPublisher([rx.endpoint], config=config_from_dict({})) as pub:
        assert pub.publish(NAMED, version=1).ok
    assert gate.applied == [1]


@pytest.mark.parametrize(("transport", "ok"), [
    ({"bind_host": "127.0.0.1"}, True),
    ({"bind_host": "localhost"}, True),
    ({"bind_host": "::1"}, True),
    ({"bind_host": "0.0.0.0"}, False),
    ({"bind_host": "*"}, False),
    ({"bind_host": "192.0.2.7"}, False),
    ({"bind_host": "0.0.0.0", "allow_unauthenticated": True}, True),
])
def test_which_binds_need_keys(transport: dict[str, Any], ok: bool) -> None:
    cfg = TransportConfig(**transport)
    assert is_loopback(cfg.bind_host) == (ok and not cfg.allow_unauthenticated)
    if ok:
        assert server_curve(cfg) is None
    else:
        with pytest.raises(ConfigError, match="not loopback"):
            server_curve(cfg)


def test_curve_config_errors_name_the_key(keys: dict[str, Path]) -> None:
    import zmq

    with pytest.raises(ConfigError, match="curve_clients needs transport.curve_server_secret"):
        server_curve(TransportConfig(curve_clients=(str(keys["trainer.key"]),)))
    with pytest.raises(ConfigError, match="curve_server_public is not the public half"):
        server_curve(TransportConfig(curve_server_secret=str(keys["receivers.key_secret"]),
                                     curve_server_public=str(keys["trainer.key"])))
    with pytest.raises(ConfigError, match="curve_clients: '/nonexistent.key' is neither a z85 key"):
        server_curve(TransportConfig(curve_server_secret=str(keys["receivers.key_secret"]),
                                     curve_clients=("/nonexistent.key",)))
    with pytest.raises(ConfigError, match="curve_clients must be a list"):
        config_from_dict({"transport": {"curve_clients": [1]}})
    one = config_from_dict({"transport": {"curve_clients": str(keys["trainer.key"])}}).transport.curve_clients
    assert one == (str(keys["trainer.key"]),)
    # a directory of *.key files, and z85 strings, are accepted too
    public = zmq.curve_keypair()[0].decode()
    curve = server_curve(TransportConfig(curve_server_secret=str(keys["receivers.key_secret"]),
                                         curve_clients=(str(keys["trainer.key"].parent), public)))
    assert curve is not None and len(curve.clients) == 4


def test_relay_on_the_node_address_takes_only_accepted_publishers(node: str, keys: dict[str, Path], tmp_path: Path) -> None:
    """A relay bound to the node address with CURVE forwards an accepted publisher's update to its engine (on
    loopback, reached without CURVE); a publisher with a key it does not list is refused and nothing is forwarded."""
    engines, (engine,) = recording.start({})
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump(_server(node, keys)))
    port = next(PORTS)
    relay = subprocess.Popen([sys.executable, "-m", "apps.cli", "relay", "--engine", engine, "--port", str(port),
                              "--config", str(config)], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        line = relay.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith(f"weight-bridge relay tcp://{node}:{port} -> {engine}"), line
        endpoint = f"tcp://{node}:{port}"
        _refused(endpoint, _publisher(curve_server_public=str(keys["receivers.key"]),
                                      curve_client_secret=str(keys["intruder.key_secret"])), "does not accept this side's key")
        _refused(endpoint, _publisher(), "security mechanisms differ")
        good = _publisher(curve_server_public=str(keys["receivers.key"]), curve_client_secret=str(keys["trainer.key_secret"]))
        with WeightPublisher([endpoint], config=config_from_dict(good)) as pub:
            report = pub.publish(NAMED, version=3)
        assert report.ok and [e["ok"] for e in report.engines[0].engine["relayed"]] == [True], report
    finally:
        relay.send_signal(signal.SIGINT)  # the relay shuts down (Ctrl-C), even where it started with SIGINT ignored
        try:
            relay.wait(30)
        except subprocess.TimeoutExpired:
            relay.kill()
            raise
        (seen,) = recording.stop(engines)
    assert seen == {"validated": [3], "applied": [3]}, seen


@pytest.mark.parametrize(("endpoint", "local"), [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.0.0.2:5555", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/wb/receiver.sock", True), ("inproc://wb", True),
    ("tcp://10.0.0.5:5555", False), ("tcp://0.0.0.0:5555", False), ("tcp://[2001:db8::1]:5555", False),
    ("udp://127.0.0.1:5555", False), ("tcp://", False),
])
def test_on_this_host_knows_loopback_and_ipc_endpoints(endpoint: str, local: bool) -> None:
    """The endpoints a publisher reaches without leaving its host (``sync.delta_compress: auto`` leaves patches
    uncompressed when every engine is one): ipc, inproc and tcp to a loopback address; any other address is
    another host's."""
    assert on_this_host(endpoint) is local
