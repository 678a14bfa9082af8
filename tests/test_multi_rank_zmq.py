"""The receiving end of a sharded update over ZMQ (bridge/transports/zmq_plane.py), driven through a real
``SyncReceiver`` by raw sockets: rank 0's control socket (manifest, headers with the ranges' checksums, End)
and each trainer rank's own data socket (``RankBucket`` + its ranges of the bucket in one frame). The ranks'
ranges land where they lie (strided ones too) and are verified per range; a rank that is not one of the
update's, sends twice, sends the wrong amount, sends where it has no range, sends bytes that do not match
its checksum or sends nothing leaves the engine stand-in untouched and the refusal names the rank. Real
ranks over ZMQ: tests/test_multi_rank.py (four ranks, no engine) and tests/test_ray_train.py (Ray Train,
an engine)."""

from __future__ import annotations

from typing import Any

import pytest

from bridge import wire
from bridge.checksums import function
from bridge.config import config_from_dict
from bridge.shards import RangeSpec, ShardManifest, TensorHeader, bucket_ranges, layout
from tests.fakes import FakeEngine
from tests.rawclient import RawClient

# [4, 6] float32: rank 0 its first 3 columns (strided), rank 1 the last 3; [5] bfloat16: rank 1
HEADERS = (TensorHeader("model.layers.0.w", "float32", (4, 6)), TensorHeader("model.norm.weight", "bfloat16", (5,)))
RANGES = (RangeSpec("model.layers.0.w", 0, 0, 48, 0, 12, 24), RangeSpec("model.layers.0.w", 1, 12, 48, 0, 12, 24),
          RangeSpec("model.norm.weight", 1, 0, 10))
CONTROL = b"pub-zmq|tcp://x"


def _update(world: int = 2) -> tuple[wire.Manifest, bytes, list[int], dict[int, bytes]]:
    """Version 2's manifest (transport zmq), its one bucket's bytes (distinct values, finite floats), the
    header's checksums (manifest order) and each rank's frame (its ranges' bytes as sent)."""
    import torch

    shards = ShardManifest(world, HEADERS, RANGES)
    specs, sizes = layout(shards, 1 << 20)
    manifest = wire.Manifest(version=2, tensors=specs, bucket_sizes=sizes, publisher="pub-zmq", transport="zmq",
                             shards=shards)
    data = bytearray(sizes[0])
    for spec, (_, dtype, shape) in zip(specs, ((h.name, h.dtype, h.shape) for h in HEADERS), strict=True):
        values = torch.arange(1, 1 + int(torch.tensor(shape).prod()), dtype=getattr(torch, dtype)).reshape(shape)
        data[spec.offset : spec.offset + spec.nbytes] = values.view(torch.uint8).flatten().numpy().tobytes()
    offset = {t.name: t.offset for t in specs}
    crc = function("crc32")
    sums, frames = [], {}
    for r in bucket_ranges(shards, specs, 1)[0]:
        sent = b"".join(bytes(data[offset[r.name] + s : offset[r.name] + e]) for s, e in r.runs())
        sums.append(crc(sent))
        frames[r.rank] = frames.get(r.rank, b"") + sent
    return manifest, bytes(data), sums, frames


@pytest.mark.parametrize("ranges", [
    (RangeSpec("t", 0, 0, 40),),
    (RangeSpec("t", 1, 40, 56),),
    (RangeSpec("t", 0, 0, 48, 0, 12, 24), RangeSpec("t", 1, 12, 48, 0, 12, 24)),
    (RangeSpec("t", 2, 8, 16, 0, 4, 24), RangeSpec("t", 2, 60, 20)),
], ids=["contiguous", "contiguous-tail", "strided-two-ranks", "strided-then-contiguous"])
def test_scatter_lays_each_range_at_its_runs(ranges: tuple[RangeSpec, ...]) -> None:
    """What a rank sends (each range's runs concatenated, ranges in order) lands where ``runs()`` says, and
    nowhere else."""
    from bridge.transports.zmq_plane import scatter

    base = 16
    want = bytearray(base + 96 + 8)
    data = bytearray()
    for r in ranges:
        for start, end in r.runs():
            chunk = bytes((start + i) % 251 + 1 for i in range(end - start))
            want[base + start : base + end] = chunk
            data += chunk
    got = bytearray(len(want))
    scatter(memoryview(got), base, ranges, bytes(data))
    assert got == want


class _Peers:
    """Rank 0's control socket and one data socket per rank, all to one receiver."""

    def __init__(self, endpoint: str, ranks: range) -> None:
        self.control = RawClient(endpoint, identity=CONTROL)
        self.rank = {r: RawClient(endpoint, identity=CONTROL + f"|rank{r}".encode()) for r in ranks}

    def begin(self, manifest: wire.Manifest) -> None:
        self.control.send(wire.Hello(publisher="pub-zmq"))
        self.control.until(wire.EngineInfo)
        self.control.send(wire.Begin(manifest))
        self.control.until(wire.Credit)

    def piece(self, rank: int, frame: bytes, index: int = 0, version: int = 2) -> None:
        self.rank[rank].send(wire.RankBucket(version=version, index=index, rank=rank), frame)

    def close(self) -> None:
        self.control.close()
        for client in self.rank.values():
            client.close()


@pytest.fixture
def receiver(start_receiver: Any) -> Any:
    def start(mode: str = "staged", **deadlines: float) -> tuple[Any, FakeEngine]:
        engine = FakeEngine(keep="bytes", version=1)
        return start_receiver(config_from_dict({"deadlines": deadlines, "sync": {"mode": mode}}), engine), engine

    return start


