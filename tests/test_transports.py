"""Every data plane and sync mode, and a host-local relay in front of the engine, leave the
engine equal to a cold-loaded oracle.

One tiny dense engine (TP 1) serves the whole module; its sync mode is switched between tests. Buckets
are kept small (``transport.bucket_mb``) so that an update spans many buckets and streaming really
loads bucket k while bucket k+1 is on the wire.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from bridge import wire
from tests.helpers import assert_same_outputs, generate, oracle, run_trainer
from tests.rawclient import RawClient

pytestmark = pytest.mark.engine

SMALL_BUCKETS = {"transport": {"bucket_mb": 0.05, "depth": 2}}


@pytest.fixture(scope="module")
def engine(ray_session: Any, checkpoints: Any, tmp_path_factory: Any) -> Any:
    from bench.engine import bench_actor

    v1 = checkpoints("tiny", 1)
    seeds = {"shm": 2, "stream-zmq": 3, "stream-shm": 4, "recover": 5, "gloo": 6, "stream-gloo": 7, "gloo-2": 8, "ipc": 9,
             "relay": 10, "relay-stream": 11}
    ckpts = {k: checkpoints("tiny", s) for k, s in seeds.items()}
    cold = dict(zip(ckpts, oracle(list(ckpts.values()), 1, "bfloat16"), strict=True))
    pinned = {**SMALL_BUCKETS, "serve": {"pin_off_workers": True}}  # also test_bridge_threads_..._off_the_tp_workers_cores
    actor = bench_actor().remote(model=str(v1), tensor_parallel_size=1, dtype="bfloat16", config=pinned)
    ray_session.get(actor.endpoint.remote(), timeout=600)
    config = tmp_path_factory.mktemp("cfg") / "small_buckets.yaml"
    config.write_text("transport:\n  bucket_mb: 0.05\n  depth: 2\n")
    yield {"actor": actor, "seeds": seeds, "cold": cold, "config": config}
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def _publish(engine: Any, key: str, transport: str, mode: str, endpoint: str = "tcp", before: tuple[int, ...] = ()) -> dict[str, Any]:
    """Publish checkpoint ``key`` from a trainer process; ``before``: seeds it publishes first, through the
    same publisher (so the last update arrives in segments the worker has mapped before)."""
    import ray

    actor = engine["actor"]
    ray.get(actor.set_config.remote({**SMALL_BUCKETS, "sync": {"mode": mode}}))
    first = ray.get(actor.version.remote()) + 1
    lines = run_trainer(ray.get(actor.endpoint.remote(endpoint)), "tiny", seeds=[*before, engine["seeds"][key]], first_version=first,
                        transport=transport, config=str(engine["config"]))
    assert len(lines) == len(before) + 1, lines
    for line in lines:
        assert line["ok"], line
        assert all(e["verified"] for e in line["engines"]), line
    version = first + len(before)
    assert ray.get(actor.version.remote()) == version
    records = ray.get(actor.records.remote())
    assert records[-1]["ok"] and records[-1]["version"] == version, records[-1]
    return {**records[-1], "trainer": lines[-1]}


def test_shm_transport_matches_cold_load(engine: Any) -> None:
    """Two updates through one publisher: the second arrives in the segments of the first, which the TP
    worker keeps mapped (copy-on-write) from one update to the next."""
    record = _publish(engine, "shm", "shm", "staged", before=(101,))
    assert record["tensors"] > 0
    # staged: the engine reads every bucket only once all arrived, so each has a segment of its own
    assert record["trainer"]["held_bytes"] >= record["trainer"]["bytes"], record["trainer"]
    assert_same_outputs(generate(engine["actor"]), engine["cold"]["shm"])


def test_worker_lets_go_of_a_closed_publishers_segments(engine: Any) -> None:
    """The worker keeps bucket segments mapped between updates; once the trainer process has gone (its
    publisher unlinked them), it unmaps them within seconds, so their memory is not pinned until the next
    update."""
    import time

    import ray

    _publish(engine, "shm", "shm", "staged", before=(102,))
    pids = ray.get(engine["actor"].status.remote())["cores"]["worker_pids"]

    def pinned() -> list[str]:
        out = []
        for pid in pids:
            with open(f"/proc/{pid}/maps") as f:
                out += [line.split()[-2] for line in f if "/dev/shm/wb-" in line and line.rstrip().endswith("(deleted)")]
        return out

    deadline = time.monotonic() + 15
    while pinned() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not pinned(), pinned()


def test_streaming_zmq_matches_cold_load(engine: Any) -> None:
    record = _publish(engine, "stream-zmq", "zmq", "streaming")
    assert "stream_load" in record["seconds"], record  # it went through the streaming path
    assert_same_outputs(generate(engine["actor"]), engine["cold"]["stream-zmq"])


def test_streaming_shm_matches_cold_load(engine: Any) -> None:
    """Streaming over shm: the publisher rewrites a bucket's segment for a later bucket once the engine
    released it (loaded, and no incomplete layer holds it), so /dev/shm holds the buckets in flight plus
    one layer, not the whole update (what staged mode keeps); the engine still equals a cold-loaded one."""
    import re
    from collections import Counter

    from devtools.tiny_models import build_model

    record = _publish(engine, "stream-shm", "shm", "streaming", before=(103,))
    assert "stream_load" in record["seconds"], record
    bucket = SMALL_BUCKETS["transport"]["bucket_mb"] * (1 << 20)
    depth = SMALL_BUCKETS["transport"]["depth"]
    layers: Counter[str] = Counter()
    oversize = 0.0  # a tensor larger than a bucket travels alone, in a segment of its size
    for name, param in build_model("tiny", 1).named_parameters():
        found = re.search(r"layers\.(\d+)\.", name)
        layers[found.group(1) if found else name] += param.numel() * 2  # bfloat16
        oversize += max(param.numel() * 2 - bucket, 0)
    # in flight and being packed (depth + 1), the largest layer, the two buckets it straddles at its ends
    bound = (depth + 3) * bucket + max(layers.values()) + oversize
    held, total = record["trainer"]["held_bytes"], record["trainer"]["bytes"]
    assert bound < total
    assert held <= bound, f"the publisher keeps {held} bytes of /dev/shm for a {total}-byte update (bound {bound:.0f})"
    assert_same_outputs(generate(engine["actor"]), engine["cold"]["stream-shm"])


def test_zmq_over_ipc_matches_cold_load(engine: Any) -> None:
    """ZMQ on the engine's ipc:// endpoint (a socket file in a private directory) from a trainer process."""
    import ray

    endpoint = ray.get(engine["actor"].endpoint.remote("ipc"))
    assert endpoint.startswith("ipc://"), endpoint
    record = _publish(engine, "ipc", "zmq", "staged", endpoint="ipc")
    assert record["transport"] == "zmq", record
    assert_same_outputs(generate(engine["actor"]), engine["cold"]["ipc"])


