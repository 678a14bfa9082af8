"""A version number re-used for other weights is a VersionConflict, not a silent "already served".

The pure parts (what an engine records, what it answers, what the publisher compares) are checked case by
case; then a real publisher and a real receiver over real sockets (ZMQ, shared memory, gloo) with the
FakeEngine of tests/fakes.py that, like the engine, answers "already served" for the version it serves. The engine
itself: tests/test_e2e_dense.py::test_same_version_with_other_weights_is_refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bridge import wire
from bridge.config import config_from_dict
from bridge.errors import UpdateFailed
from bridge.report import FailureKind
from bridge.served import ServedContent, conflict_reason, differing, published_sums
from tests.fakes import FakeEngine
from tests.helpers import manifest, spec, wait_until, weights
from trainer_side import WeightPublisher


def _manifest(names: list[str], buckets: list[int], checksum: str = "xxh3") -> wire.Manifest:
    """Version 3: ``names`` of four bfloat16 each, at offset 0 of their bucket (only names and order matter here)."""
    return manifest([spec(n, "bfloat16", (4,), b) for n, b in zip(names, buckets, strict=True)],
                    [8] * (max(buckets) + 1), checksum=checksum)


# ---- what an engine records and answers -------------------------------------------------------------

@pytest.mark.parametrize(("updates", "asked", "expected"), [
    # one full update, asked for the same tensors: its sums in the manifest's order
    ([("xxh3", {"a": 1, "b": 2})], (["b", "a"], "xxh3"), [2, 1]),
    # a partial update overrides only its own tensors
    ([("xxh3", {"a": 1, "b": 2}), ("xxh3", {"b": 5})], (["a", "b"], "xxh3"), [1, 5]),
    # asked under another algorithm: it cannot say
    ([("xxh3", {"a": 1})], (["a"], "crc32"), None),
    # a change of algorithm forgets what the other one recorded
    ([("xxh3", {"a": 1, "b": 2}), ("crc32", {"b": 7})], (["a", "b"], "crc32"), None),
    ([("xxh3", {"a": 1, "b": 2}), ("crc32", {"b": 7})], (["b"], "crc32"), [7]),
    # an update sent without checksums leaves nothing to compare
    ([("xxh3", {"a": 1}), ("none", {})], (["a"], "none"), None),
    ([("xxh3", {"a": 1}), ("none", {})], (["a"], "xxh3"), None),
    # a tensor never updated with a checksum (the cold-loaded model's): it cannot say
    ([("xxh3", {"a": 1})], (["a", "c"], "xxh3"), None),
    # nothing recorded yet
    ([], (["a"], "xxh3"), None),
])
def test_served_content_lookup(updates: list[tuple[str, dict[str, int]]], asked: tuple[list[str], str],
                               expected: list[int] | None) -> None:
    served = ServedContent()
    for algorithm, sums in updates:
        served.record(algorithm, sums, sums.keys() if sums else ["a"])
    names, algorithm = asked
    assert served.lookup(_manifest(names, [0] * len(names), algorithm)) == expected


def test_a_tensor_updated_without_its_checksum_is_forgotten() -> None:
    served = ServedContent()
    served.record("xxh3", {"a": 1, "b": 2}, ["a", "b"])
    served.record("xxh3", {"a": 3}, ["a", "b"])  # b came without a checksum this time
    assert served.lookup(_manifest(["a"], [0])) == [3]
    assert served.lookup(_manifest(["a", "b"], [0, 0])) is None


# ---- what the publisher compares ------------------------------------------------------------------

def test_published_sums_follow_each_buckets_order() -> None:
    m = _manifest(["a", "b", "c"], [0, 0, 1])
    assert published_sums(m, {0: (10, 11), 1: (12,)}) == {"a": 10, "b": 11, "c": 12}
    assert published_sums(m, {0: (), 1: (12,)}) == {"c": 12}  # a bucket sent without checksums


@pytest.mark.parametrize(("served", "expected"), [
    ([1, 2, 3], []),
    ([1, 9, 3], ["b"]),
    ([9, 2, 8], ["a", "c"]),
    ([1, 2], None),            # wrong length
    ("1,2,3", None),           # not a list
    ([1, 2, "3"], None),       # not integers
    ([1, 2, True], None),
])
def test_differing(served: Any, expected: list[str] | None) -> None:
    m = _manifest(["a", "b", "c"], [0, 0, 1])
    assert differing(m, {"a": 1, "b": 2, "c": 3}, served) == expected


def test_differing_cannot_compare_what_the_publisher_did_not_sum() -> None:
    m = _manifest(["a", "b"], [0, 1])
    assert differing(m, {"a": 1}, [1, 2]) is None


def test_conflict_reason_names_the_tensors_and_what_to_do() -> None:
    names = [f"t{i}" for i in range(8)]
    reason = conflict_reason(4, names, 20)
    assert reason.startswith("VersionConflict: version 4 is already served with different weights (8 of 20 tensors differ")
    assert "t0, t1, t2, t3, t4 and 3 more" in reason and "t5" not in reason
    assert "newer version" in reason


# ---- over real sockets --------------------------------------------------------------------------------

def engine(version: int = 0) -> FakeEngine:
    """Like the engine: answers "already served" for the version it serves; keeps the bytes it applied."""
    return FakeEngine(version=version, noop_same_version=True, keep="bytes", transports=("zmq", "shm", "gloo"))


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return weights(seed, shape=(2048,), name="model.layers.{i}.mlp.weight")


def _conflicts(events: list[tuple[str, dict[str, Any]]], count: int) -> list[dict[str, Any]]:
    """The receivers' conflict events, once ``count`` arrived (each is recorded on a receiver's own thread,
    when the publisher's Abort naming the conflict reaches it)."""
    wait_until(lambda: len([k for k, _ in events if k == "conflict"]) >= count, what=f"{count} conflict events")
    return [d for k, d in events if k == "conflict"]


