"""The receivers of one host verify a shared-memory bucket once between them; a failed check leaves no verdict.

Real separate processes contend for a real verdict file in /dev/shm; real receivers (without a model:
tests/fakes.py's FakeEngine reports the crc32 of every tensor it read) take real updates over ZMQ and shared memory."""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge import wire
from bridge.config import config_from_dict
from bridge.shm import Segment, verdict_path
from tests import recording_receiver as recording
from tests.helpers import ROOT, spec, weights
from tests.rawclient import RawClient

SMALL = {"transport": {"bucket_mb": 0.02, "depth": 2}}
CONTENDER = """
import sys, time
from bridge.host_verdicts import verify_once
segment, key, log = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]
sys.stdin.readline()
def verify():
    with open(log, "a") as f:
        f.write("ran\\n")
    time.sleep(0.3)
print("RAN" if verify_once(segment, key, verify, 30.0) else "SKIPPED", flush=True)
"""


def _contend(segment: str, key: bytes, log: Path, count: int) -> list[str]:
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, segment, key.hex(), str(log)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    for p in procs:  # all started before any is told to go
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return sorted(p.communicate(timeout=60)[0].strip() for p in procs)


def test_one_process_of_many_verifies_a_segment_under_one_key(tmp_path: Path) -> None:
    segment = Segment.create("test", 4096)
    log = tmp_path / "log"
    try:
        assert _contend(segment.name, b"k" * 16, log, 3) == ["RAN", "SKIPPED", "SKIPPED"]
        assert log.read_text().count("ran") == 1
        assert _contend(segment.name, b"j" * 16, log, 2) == ["RAN", "SKIPPED"]  # a new key: verified again
        assert log.read_text().count("ran") == 2
        assert verdict_path(segment.name).exists()
    finally:
        segment.close()
    assert not verdict_path(segment.name).exists()  # the owner's unlink takes the verdict with the segment


def test_a_failed_verification_leaves_no_verdict() -> None:
    from bridge.errors import ChecksumError
    from bridge.host_verdicts import verify_once

    calls = []

    def bad() -> None:
        calls.append(1)
        raise ChecksumError("bad bytes")

    segment = Segment.create("test", 4096)
    try:
        for _ in range(2):
            with pytest.raises(ChecksumError):
                verify_once(segment.name, b"k" * 16, bad, 5.0)
        assert len(calls) == 2
    finally:
        segment.close()


def test_a_verdict_on_an_unlinked_segment_is_not_left_behind() -> None:
    from bridge.host_verdicts import verify_once

    segment = Segment.create("test", 4096)
    segment.close()
    ran = []
    assert verify_once(segment.name, b"k" * 16, lambda: ran.append(1), 5.0) and ran == [1]
    assert not verdict_path(segment.name).exists()


# ---- receivers ---------------------------------------------------------------------------------------
@pytest.fixture(params=[True, False], ids=["once-per-host", "every-receiver"])
def receivers(request: Any) -> Any:
    """Three receiver processes on this host, verifying once per host or each on its own."""
    procs, endpoints = recording.start({**SMALL, "sync": {"verify_once_per_host": request.param}}, 3)
    try:
        yield request.param, endpoints
    finally:
        recording.stop(procs)


def test_receivers_on_one_host_verify_each_shm_bucket_once(receivers: Any) -> None:
    from trainer_side import WeightPublisher
    from trainer_side.packing import make_plan

    once, endpoints = receivers
    named = weights(3)
    config = config_from_dict(SMALL)
    buckets = len(make_plan(named, "bfloat16", config.transport.bucket_bytes)[0].bucket_sizes)
    assert buckets >= 3
    with WeightPublisher(endpoints, config=config, transport="shm") as pub:
        reports = [pub.publish(named, version) for version in (1, 2)]  # the second reuses the segments
    sent = {name: zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) for name, t in named}
    for report in reports:
        assert report.ok
        for engine in report.engines:
            assert engine.engine["crc32"] == sent, engine.endpoint
        skipped = [e.engine["buckets_verified_by_peer"] for e in report.engines]
        # once per host: each bucket verified by one receiver, skipped by the other two
        assert sum(skipped) == (2 * buckets if once else 0), skipped


def _raw_update(endpoint: str, segment: Segment, version: int, token: str, checksum: int, identity: bytes) -> wire.Ack:
    """One update of one 256-byte tensor lying in ``segment``, sent as a publisher on this host would."""
    norm = spec("model.norm.weight", "bfloat16", (128,))
    client = RawClient(endpoint, identity=identity)
    try:
        client.send(wire.Begin(wire.Manifest(version=version, tensors=(norm,), bucket_sizes=(256,), publisher="raw",
                                             transport="shm")))
        client.until(wire.Credit)
        client.send(wire.BucketHeader(version=version, index=0, checksums=(checksum,), segment=segment.name, token=token))
        client.send(wire.End(version=version))
        ack: wire.Ack = client.until(wire.Ack)
        return ack
    finally:
        client.close()


def test_a_verdict_covers_only_the_send_it_was_made_for(start_receiver: Any) -> None:
    """A verdict on good bytes does not cover bytes rewritten into the segment for another send (another
    token), even with the same version and checksums; a failed check leaves no verdict behind."""
    from tests.fakes import FakeEngine

    endpoints = [start_receiver(config_from_dict(SMALL), FakeEngine(keep="crc32")).endpoint for _ in range(2)]
    segment = Segment.create("pub", 256)
    good = torch.full((128,), 1.5, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    bad = torch.full((128,), 2.5, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    try:
        segment.buffer[:] = good
        first = _raw_update(endpoints[0], segment, 1, "send-a", zlib.crc32(good), b"raw-1")
        assert first.ok and first.report["buckets_verified_by_peer"] == 0, first
        shared = _raw_update(endpoints[1], segment, 1, "send-a", zlib.crc32(good), b"raw-2")
        assert shared.ok and shared.report["buckets_verified_by_peer"] == 1, shared  # the same send: skipped
        segment.buffer[:] = bad  # rewritten for another send of the same version, announced with the old checksum
        for endpoint, identity in zip(endpoints, (b"raw-3", b"raw-4"), strict=True):  # the second one too
            ack = _raw_update(endpoint, segment, 1, "send-b", zlib.crc32(good), identity)
            assert not ack.ok and ack.kind == "checksum" and "model.norm.weight" in ack.reason, ack
    finally:
        segment.close()