def test_gloo_transport_matches_cold_load(engine: Any) -> None:
    """The collective plane end to end: a trainer process offers a private gloo group over ZMQ, the engine
    joins it, every bucket travels as a point-to-point gloo send; the result equals a cold-loaded engine."""
    record = _publish(engine, "gloo", "gloo", "staged")
    assert record["transport"] == "gloo", record
    assert_same_outputs(generate(engine["actor"]), engine["cold"]["gloo"])


def test_streaming_gloo_matches_cold_load(engine: Any) -> None:
    record = _publish(engine, "stream-gloo", "gloo", "streaming")
    assert record["transport"] == "gloo" and "stream_load" in record["seconds"], record
    assert_same_outputs(generate(engine["actor"]), engine["cold"]["stream-gloo"])


def test_gloo_refused_update_keeps_serving_and_next_link_works(engine: Any) -> None:
    """A gloo update the engine refuses (a tensor it does not have, found at the manifest) leaves the served
    weights alone; the trainer's next gloo update on a new link is applied and equals the oracle."""
    import ray

    from trainer_side.publisher import WeightPublisher

    actor = engine["actor"]
    ray.get(actor.set_config.remote({**SMALL_BUCKETS, "sync": {"mode": "staged"}}))
    before = generate(actor)
    version = ray.get(actor.version.remote())
    with WeightPublisher(ray.get(actor.endpoint.remote()), config=str(engine["config"]), transport="gloo") as pub:
        import torch

        with pytest.raises(Exception, match="unknown tensor name 'model.not_a_layer.weight'"):
            pub.publish({"model.not_a_layer.weight": torch.zeros(4, dtype=torch.bfloat16)}, version + 1)
    assert ray.get(actor.version.remote()) == version
    assert_same_outputs(generate(actor), before)
    record = _publish(engine, "gloo-2", "gloo", "staged")
    assert record["transport"] == "gloo", record
    assert_same_outputs(generate(actor), engine["cold"]["gloo-2"])