def test_ranges_of_two_ranks_land_where_they_lie_and_the_engine_gets_the_tensors(receiver: Any) -> None:
    """Rank 1's part comes before rank 0's and both before the header: the engine applies exactly the
    full tensors (rank 0's strided columns interleaved with rank 1's)."""
    import torch

    rx, engine = receiver()
    manifest, data, sums, frames = _update()
    peers = _Peers(rx.endpoint, range(2))
    try:
        peers.begin(manifest)
        peers.piece(1, frames[1])
        peers.piece(0, frames[0])
        peers.control.send(wire.BucketHeader(version=2, index=0, checksums=tuple(sums)))
        peers.control.send(wire.End(version=2))
        ack = peers.control.until(wire.Ack)
    finally:
        peers.close()
    assert ack.ok, ack
    got = engine.tensors(2)
    for spec in manifest.tensors:
        assert got[spec.name].contiguous().view(torch.uint8).flatten().numpy().tobytes() == data[spec.offset : spec.offset + spec.nbytes]


@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_header_before_the_ranges_waits_for_every_rank(receiver: Any, mode: str) -> None:
    """End comes before rank 1's part: the receiver waits for it (heartbeating), then applies."""
    import time

    rx, engine = receiver(mode)
    manifest, _, sums, frames = _update()
    peers = _Peers(rx.endpoint, range(2))
    try:
        peers.begin(manifest)
        peers.control.send(wire.BucketHeader(version=2, index=0, checksums=tuple(sums)))
        peers.piece(0, frames[0])
        peers.control.send(wire.End(version=2))  # before rank 1's part: the receiver waits for it
        peers.control.until(wire.Heartbeat, timeout=10)  # and tells the publisher it is alive meanwhile
        time.sleep(0.5)
        peers.piece(1, frames[1])
        ack = peers.control.until(wire.Ack)
    finally:
        peers.close()
    assert ack.ok, ack
    assert engine.applied == [2]


@pytest.mark.parametrize(("scenario", "words"), [
    ("unknown-rank", "trainer rank 2 sent bucket 0, but it is not one of the update's ranks 0..1"),
    ("twice", "trainer rank 1 sent its ranges of bucket 0 twice"),
    ("short", "trainer rank 1 sent 57 bytes of bucket 0 in 1 frame(s); its ranges there hold 58 bytes"),
    ("no-range", "trainer rank 2 sent bytes of bucket 0, where the shard manifest gives it no range"),
    ("bad-bytes", "from rank 1: checksum mismatch"),
    ("silent", "trainer rank 1 sent nothing of bucket 0 of version 2 within 1.5s of its header"),
])
def test_a_rank_that_sends_wrong_or_nothing_fails_the_update_naming_it(receiver: Any, scenario: str, words: str) -> None:
    import time

    rx, engine = receiver(bucket_s=1.5)
    world = 3 if scenario == "no-range" else 2  # a third rank that holds no bytes
    manifest, _, sums, frames = _update(world)
    peers = _Peers(rx.endpoint, range(3))
    try:
        peers.begin(manifest)
        peers.piece(0, frames[0])
        if scenario == "unknown-rank":
            peers.piece(2, frames[1])
        elif scenario == "twice":
            peers.piece(1, frames[1])
            peers.piece(1, frames[1])
            time.sleep(0.5)  # both in before the header (another socket), else the update may finish first
        elif scenario == "short":
            peers.piece(1, frames[1][:-1])
        elif scenario == "no-range":
            peers.piece(2, b"\0" * 4)
        elif scenario == "bad-bytes":
            flipped = bytearray(frames[1])
            flipped[13] ^= 1  # rank 1's strided range, second run
            peers.piece(1, bytes(flipped))
        peers.control.send(wire.BucketHeader(version=2, index=0, checksums=tuple(sums)))
        if scenario != "silent":
            peers.control.send(wire.End(version=2))
        ack = peers.control.until(wire.Ack, timeout=30)
    finally:
        peers.close()
    assert not ack.ok and words in ack.reason, ack
    assert engine.applied == []
    assert engine.version == 1


@pytest.mark.parametrize(("ranges", "words"), [
    (RANGES[1:], r"bytes \[0, 12\) are sent by no rank"),
    ((RangeSpec("model.layers.0.w", 2, 0, 48, 0, 12, 24), *RANGES[1:]), "sent by rank 2, not one of the ranks"),
    ((*RANGES, RangeSpec("model.norm.weight", 0, 0, 4)), "sent by both rank 0 and rank 1"),
], ids=["gap", "unknown-rank", "overlap"])
def test_a_zmq_shard_manifest_that_does_not_cover_once_is_refused(receiver: Any, ranges: tuple[RangeSpec, ...],
                                                                  words: str) -> None:
    import re

    import msgpack

    rx, engine = receiver()
    manifest, *_ = _update()
    raw = manifest.to_wire()
    raw["shards"]["ranges"] = [r.to_wire() for r in ranges]  # as a faulty sender would put it
    client = RawClient(rx.endpoint, identity=CONTROL)
    try:
        client.send(wire.Hello(publisher="x"))
        client.until(wire.EngineInfo)
        client.send(msgpack.packb({"type": "begin", "manifest": raw}, use_bin_type=True))
        ack = client.until(wire.Ack)
    finally:
        client.close()
    assert not ack.ok and ack.kind == "manifest" and re.search(words, ack.reason), ack
    assert engine.validated == [] and engine.applied == []
