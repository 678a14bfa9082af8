"""Issue 4, fan-out across hosts: a host-local relay takes an update once over tcp:// and hands it to every
engine on its host through shared memory, answering the publisher with the engines' combined answer.

The first tests put two receivers with an in-process gate (no model: it records the bytes it was given)
behind a real relay, with real sockets and shared memory; the last one runs real vLLM engines behind a
relay actor and compares them with engines cold-loaded from the same weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bridge import wire
from bridge.config import config_from_dict
from bridge.errors import UpdateFailed

SMALL = {"transport": {"bucket_mb": 0.05, "depth": 2}}


class RecordingGate:
    """An engine without a model: keeps every applied version's tensors, read from the staged buckets."""

    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse  # a version this engine refuses (0: none)
        self.applied: dict[int, dict[str, torch.Tensor]] = {}
        self.segments: list[str] = []
        self.begun: list[int] = []  # versions whose manifest reached this engine

    def info(self) -> wire.EngineInfo:
        return wire.EngineInfo(dtype="bfloat16", version=max(self.applied, default=0), tp_size=1,
                               transports=("zmq", "shm"), host="test")

    def validate(self, manifest: wire.Manifest) -> str | None:
        self.begun.append(manifest.version)
        if manifest.version == self.refuse:
            from bridge.errors import VersionError

            raise VersionError(f"version {manifest.version} refused by this test engine")
        return None

    def apply(self, manifest: wire.Manifest, buckets: list[Any], timings: dict[str, float]) -> Any:
        from inference_side.receiver import ApplyResult

        got = {}
        for b in buckets:
            self.segments.append(b.segment.name)
            for s in b.specs:
                raw = torch.frombuffer(bytearray(b.segment.buffer[s.offset : s.offset + s.nbytes]), dtype=torch.uint8)
                got[s.name] = raw.view(getattr(torch, s.dtype)).view(s.shape)
        self.applied[manifest.version] = got
        return ApplyResult(True, "", {"seconds": {"apply": 0.0}})


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(64, 96, generator=gen).to(torch.bfloat16)) for i in range(6)]


@pytest.fixture
def host() -> Any:
    """Two receivers (the host's engines) behind one relay."""
    from inference_side.receiver import SyncReceiver
    from inference_side.relay import Relay

    gates = [RecordingGate(), RecordingGate(refuse=4)]
    receivers = [SyncReceiver(g, config_from_dict(SMALL)) for g in gates]
    endpoints = [r.start() for r in receivers]
    relay = Relay(endpoints, SMALL, name="relay-test")
    yield {"gates": gates, "relay": relay, "endpoints": endpoints}
    relay.shutdown()
    for r in receivers:
        r.stop()


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
        assert sorted(gate.applied) == [1]
        for name, tensor in weights:
            assert torch.equal(gate.applied[1][name], tensor), name
        # the engines mapped the relay's own staging (receive segments), not copies of it
        assert gate.segments and all(s.startswith("wb-recv-") for s in gate.segments), gate.segments
    assert host["gates"][0].segments == host["gates"][1].segments
    assert len(host["gates"][0].segments) >= 2  # small buckets: the update spans several


def test_relay_names_the_engine_that_refused(host: Any) -> None:
    assert _publish(host["relay"].endpoint(), _weights(1), 3).ok
    with pytest.raises(UpdateFailed) as info:
        _publish(host["relay"].endpoint(), _weights(2), 4)
    message = str(info.value)
    assert host["endpoints"][1] in message and "version 4 refused by this test engine" in message, message
    assert host["endpoints"][0] not in message.split("relayed to", 1)[-1], message
    assert 4 in host["gates"][0].applied and 4 not in host["gates"][1].applied


def test_relay_refuses_bad_input_before_any_engine_sees_it(host: Any) -> None:
    weights = _weights(1)
    assert _publish(host["relay"].endpoint(), weights, 5).ok
    bad = [(n, t.clone()) for n, t in weights]
    bad[3][1][7, 7] = float("nan")
    with pytest.raises(UpdateFailed, match="model.layers.3.mlp.down_proj.weight: holds NaN or Inf"):
        _publish(host["relay"].endpoint(), bad, 6)
    for gate in host["gates"]:
        assert 5 in gate.begun and 6 not in gate.begun  # the relay refused it: no engine was even asked


def test_relay_refuses_engines_it_cannot_reach_through_shared_memory() -> None:
    from bridge.errors import ConfigError
    from inference_side.receiver import SyncReceiver
    from inference_side.relay import Relay

    class TcpOnly(RecordingGate):
        def info(self) -> wire.EngineInfo:
            return wire.EngineInfo(dtype="bfloat16", version=0, tp_size=1, transports=("zmq",), host="elsewhere")

    rx = SyncReceiver(TcpOnly(), config_from_dict(SMALL))
    try:
        with pytest.raises(ConfigError, match="do not take the shm transport"):
            Relay([rx.start()], SMALL)
    finally:
        rx.stop()


# ---- real engines --------------------------------------------------------------------------------

@pytest.mark.engine
def test_relay_updates_real_engines_like_cold_loads(ray_session: Any, checkpoints: Any) -> None:
    """A trainer process publishes over tcp:// to a relay actor; both engines behind it (reached over
    their ipc:// endpoints, through shared memory) then answer like engines cold-loaded from the weights."""
    from inference_side import InferenceActor, RelayActor
    from tests.conftest import assert_same_outputs, generate, oracle, run_trainer

    v1 = checkpoints("tiny", 1)
    seeds = [21, 22]
    cold = oracle([checkpoints("tiny", s) for s in seeds], 1, "bfloat16")
    engines = [InferenceActor.remote(model=str(v1), tensor_parallel_size=1, dtype="bfloat16", config=SMALL)
               for _ in range(2)]
    relay = None
    try:
        ipc = ray_session.get([e.endpoint.remote("ipc") for e in engines], timeout=600)
        relay = RelayActor.remote(ipc, SMALL)
        endpoint = ray_session.get(relay.endpoint.remote(), timeout=120)
        lines = run_trainer(endpoint, "tiny", seeds=seeds, first_version=2)
        assert [line["ok"] for line in lines] == [True, True], lines
        for line in lines:
            assert len(line["engines"]) == 1 and line["engines"][0]["verified"], line
        for engine in engines:
            assert ray_session.get(engine.version.remote()) == 3
            record = ray_session.get(engine.records.remote())[-1]
            assert record["ok"] and record["transport"] == "shm", record
            assert_same_outputs(generate(engine), cold[1])
    finally:
        if relay is not None:
            ray_session.get(relay.shutdown.remote())
            ray_session.kill(relay)
        for engine in engines:
            ray_session.get(engine.shutdown.remote())
            ray_session.kill(engine)


def test_relay_command_runs_a_relay_process(host: Any) -> None:
    """`weight-bridge relay` in its own process, in front of the same two receivers."""
    import subprocess
    import sys

    from tests.conftest import ROOT, child_env

    cmd = [sys.executable, "-m", "bridge.cli", "--log-level", "WARNING", "relay", "--name", "relay-cli"]
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
            assert torch.equal(gate.applied[7][weights[0][0]], weights[0][1])
    finally:
        proc.terminate()
        proc.wait(30)
