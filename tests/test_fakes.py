"""The tests' engine fake itself (tests/fakes.py), driven directly: what it records, what it refuses, and
that it notices a receiver breaking the engine contract. Everything else trusts it behind real receivers."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
import torch

from bridge.errors import VersionError
from bridge.report import ApplyResult, FailureKind, LoadResult
from bridge.shm import Segment
from inference_side.contract import StagedBucket
from tests.fakes import FakeEngine
from tests.helpers import manifest, spec

A = torch.arange(4, dtype=torch.float32)
B = torch.full((4,), 2.5)
M = manifest([spec("a", "float32", (4,), 0), spec("b", "float32", (4,), 1)], [16, 16], version=7)


def _bucket(index: int, tensor: torch.Tensor) -> StagedBucket:
    seg = Segment.create("test", 16)
    seg.buffer[:16] = tensor.view(torch.uint8).numpy().tobytes()
    return StagedBucket(index, seg, [M.by_bucket()[index][0]], ())


@pytest.fixture
def buckets() -> Iterator[list[StagedBucket]]:
    made = [_bucket(0, A), _bucket(1, B)]
    yield made
    for b in made:
        b.segment.close()


def _update(engine: FakeEngine, buckets: list[StagedBucket]) -> ApplyResult:
    engine.begin(M)
    for b in buckets:
        assert not engine.load(M, b).error
    return engine.finish(M, {"receive": 0.5})


def test_records_what_it_loaded_copied_before_the_segment_is_reused(buckets: list[StagedBucket]) -> None:
    engine = FakeEngine(keep="bytes")
    engine.begin(M)
    engine.load(M, buckets[0])
    buckets[0].segment.buffer[:16] = bytes(16)  # streaming: the receiver reuses the segment once load returned
    engine.load(M, buckets[1])
    result = engine.finish(M, {"receive": 0.5})
    assert result.ok and result.report["seconds"]["receive"] == 0.5
    assert engine.applied == [7] and engine.info().version == 7 and engine.violations == []
    assert torch.equal(engine.tensors(7)["a"], A) and torch.equal(engine.tensors(7)["b"], B)
    assert engine.segments == [b.segment.name for b in buckets]


def test_crc32_is_reported_in_the_ack(buckets: list[StagedBucket]) -> None:
    result = _update(FakeEngine(keep="crc32"), buckets)
    assert result.report["crc32"] == {"a": zlib.crc32(A.numpy().tobytes()), "b": zlib.crc32(B.numpy().tobytes())}


def test_expected_bytes_are_checked(buckets: list[StagedBucket]) -> None:
    engine = FakeEngine()
    engine.expect([("a", A), ("b", B + 1)])
    result = _update(engine, buckets)
    assert not result.ok and result.reason == "bytes differ: ['b']" and engine.applied == []
    engine.expect({"a": A, "b": B, "c": B})
    assert _update(engine, buckets).reason == "bytes differ: ['c']"  # expected and never received
    engine.expect([("a", A), ("b", B)])
    assert _update(engine, buckets).ok and engine.applied == [7]


def test_validate_refuses_answers_noop_and_defers() -> None:
    engine = FakeEngine(version=7, noop_same_version=True, refuse={9}, validate=lambda m: "custom" if m.version == 8 else None)
    assert engine.validate(M) == "version 7 already served"
    with pytest.raises(VersionError, match="version 9 refused by this test engine"):
        engine.validate(manifest(version=9))
    assert engine.validate(manifest(version=8)) == "custom" and engine.validate(manifest(version=10)) is None
    assert engine.validated == [7, 9, 8, 10]


def test_a_failed_load_is_the_answer_of_finish(buckets: list[StagedBucket]) -> None:
    engine = FakeEngine(on_load=lambda m, b: LoadResult("rank 0: boom", FailureKind.LOAD) if b.index == 0 else None)
    engine.begin(M)
    assert engine.load(M, buckets[0]).kind is FailureKind.LOAD
    assert engine.load(M, buckets[1]).error == "rank 0: boom"  # a load queued behind the failure
    result = engine.finish(M, {})
    assert (result.ok, result.kind, result.reason) == (False, FailureKind.LOAD, "rank 0: boom")
    assert engine.applied == [] and not engine.is_open and engine.violations == []


def test_on_finish_answers_for_the_engine(buckets: list[StagedBucket]) -> None:
    engine = FakeEngine(on_finish=lambda m: ApplyResult(False, "AuditError: stale a", FailureKind.STALE))
    assert _update(engine, buckets).kind is FailureKind.STALE and engine.applied == []


def test_abort_ends_the_open_update(buckets: list[StagedBucket]) -> None:
    engine = FakeEngine()
    engine.begin(M)
    engine.load(M, buckets[0])
    engine.abort(M, "the publisher went away")
    assert engine.aborted == [(7, "the publisher went away")] and not engine.is_open
    assert _update(engine, buckets).ok and engine.violations == []  # the next update starts afresh


def test_contract_violations_are_recorded(buckets: list[StagedBucket]) -> None:
    engine = FakeEngine()
    assert engine.load(M, buckets[0]).kind is FailureKind.WIRE  # no update open
    assert not engine.finish(M, {}).ok
    engine.begin(M)
    engine.begin(M)  # begun twice
    engine.load(M, buckets[1])
    engine.load(M, buckets[0])  # out of order
    engine.abort(M, "x")
    engine.begin(M)
    engine.load(M, buckets[0])
    assert not engine.finish(M, {}).ok  # bucket 1 never loaded
    assert engine.violations == [
        "load of bucket 0 of version 7 outside an open update",
        "finish of version 7 outside an open update",
        "begin of version 7 while version 7 is open",
        "bucket 0 of version 7 loaded after bucket 1",
        "finish of version 7 with buckets [1] never loaded",
    ]
