"""A dense model on the real engine, updated from a separate trainer process over ZMQ TCP, equals a
cold-loaded engine of the same weights; bad input is refused and changes nothing."""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from bridge import wire
from tests.helpers import assert_same_outputs, generate, oracle, run_trainer
from tests.rawclient import RawClient

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def dense(request: Any, ray_session: Any, checkpoints: Any) -> Any:
    from inference_side import InferenceActor

    v1 = checkpoints("tiny", 1)
    actor = InferenceActor.remote(model=str(v1), tensor_parallel_size=request.param, dtype="bfloat16")
    ray_session.get(actor.endpoint.remote(), timeout=600)
    yield {"actor": actor, "tp": request.param, "v1": v1}
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def test_publish_from_trainer_process_matches_cold_load(dense: Any, tmp_path: Any) -> None:
    import ray

    actor = dense["actor"]
    endpoint = ray.get(actor.endpoint.remote())
    assert endpoint.startswith("tcp://127.0.0.1:")
    served_before = ray.get(actor.version.remote())
    before = generate(actor)
    lines = run_trainer(endpoint, "tiny", seeds=[2], first_version=2, save_dir=tmp_path)
    assert lines[0]["ok"], lines
    assert all(e["verified"] for e in lines[0]["engines"]), lines
    assert ray.get(actor.version.remote()) == 2
    after = generate(actor)
    (cold,) = oracle([tmp_path / "v2"], dense["tp"], "bfloat16")
    assert_same_outputs(after, cold)
    assert [o["version"] for o in before] == [served_before] * len(before) and [o["version"] for o in after] == [2] * len(after)
    assert [o["token_ids"] for o in after] != [o["token_ids"] for o in before], "the update did not change the outputs"


# ---- bad input: each refused with an error that names the problem; nothing applied ------------

def _manifest(version: int, specs: list[wire.TensorSpec], sizes: list[int], protocol: int = wire.PROTOCOL_VERSION) -> wire.Manifest:
    return wire.Manifest(version=version, tensors=tuple(specs), bucket_sizes=tuple(sizes), protocol=protocol)


NORM = "model.norm.weight"  # (128,) in the tiny dense model


def _norm_spec(dtype: str = "bfloat16", shape: tuple[int, ...] = (128,), name: str = NORM) -> wire.TensorSpec:
    size = {"bfloat16": 2, "float32": 4}[dtype]
    n = 1
    for d in shape:
        n *= d
    return wire.TensorSpec(name, dtype, shape, 0, 0, n * size)


def _raw_begin(endpoint: str, manifest: wire.Manifest | bytes) -> wire.Ack:
    client = RawClient(endpoint, identity=b"bad-" + str(id(manifest)).encode())
    try:
        client.send(manifest if isinstance(manifest, bytes) else wire.Begin(manifest))
        return client.until(wire.Ack)
    finally:
        client.close()


def _good_begin_bytes(version: int) -> bytes:
    return wire.encode(wire.Begin(_manifest(version, [_norm_spec()], [256])))


BAD_HEADERS = {
    "malformed header": (b"\xc1\xff\x00garbage", "malformed"),
    "truncated header": (_good_begin_bytes(99)[:20], "malformed or truncated header"),
    "unknown protocol": (wire.encode(wire.Begin(_manifest(99, [_norm_spec()], [256], protocol=7))), "unknown protocol version 7"),
    "unknown tensor": (wire.encode(wire.Begin(_manifest(99, [_norm_spec(name="model.layers.0.bogus.weight")], [256]))), "unknown tensor name 'model.layers.0.bogus.weight'"),
    "duplicate name": (b"dup", "duplicate tensor name 'model.norm.weight'"),
    "shape mismatch": (wire.encode(wire.Begin(_manifest(99, [_norm_spec(shape=(64,))], [128]))), "tensor model.norm.weight: shape [64] does not match the engine's [128]"),
    "dtype mismatch": (wire.encode(wire.Begin(_manifest(99, [_norm_spec(dtype="float32")], [512]))), "tensor model.norm.weight: dtype float32 does not match the engine's bfloat16"),
}