def test_streaming_failure_after_loading_began_degrades_then_recovers(engine: Any) -> None:
    """Bucket 0 is loaded, bucket 1 fails its checksum: the engine holds a mix of versions, so it refuses
    requests (degraded) until a complete update arrives; the next streaming update brings it back."""
    import ray
    import torch

    actor = engine["actor"]
    ray.get(actor.set_config.remote({**SMALL_BUCKETS, "sync": {"mode": "streaming"}}))
    version = ray.get(actor.version.remote()) + 1
    good = torch.full((128,), 1.5, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    specs = (wire.TensorSpec("model.norm.weight", "bfloat16", (128,), 0, 0, 256),
             wire.TensorSpec("model.layers.0.input_layernorm.weight", "bfloat16", (128,), 1, 0, 256))
    client = RawClient(ray.get(actor.endpoint.remote()), identity=b"stream-bad-second-bucket")
    try:
        client.send(wire.Begin(wire.Manifest(version=version, tensors=specs, bucket_sizes=(256, 256))))
        client.until(wire.Credit)
        client.send(wire.BucketHeader(version=version, index=0, checksums=(zlib.crc32(good),)), good)
        client.send(wire.BucketHeader(version=version, index=1, checksums=(zlib.crc32(good) ^ 1,)), good)
        ack = client.until(wire.Ack)
    finally:
        client.close()
    assert not ack.ok
    assert "tensor model.layers.0.input_layernorm.weight: checksum mismatch" in ack.reason, ack.reason
    status = _wait_degraded(actor)
    assert f"streaming update to v{version} failed after loading began" in status["degraded"], status
    with pytest.raises(ray.exceptions.RayTaskError, match="degraded"):
        generate(actor)
    _publish(engine, "recover", "zmq", "streaming")
    assert ray.get(actor.status.remote())["degraded"] is None
    assert_same_outputs(generate(actor), engine["cold"]["recover"])


def _wait_degraded(actor: Any, timeout: float = 60.0) -> dict[str, Any]:
    """The abort runs on the engine's apply thread right after the refusal; wait for it."""
    import time

    import ray

    end = time.monotonic() + timeout
    while True:
        status: dict[str, Any] = ray.get(actor.status.remote())
        if status["degraded"] or time.monotonic() > end:
            return status
        time.sleep(0.2)


def test_relay_in_front_of_the_engine_matches_cold_load(engine: Any) -> None:
    """A trainer process publishes over tcp:// to a relay actor in front of the engine's ipc:// endpoint,
    store-and-forward and then streaming; each time the engine answers like one cold-loaded from the same
    weights (fan-out to several engines and the relay's failure paths: tests/test_relay.py)."""
    import ray

    from inference_side import RelayActor

    actor = engine["actor"]
    ray.get(actor.set_config.remote({**SMALL_BUCKETS, "sync": {"mode": "staged"}}))
    ipc = ray.get(actor.endpoint.remote("ipc"))
    for key, mode in (("relay", "staged"), ("relay-stream", "streaming")):
        version = ray.get(actor.version.remote()) + 1
        relay = RelayActor.remote([ipc], {**SMALL_BUCKETS, "sync": {"mode": mode}})
        try:
            endpoint = ray.get(relay.endpoint.remote(), timeout=120)
            lines = run_trainer(endpoint, "tiny", seeds=[engine["seeds"][key]], first_version=version)
        finally:
            ray.get(relay.shutdown.remote())
            ray.kill(relay)
        assert len(lines) == 1 and lines[0]["ok"] and len(lines[0]["engines"]) == 1, lines  # the relay answered
        assert lines[0]["engines"][0]["verified"] and lines[0]["engines"][0]["endpoint"] == endpoint, lines
        assert ray.get(actor.version.remote()) == version
        record = ray.get(actor.records.remote())[-1]
        assert record["ok"] and record["transport"] == "shm" and record["version"] == version, record
        assert_same_outputs(generate(actor), engine["cold"][key])


def test_bridge_threads_and_engine_core_stay_off_the_tp_workers_cores(engine: Any) -> None:
    """vLLM's CPU backend binds its TP worker to some cores (with ``auto``, it leaves others free); the
    receiver thread, the rest of the actor and the engine core run on the free ones (serve.pin_off_workers)."""
    import os

    import ray

    actor = engine["actor"]
    cores = ray.get(actor.status.remote())["cores"]
    workers = set().union(*(set(c) for c in cores["workers"]))
    if workers >= set(os.sched_getaffinity(0)):
        pytest.skip("the TP workers are bound to every core of this machine: no core is left for the bridge")
    assert cores["receiver"] and not workers & set(cores["receiver"]), cores
    others = [p for p in ray.get(actor.pids.remote()) if p not in cores["worker_pids"]]
    assert len(others) >= 2, others  # the actor process and the engine core process at least
    for pid in others:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                assert not workers & os.sched_getaffinity(int(tid)), (pid, tid, cores)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass


def test_the_engine_core_starts_with_the_bridge_spin_and_the_actor_does_not_keep_it(engine: Any) -> None:
    """serve.engine_core_spin_s ("auto": 0.005 s on CPU) reaches vLLM's engine core process through the
    environment it starts with (bridge/vllm_plugin.py applies it there: tests/test_idle_spin.py); the actor's
    own environment is restored once the engine started."""
    import psutil
    import ray

    from bridge.config import AUTO_ENGINE_CORE_SPIN_S
    from bridge.vllm_plugin import ENGINE_CORE_SPIN_ENV

    actor = engine["actor"]
    procs = [psutil.Process(p) for p in ray.get(actor.pids.remote())]
    cores = [p for p in procs if p.name() == "VLLM::EngineCore"]
    assert len(cores) == 1, [(p.pid, p.name()) for p in procs]
    assert cores[0].environ().get(ENGINE_CORE_SPIN_ENV) == repr(AUTO_ENGINE_CORE_SPIN_S), cores[0].environ().get(ENGINE_CORE_SPIN_ENV)
    assert ENGINE_CORE_SPIN_ENV not in procs[0].environ()  # the actor (pids() lists it first)


def test_an_idle_worker_stops_spinning_soon_after_an_rpc(engine: Any) -> None:
    """vLLM's worker busy-waits 1 s for its next RPC after each one; with serve.worker_idle_spin_s (0.05 s
    by default) it sleeps instead, leaving the core to the trainer and the receiver of the next sync."""
    import time

    import psutil
    import ray

    actor = engine["actor"]
    workers = [psutil.Process(p) for p in ray.get(actor.status.remote())["cores"]["worker_pids"]]
    generate(actor)  # RPCs to every worker; the last one ends now
    time.sleep(0.2)
    before = [sum(w.cpu_times()[:2]) for w in workers]
    time.sleep(0.6)
    used = [sum(w.cpu_times()[:2]) - b for w, b in zip(workers, before, strict=True)]
    assert max(used) < 0.25, f"TP workers used {used} CPU seconds in 0.6 s of idling"