CONFIG = config_from_dict({"transport": {"bucket_mb": 8192 / 2**20, "depth": 2}, "deadlines": {"connect_s": 20, "bucket_s": 20}})


@pytest.mark.parametrize("transport", ["zmq", "shm", "gloo"])
def test_same_version_with_other_weights_is_a_conflict_not_a_noop(start_receiver: Any, transport: str) -> None:
    gate = engine()
    events: list[tuple[str, dict[str, Any]]] = []
    rx = start_receiver(CONFIG, gate, events)
    first, other = _weights(1), _weights(2)
    changed = [n for (n, a), (_, b) in zip(first, other, strict=True) if not torch.equal(a, b)]
    with WeightPublisher(rx.endpoint, config=CONFIG, transport=transport) as pub:
        assert pub.publish(first, 1).ok
        with pytest.raises(UpdateFailed) as info:
            pub.publish(other, 1)
        assert info.value.kinds[rx.endpoint] is FailureKind.CONFLICT, info.value.kinds  # the publisher's own verdict
        assert [(d["kind"], d["version"]) for d in _conflicts(events, 1)] == [("conflict", 1)], events
        reason = info.value.reasons[rx.endpoint]
        assert f"({len(changed)} of 6 tensors differ: {changed[0]}" in reason, reason  # what people read
        assert gate.applied == [1]  # the other weights were never applied

        # one tensor changed under the same number: that one is named, and only that one
        partial = [(n, t + 1 if n == first[3][0] else t) for n, t in first]
        with pytest.raises(UpdateFailed) as info:
            pub.publish(partial, 1)
        assert [(d["kind"], d["version"]) for d in _conflicts(events, 2)] == [("conflict", 1)] * 2, events
        assert f"(1 of 6 tensors differ: {first[3][0]})" in info.value.reasons[rx.endpoint]

        again = pub.publish(first, 1)  # the same weights again: the no-op stands, checked by content
        (eng,) = again.engines
        assert eng.ok and eng.noop and eng.engine.get("content_checked") is True
        assert "served_checksums" not in eng.engine

        assert pub.publish(other, 2).ok  # under a new number the other weights go through
    assert gate.applied == [1, 2]
    # the engine heard of both conflicts, and no more (its records, metrics and dashboard show them as failed syncs)
    conflicts = [d for k, d in events if k == "conflict"]
    assert [(d["kind"], d["version"]) for d in conflicts] == [("conflict", 1)] * 2, events
    assert changed[0] in conflicts[0]["reason"] and first[3][0] in conflicts[1]["reason"], conflicts
    assert gate.received[2][first[0][0]] == other[0][1].view(torch.uint8).numpy().tobytes()


def test_a_noop_the_engine_cannot_check_stays_a_noop(start_receiver: Any) -> None:
    """An engine that serves a version it did not receive over the bridge (cold-loaded, restarted) has
    no checksums to answer with: the version number decides, as before, and the report says so."""
    rx = start_receiver(CONFIG, engine(version=5))
    with WeightPublisher(rx.endpoint, config=CONFIG) as pub:
        (eng,) = pub.publish(_weights(1), 5).engines
    assert eng.ok and eng.noop and "content_checked" not in eng.engine


def test_a_relay_passes_the_conflict_on(start_receiver: Any) -> None:
    """Behind a host-local relay (which takes every update and forwards it), the engines' checked no-op
    is compared with the relay's staged checksums: the conflict reaches the trainer and both engines."""
    from inference_side.relay import Relay

    gates = [engine(), engine()]
    events: list[tuple[str, dict[str, Any]]] = []
    endpoints = [start_receiver(CONFIG, g, events).endpoint for g in gates]
    relay = Relay(endpoints, CONFIG, name="relay-conflict")
    try:
        with WeightPublisher(relay.endpoint(), config=CONFIG, transport="zmq") as pub:
            assert pub.publish(_weights(1), 1).ok
            with pytest.raises(UpdateFailed) as info:
                pub.publish(_weights(2), 1)
    finally:
        relay.shutdown()
    # both engines heard of the conflict from the relay (its Abort), each on its receiver's own thread
    assert [(d["kind"], d["version"]) for d in _conflicts(events, 2)] == [("conflict", 1)] * 2, events
    assert info.value.kinds[relay.endpoint()] is FailureKind.CONFLICT, info.value.kinds  # passed on by the relay
    message = str(info.value)
    assert all(f"{ep}: " in message for ep in endpoints), message  # both engines named
    assert message.count("6 of 6 tensors differ") == 2, message
    assert [g.applied for g in gates] == [[1], [1]]