def _duplicate_manifest_bytes() -> bytes:
    import msgpack

    spec = _norm_spec().to_wire()
    second = list(spec)
    second[4] = 256
    body = _manifest(99, [_norm_spec()], [512]).to_wire()
    body["tensors"] = [spec, second]
    return msgpack.packb({"type": "begin", "manifest": body})


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_bad_input_refused_and_nothing_applied(dense: Any, case: str) -> None:
    import ray

    if dense["tp"] != 1:
        pytest.skip("bad input is checked on the receiver, before any worker: one TP size suffices")
    actor = dense["actor"]
    endpoint = ray.get(actor.endpoint.remote())
    version_before = ray.get(actor.version.remote())
    before = generate(actor)
    payload, expected = BAD_HEADERS[case]
    if case == "duplicate name":
        payload = _duplicate_manifest_bytes()
    ack = _raw_begin(endpoint, payload)
    assert not ack.ok
    assert expected in ack.reason, ack.reason
    assert ray.get(actor.version.remote()) == version_before
    assert generate(actor) == before


def _raw_bucket(actor: Any, identity: bytes, data: bytes, checksum: int, payload: bytes) -> wire.Ack:
    """Begin a one-tensor update of model.norm.weight, send one bucket, return the engine's answer."""
    import ray

    endpoint = ray.get(actor.endpoint.remote())
    version = ray.get(actor.version.remote()) + 1
    client = RawClient(endpoint, identity=identity)
    try:
        client.send(wire.Begin(_manifest(version, [_norm_spec()], [len(data)])))
        client.until(wire.Credit)
        client.send(wire.BucketHeader(version=version, index=0, checksums=(checksum,)), payload)
        ack: wire.Ack = client.until(wire.Ack)
        return ack
    finally:
        client.close()


