"""Publishing from many trainer ranks without an engine: the sharded manifest on the wire, the receiver's
check of each range (inference_side/ranges.py) and its refusals at the manifest, and four real ranks (FSDP2
over gloo) whose bytes, as a real ``SyncReceiver`` lands them, are exactly the unsharded model's. The engine
end to end is tests/test_multi_rank_engine.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from bridge import wire
from bridge.checksums import function
from bridge.config import config_from_dict
from bridge.errors import ChecksumError, WireError
from bridge.shards import RangeSpec, ShardError, ShardManifest, TensorHeader, bucket_ranges, layout
from inference_side.ranges import verify_ranges
from tests.fakes import FakeEngine
from tests.rawclient import RawClient

# a [4, 6] float32 tensor: rank 0 its first 3 columns (strided), rank 1 the last 3; a [5] tensor: rank 1
HEADERS = (TensorHeader("model.layers.0.w", "float32", (4, 6)), TensorHeader("model.norm.weight", "bfloat16", (5,)))
RANGES = (RangeSpec("model.layers.0.w", 0, 0, 48, 0, 12, 24), RangeSpec("model.layers.0.w", 1, 12, 48, 0, 12, 24),
          RangeSpec("model.norm.weight", 1, 0, 10))


def _sharded(ranges: tuple[RangeSpec, ...] = RANGES, world: int = 2) -> tuple[ShardManifest, wire.Manifest]:
    shards = ShardManifest(world, HEADERS, ranges)
    specs, sizes = layout(shards, 1 << 20)
    return shards, wire.Manifest(version=2, tensors=specs, bucket_sizes=sizes, transport="shm", shards=shards)


def _bucket(manifest: wire.Manifest) -> tuple[bytearray, list[int]]:
    """Bucket 0's bytes (a distinct value per byte) and each range's checksum over its bytes as sent."""
    data = bytearray(i % 251 for i in range(manifest.bucket_sizes[0]))
    assert manifest.shards is not None
    crc = function("crc32")
    offset = {t.name: t.offset for t in manifest.tensors}
    sums = [crc(b"".join(bytes(data[offset[r.name] + s : offset[r.name] + e]) for s, e in r.runs()))
            for r in bucket_ranges(manifest.shards, manifest.tensors, 1)[0]]
    return data, sums


def test_sharded_manifest_travels_and_must_match_its_tensors() -> None:
    _, manifest = _sharded()
    assert wire.decode(wire.encode(wire.Begin(manifest))) == wire.Begin(manifest)
    other = dataclasses.replace(manifest, tensors=(dataclasses.replace(manifest.tensors[0], dtype="int32"), manifest.tensors[1]))
    with pytest.raises(ShardError, match=r"model.layers.0.w: the update says int32 \[4, 6\], the shard manifest float32"):
        wire.decode(wire.encode(wire.Begin(other)))


def test_each_range_is_checked_where_it_lies_and_a_bad_one_names_its_rank() -> None:
    _, manifest = _sharded()
    data, sums = _bucket(manifest)
    ranges = bucket_ranges(manifest.shards, manifest.tensors, 1)[0]  # type: ignore[arg-type]
    verify_ranges(memoryview(data), 0, manifest.tensors, ranges, sums, "allow", "crc32")
    data[manifest.tensors[0].offset + 24 + 13] ^= 1  # row 1, column 3: rank 1's strided range
    with pytest.raises(ChecksumError, match=r"model.layers.0.w: bytes \[12, 96\) \(4 runs of 12 every 24\) from rank 1"):
        verify_ranges(memoryview(data), 0, manifest.tensors, ranges, sums, "allow", "crc32")
    with pytest.raises(WireError, match="2 checksums for 3 ranges"):
        verify_ranges(memoryview(data), 0, manifest.tensors, ranges, sums[:2], "allow", "crc32")


@pytest.mark.parametrize(("ranges", "world", "words"), [
    (RANGES[1:], 2, r"bytes \[0, 12\) are sent by no rank"),
    ((dataclasses.replace(RANGES[0], rank=2), *RANGES[1:]), 2, "sent by rank 2, not one of the ranks"),
    ((*RANGES, RangeSpec("model.norm.weight", 0, 0, 4)), 2, "sent by both rank 0 and rank 1"),
], ids=["gap", "unknown-rank", "overlap"])
def test_receiver_refuses_a_shard_manifest_that_does_not_cover_once(start_receiver: Any, ranges: tuple[RangeSpec, ...],
                                                                     world: int, words: str) -> None:
    engine = FakeEngine()
    rx = start_receiver(config_from_dict({}), engine)
    shards = ShardManifest(world, HEADERS, RANGES)
    specs, sizes = layout(shards, 1 << 20)
    raw = wire.Manifest(version=2, tensors=specs, bucket_sizes=sizes, transport="shm", shards=shards).to_wire()
    raw["shards"]["ranges"] = [r.to_wire() for r in ranges]  # as a faulty sender would put it
    client = RawClient(rx.endpoint, identity=b"sharded-bad")
    try:
        client.send(wire.encode(wire.Hello(publisher="x")))
        client.until(wire.EngineInfo)
        import msgpack

        client.send(msgpack.packb({"type": "begin", "manifest": raw}, use_bin_type=True))
        ack = client.until(wire.Ack)
    finally:
        client.close()
    assert not ack.ok and ack.kind == "manifest", ack
    assert "ShardError" in ack.reason and __import__("re").search(words, ack.reason), ack.reason
    assert engine.validated == [] and engine.applied == []


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_four_fsdp2_ranks_land_exactly_the_unsharded_bytes(start_receiver: Any, tmp_path: Path, transport: str) -> None:
    """Four real ranks (gloo, FSDP2, full_tensor raising) publish two versions through a real receiver; what
    it hands the engine stand-in is, byte for byte, the unsharded model's state dict (times 0.5 for the
    second version), and every rank returns the same report. Over zmq each rank sends its own ranges on its
    own socket (tcp) and the receiver lands them."""
    import torch

    from tests.ranks import full_weights, run_ranks

    engine = FakeEngine(keep="bytes", version=1)
    rx = start_receiver(config_from_dict({}), engine)
    endpoint = rx.endpoint if transport == "zmq" else rx.ipc_endpoint or rx.endpoint
    codes, results, logs = run_ranks(endpoint, "versions", 4, tmp_path, transport=transport)
    assert codes == [0, 0, 0, 0], logs
    assert all([(r["version"], r["ok"]) for r in res] == [(2, True), (3, True)] for res in results), results
    assert engine.applied == [2, 3]
    for version, scale in ((2, 1.0), (3, 0.5)):
        want = full_weights(2, scale).state_dict()
        got = engine.tensors(version)
        assert set(got) == set(want)
        assert not [n for n in want if not torch.equal(got[n], want[n])], version
    manifest = engine.manifests[3]
    assert manifest.shards is not None and manifest.shards.world_size == 4
    assert {r.rank for r in manifest.shards.ranges} == {0, 1, 2, 3}
    assert manifest.transport == transport


@pytest.mark.parametrize(("transport", "shard"), [("shm", "mixed"), ("zmq", "rows")])
def test_ranks_send_deltas_that_rebuild_the_unsharded_bytes_and_resend_dense_to_a_wrong_base(
        start_receiver: Any, tmp_path: Path, transport: str, shard: str) -> None:
    """``sync.delta`` on, two real FSDP2 ranks (over shm with inner-dim shards: strided ranges; over zmq with
    row shards): the first version goes dense, the next ones as deltas of about 0.8% of the elements. What
    the receiver hands the engine stand-in is, version by version, the unsharded model's bytes. Another
    publisher's version in between makes the next delta name a base the receiver no longer serves: it is
    refused and that version resent dense, the report naming why on every rank."""
    import torch

    from tests.ranks import full_weights, run_ranks
    from tests.ranks_worker import DELTA_STEPS, step

    engine = FakeEngine(keep="bytes", version=1)
    rx = start_receiver(config_from_dict({}), engine)
    endpoint = rx.endpoint if transport == "zmq" else rx.ipc_endpoint or rx.endpoint
    codes, results, logs = run_ranks(endpoint, "deltas", 2, tmp_path, transport=transport, shard=shard)
    assert codes == [0, 0], logs
    versions = [2, 3, 4, 5, 6, 107, 108]
    assert engine.applied == [2, 3, 4, 5, 6, 102, 107, 108], engine.applied
    for res in results:  # every rank returns the same reports
        assert [(r["version"], r["ok"]) for r in res] == [(v, True) for v in versions], res
        assert [r["delta"]["mode"] for r in res] == ["dense"] + ["delta"] * DELTA_STEPS, res
        assert [bool(r["fallback"][0]) for r in res] == [False] * 5 + [True, False], res
        assert "WrongBase" in res[5]["fallback"][0] and "version 102" in res[5]["fallback"][0], res[5]
        # the deltas the receiver took: about 1% of the dense bytes on the wire
        assert all(r["delta"]["ratio"] < 0.05 for k, r in enumerate(res) if k not in (0, 5)), [r["delta"]["ratio"] for r in res]
    assert results[0][-1]["base_bytes"] > 0 and results[1][-1]["base_bytes"] == 0
    model = full_weights(2)
    for k, version in enumerate(versions):
        if k:
            step(model, k)
        want = model.state_dict()
        got = engine.tensors(version)
        assert set(got) == set(want)
        assert not [n for n in want if not torch.equal(got[n], want[n])], version
    assert engine.manifests[108].shards is None and engine.manifests[108].delta is not None


def test_with_deltas_a_range_whose_bytes_changed_is_named_before_any_engine_hears(start_receiver: Any, tmp_path: Path) -> None:
    """``sync.delta`` on: rank 1 flips a bit of its first range after summing it (memory corrupted between
    the sum and the send). Rank 0 checks every range it assembled against its rank's checksum before the
    update begins: both ranks raise ``RankFailed`` naming rank 1, and the receiver never heard of the version."""
    from tests.ranks import run_ranks

    engine = FakeEngine(keep="bytes", version=1)
    rx = start_receiver(config_from_dict({}), engine)
    codes, results, logs = run_ranks(rx.ipc_endpoint or rx.endpoint, "corrupt+deltas", 2, tmp_path)
    assert codes == [0, 0], logs
    for res in results:
        assert [(r["version"], r["ok"], r["error"]) for r in res] == [(6, False, "RankFailed")], res
        assert "trainer rank 1" in res[0]["message"] and "checksum" in res[0]["message"], res
    assert engine.validated == [] and engine.applied == [] and not engine.manifests