@pytest.mark.parametrize(("case", "expected"), [
    ("checksum", "tensor model.norm.weight: checksum mismatch"),
    ("truncated", "100 bytes arrived, manifest says 256 (truncated?)"),
    ("nonfinite", "tensor model.norm.weight: holds NaN or Inf (policy sync.nonfinite=reject)"),
])
def test_bad_bucket_refused_and_nothing_applied(dense: Any, case: str, expected: str) -> None:
    import ray
    import torch

    if dense["tp"] != 1:
        pytest.skip("checked on the receiver; one TP size suffices")
    actor = dense["actor"]
    version_before = ray.get(actor.version.remote())
    before = generate(actor)
    data = torch.full((128,), 3.0, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    if case == "checksum":
        ack = _raw_bucket(actor, b"bad-checksum", data, zlib.crc32(data) ^ 1, data)
    elif case == "nonfinite":
        values = torch.full((128,), 3.0, dtype=torch.bfloat16)
        values[7] = float("nan")
        values[9] = float("inf")
        bad = values.view(torch.uint8).numpy().tobytes()
        ack = _raw_bucket(actor, b"bad-nonfinite", bad, zlib.crc32(bad), bad)
    else:
        ack = _raw_bucket(actor, b"bad-truncated", data, zlib.crc32(data), data[:100])
    assert not ack.ok
    assert expected in ack.reason, ack.reason
    assert ray.get(actor.version.remote()) == version_before
    assert generate(actor) == before


def test_publisher_reports_engine_reason(dense: Any) -> None:
    """Through the public API: a wrong shape raises UpdateFailed naming the tensor; nothing applied."""
    import ray
    import torch

    from bridge.errors import UpdateFailed
    from trainer_side import WeightPublisher

    if dense["tp"] != 1:
        pytest.skip("checked on the receiver; one TP size suffices")
    actor = dense["actor"]
    endpoint = ray.get(actor.endpoint.remote())
    before = generate(actor)
    version_before = ray.get(actor.version.remote())
    with WeightPublisher([endpoint]) as pub:
        with pytest.raises(UpdateFailed) as info:
            pub.publish([("model.norm.weight", torch.ones(64))], version=version_before + 5)
    assert "tensor model.norm.weight: shape [64] does not match the engine's [128]" in str(info.value)
    assert endpoint in info.value.reasons
    assert generate(actor) == before


def test_same_version_with_other_weights_is_refused(dense: Any) -> None:
    """A version number the engine serves, re-sent with other weights (two trainers sharing a version
    range), is refused as a VersionConflict naming the tensor, and the engine keeps serving what it had;
    the same weights again stay a no-op, checked by their checksums (tests/test_served.py: the parts)."""
    import ray
    import torch

    from bridge.errors import UpdateFailed
    from trainer_side import WeightPublisher

    if dense["tp"] != 1:
        pytest.skip("decided on the receiver, the same at every TP size")
    actor = dense["actor"]
    endpoint = ray.get(actor.endpoint.remote())
    version = ray.get(actor.version.remote()) + 10
    norm = torch.full((128,), 1.25, dtype=torch.bfloat16)
    with WeightPublisher([endpoint]) as pub:
        assert pub.publish([(NORM, norm)], version=version).ok
        served = generate(actor)
        with pytest.raises(UpdateFailed) as info:
            pub.publish([(NORM, norm * 0.5)], version=version)
        assert info.value.reasons[endpoint].startswith(
            f"VersionConflict: version {version} is already served with different weights (1 of 1 tensors differ: {NORM})")
        assert ray.get(actor.version.remote()) == version
        assert generate(actor) == served
        assert ray.get(actor.read_params.remote([NORM]))[0][NORM][:4] == [1.25] * 4
        conflict = _last_record(actor, lambda r: not r["ok"] and r["version"] == version)
        assert conflict["reason"].startswith(f"conflict: VersionConflict: version {version} is already served"), conflict
        records_before = len(ray.get(actor.records.remote()))  # what the metrics and the dashboard show
        (again,) = pub.publish([(NORM, norm)], version=version).engines
        assert again.noop and again.engine.get("content_checked") is True
    records = ray.get(actor.records.remote())
    assert len(records) == records_before, records[records_before:]  # a checked no-op records nothing


def test_results_carry_the_version_that_produced_them(dense: Any) -> None:
    """``generate`` and ``score`` results name the weight version that produced them, also when an update
    lands while a caller generates: each result labelled version v equals what the engine serves at v."""
    import threading

    import ray
    import torch

    from trainer_side import WeightPublisher

    if dense["tp"] != 1:
        pytest.skip("the label is set by the actor, the same at every TP size")
    actor = dense["actor"]
    endpoint = ray.get(actor.endpoint.remote())
    first = ray.get(actor.version.remote()) + 1
    norms = {first: 1.5, first + 1: 0.25, first + 2: 1.5}  # the third version serves the first one's weights
    seen: dict[int, Any] = {}

    def content(outs: list[dict[str, Any]]) -> list[Any]:
        return [(o["token_ids"], o["logprobs"]) for o in outs]

    with WeightPublisher([endpoint]) as pub:
        for version in (first, first + 1):
            assert pub.publish([(NORM, torch.full((128,), norms[version], dtype=torch.bfloat16))], version=version).ok
            outs = generate(actor)
            assert {o["version"] for o in outs} == {version}
            scored = ray.get(actor.score.remote([[1, 2, 3, 4, 5]]))
            assert scored[0]["version"] == version and len(scored[0]["logprobs"]) == 4
            seen[version] = content(outs)
        assert seen[first] != seen[first + 1], "the two norms give the same outputs: the test could not tell them apart"
        third = threading.Thread(target=pub.publish, args=([(NORM, torch.full((128,), norms[first + 2], dtype=torch.bfloat16))],),
                                 kwargs={"version": first + 2})
        results = [generate(actor)]
        third.start()
        while third.is_alive():
            results.append(generate(actor))
        third.join()
        results.append(generate(actor))
    expected = {first + 1: seen[first + 1], first + 2: seen[first]}
    for outs in results:
        (version,) = {o["version"] for o in outs}  # one call, one version
        assert content(outs) == expected[version], f"outputs labelled version {version} came from other weights"
    assert results[0][0]["version"] == first + 1 and results[-1][0]["version"] == first + 2


def _last_record(actor: Any, cond: Any, timeout: float = 10.0) -> dict[str, Any]:
    """The engine's newest sync record once it satisfies ``cond`` (records are written by its receiver
    thread, after the publisher has returned)."""
    import time

    import ray

    end = time.monotonic() + timeout
    while True:
        record: dict[str, Any] = ray.get(actor.records.remote())[-1]
        if cond(record) or time.monotonic() > end:
            return record
        time.sleep(0.1)


def test_operators_poll_the_engine_over_its_receiver(dense: Any) -> None:
    """The dashboard's ReceiverSource asks the receiver itself (no Ray): the actor's status and records."""
    import ray

    from apps.dashboard import ReceiverSource

    if dense["tp"] != 1:
        pytest.skip("answered by the receiver, the same at every TP size")
    actor = dense["actor"]
    source = ReceiverSource(ray.get(actor.endpoint.remote()), timeout_s=30)
    try:
        status, records = source()
    finally:
        source.close()
    want = ray.get(actor.status.remote())
    assert (status["engine"], status["version"], status["tp_size"]) == (want["engine"], want["version"], 1)
    assert records == ray.get(actor.records.remote())
