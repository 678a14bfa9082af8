"""The fast paths accept and refuse exactly what the plain ones do: the checksum named in the manifest
(xxh3, crc32c, crc32, none), the finiteness check on raw bits, one-pass verification, and send planes,
segments and mappings reused across updates."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bridge import wire
from bridge.checksums import function, preferred
from bridge.errors import ChecksumError, NonFiniteError, WireError
from bridge.finite import all_finite
from inference_side.verify import verify_bucket
from tests.fakes import FakeEngine
from tests.helpers import free_port, plan_manifest, wait_until
from trainer_side.packing import make_plan, pack_bucket, plan_specs

FLOATS = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def _finite(t: torch.Tensor) -> bool:
    """The check under test, on the tensor's bytes as they lie in a bucket."""
    data = t.contiguous().view(torch.uint8).numpy()
    return all_finite(memoryview(data), str(t.dtype).removeprefix("torch."), 0, data.nbytes)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: str(d).removeprefix("torch."))
def test_all_finite_agrees_with_isfinite_on_every_bit_pattern(dtype: torch.dtype) -> None:
    """Oracle: torch.isfinite, on every bit pattern of the 8- and 16-bit formats (one at a time) and on
    random, extreme and non-finite values of the wider ones."""
    width = torch.finfo(dtype).bits
    if width <= 16:
        bits = torch.arange(2**width, dtype=torch.int32).to(torch.int16 if width == 16 else torch.uint8)
        values = bits.view(dtype)
        expected = torch.isfinite(values.float())
        assert bool(expected.all()) is False  # every format here has NaN patterns
        finite_values = values[expected]
        assert _finite(finite_values)  # all finite patterns at once
        for i in torch.nonzero(~expected).flatten().tolist():  # each non-finite pattern among finite ones
            probe = finite_values[:4096].clone()
            probe[len(probe) // 2] = values[i]
            assert not _finite(probe), f"pattern {int(bits[i]) & (2**width - 1):#x} of {dtype} not caught"
    else:
        info = torch.finfo(dtype)
        t = torch.cat([torch.randn(5000, dtype=dtype), torch.tensor([info.max, -info.max, info.tiny, -0.0, 0.0], dtype=dtype)])
        assert _finite(t)
        for bad in (float("nan"), float("inf"), float("-inf"), -float("nan")):
            u = t.clone()
            u[4321] = bad
            assert not _finite(u), f"{bad} in {dtype} not caught"


def test_all_finite_reads_only_its_slice_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN just outside the slice is not this tensor's; one in a later chunk is."""
    from bridge import finite

    monkeypatch.setattr(finite, "CHUNK_BYTES", 256)
    t = torch.randn(1000).to(torch.bfloat16)
    t[0] = t[999] = float("nan")
    data = memoryview(t.view(torch.uint8).numpy())
    assert all_finite(data, "bfloat16", 2, 997 * 2)
    t[1 + 7 * 128 - 1] = float("-inf")  # the slice starts at t[1]: the last element of its 7th 128-element chunk
    assert not all_finite(data, "bfloat16", 2, 997 * 2)


@pytest.mark.parametrize("algorithm", ["crc32c", "xxh3"])
def test_fast_checksum_manifest_round_trip_and_verify(algorithm: str) -> None:
    """The algorithm named in the manifest is the one verified; its sums (64-bit for xxh3) survive the wire."""
    import zlib

    named = [("model.layers.0.mlp.weight", torch.randn(64, 32).to(torch.bfloat16)), ("model.norm.weight", torch.ones(32))]
    plan, tensors = make_plan(named, "bfloat16", 1 << 20)
    out = torch.empty(plan.bucket_sizes[0], dtype=torch.uint8)
    sums = pack_bucket(plan, tensors, 0, out, checksum=algorithm)
    manifest = plan_manifest(plan, version=3, checksum=algorithm)
    decoded = wire.decode(wire.encode(wire.Begin(manifest)))
    assert isinstance(decoded, wire.Begin) and decoded.manifest.checksum == algorithm
    header = wire.decode(wire.encode(wire.BucketHeader(version=3, index=0, checksums=tuple(sums))))
    assert isinstance(header, wire.BucketHeader) and list(header.checksums) == sums
    view = memoryview(out.numpy())
    first = plan_specs(plan)[0]
    if algorithm == "xxh3":  # an independent oracle: the xxhash package itself, and a sum wider than 32 bits
        import xxhash

        assert sums[0] == xxhash.xxh3_64(bytes(view[first.offset : first.offset + first.nbytes])).intdigest()
        assert max(sums) > 0xFFFFFFFF
    else:
        assert sums[0] != zlib.crc32(bytes(view[first.offset : first.offset + first.nbytes]))
    verify_bucket(view, list(plan_specs(plan)), tuple(sums), "reject", algorithm)
    with pytest.raises(ChecksumError, match="checksum mismatch"):  # the same sums are wrong under crc32
        verify_bucket(view, list(plan_specs(plan)), tuple(sums), "reject", "crc32")
    out[3] ^= 1
    with pytest.raises(ChecksumError, match="model.layers.0.mlp.weight: checksum mismatch"):
        verify_bucket(view, list(plan_specs(plan)), tuple(sums), "reject", algorithm)


def test_manifest_without_checksum_means_crc32_and_unknown_is_refused() -> None:
    raw = wire.Manifest(version=1, tensors=(), bucket_sizes=()).to_wire()
    del raw["checksum"]
    decoded = wire.decode(wire.encode(wire.Begin(wire.Manifest(version=1, tensors=(), bucket_sizes=()))))
    assert isinstance(decoded, wire.Begin) and decoded.manifest.checksum == "crc32"
    assert wire.Manifest.from_wire(raw).checksum == "crc32"
    raw["checksum"] = "md5"
    with pytest.raises(WireError, match="unknown checksum algorithm 'md5'"):
        wire.Manifest.from_wire(raw)
    with pytest.raises(WireError, match="unknown checksum algorithm 'md5'"):
        function("md5")
    assert preferred() == "xxh3"  # the project installs xxhash: auto picks the fastest


def test_nonfinite_still_rejected_through_verify() -> None:
    t = torch.randn(256).to(torch.bfloat16)
    t[17] = float("nan")
    raw = t.view(torch.uint8).numpy().tobytes()
    spec = wire.TensorSpec("model.norm.weight", "bfloat16", (256,), 0, 0, 512)
    with pytest.raises(NonFiniteError, match="model.norm.weight: holds NaN or Inf"):
        verify_bucket(memoryview(raw), [spec], (function("crc32c")(raw),), "reject", "crc32c")


def test_zmq_plane_reuses_a_slot_only_after_zmq_let_go() -> None:
    import zmq

    from bridge.transports.zmq_plane import ZmqSendPlane

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        plane = ZmqSendPlane()
        plane.configure(1)  # two slots
        first = plane.allocate(0, 1 << 20)
        first.fill_(7)
        plane.sent(0, push.send(plane.seal(0, first).frames[0], copy=False, track=True))
        assert pull.recv(copy=True)[:1] == b"\x07"
        again = plane.allocate(2, 1 << 20)  # same slot, frame delivered: the buffer is reused
        assert again.data_ptr() == first.data_ptr()
        held = plane.allocate(1, 1 << 20)
        stuck = ctx.socket(zmq.PUSH)  # connected to an endpoint nobody binds: ZMQ keeps the frame queued
        stuck.setsockopt(zmq.LINGER, 0)
        stuck.connect(f"tcp://127.0.0.1:{free_port()}")
        plane.sent(1, stuck.send(plane.seal(1, held).frames[0], copy=False, track=True))
        fresh = plane.allocate(3, 1 << 20)  # same slot as bucket 1, still held by ZMQ: a new buffer
        assert fresh.data_ptr() != held.data_ptr()
        stuck.close(0)
        plane.close()
    finally:
        ctx.destroy(linger=0)  # closes every socket, also when an assertion failed


# ---- sync.checksum: none (the raw data plane) ---------------------------------------------------------

def _publish_unchecked(start_receiver: Any, receiver_sync: dict[str, object],
                       weights: list[tuple[str, torch.Tensor]]) -> tuple[FakeEngine, object, list[str]]:
    """Publish ``weights`` without checksums to a receiver with ``receiver_sync``: the engine, the report or
    the UpdateFailed, and the kinds of the receiver's refusals."""
    from bridge.config import config_from_dict
    from bridge.errors import UpdateFailed
    from trainer_side import WeightPublisher

    gate, events = FakeEngine(), []
    rx = start_receiver(config_from_dict({"sync": receiver_sync}), gate, events)
    with WeightPublisher(rx.endpoint, config=config_from_dict({"sync": {"checksum": "none"}}), transport="shm") as pub:
        try:
            result: object = pub.publish(weights, 1)
        except UpdateFailed as exc:
            result = exc
            wait_until(lambda: events, what="the receiver's refused event")  # recorded just after the ack went out
    return gate, result, [d["kind"] for k, d in events if k == "refused"]


def test_unchecked_update_is_refused_by_an_engine_that_verifies(start_receiver: Any) -> None:
    gate, result, refused = _publish_unchecked(start_receiver, {}, [("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))])
    assert refused == ["wire"], (refused, result)
    # what the trainer's people read: which setting on which side
    assert "sync.checksum is none" in str(result) and "sync.verify_checksums: true" in str(result), result
    assert gate.applied == []


def test_unchecked_update_applies_where_checksums_are_off_but_nan_is_still_refused(start_receiver: Any) -> None:
    good = [("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))]
    gate, result, refused = _publish_unchecked(start_receiver, {"verify_checksums": False}, good)
    assert getattr(result, "ok", False), result
    assert gate.applied == [1] and refused == []
    bad = [("model.norm.weight", torch.full((64,), float("nan"), dtype=torch.bfloat16))]
    gate, result, refused = _publish_unchecked(start_receiver, {"verify_checksums": False}, bad)
    assert refused == ["nonfinite"] and "model.norm.weight" in str(result), (refused, result)
    assert gate.applied == []


def test_pack_without_checksums_writes_the_same_bytes() -> None:
    named = [("a.weight", torch.randn(300)), ("b.weight", torch.randn(7, 5))]
    plan, tensors = make_plan(named, "bfloat16", 1 << 20)
    with_sums, without = torch.zeros(plan.bucket_sizes[0], dtype=torch.uint8), torch.zeros(plan.bucket_sizes[0], dtype=torch.uint8)
    sums = pack_bucket(plan, tensors, 0, with_sums, checksum="crc32c")
    zeros = pack_bucket(plan, tensors, 0, without, checksum="none")
    assert torch.equal(with_sums, without)
    assert zeros == [0, 0] and all(sums)


# ---- one pass for checksum and finiteness; publishers' segments mapped once --------------------------

@pytest.mark.parametrize("algorithm", ["crc32", "crc32c", "xxh3"])
def test_running_checksum_equals_the_one_shot_function(algorithm: str) -> None:
    from bridge.checksums import running

    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8).numpy().tobytes()
    for cuts in ((), (1,), (4096, 4097, 65_536), tuple(range(7, 100_003, 9_999))):
        hasher = running(algorithm)()
        for start, end in zip((0, *cuts), (*cuts, len(data)), strict=True):
            hasher.update(memoryview(data)[start:end])
        assert hasher.intdigest() == function(algorithm)(data), (algorithm, cuts)


def _float_bucket(t: torch.Tensor, algorithm: str) -> tuple[memoryview, list[wire.TensorSpec], tuple[int, ...]]:
    raw = t.view(torch.uint8).numpy()
    spec = wire.TensorSpec("model.layers.0.mlp.weight", "bfloat16", tuple(t.shape), 0, 0, raw.nbytes)
    return memoryview(raw), [spec], (function(algorithm)(raw.tobytes()),)


@pytest.mark.parametrize("algorithm", ["crc32", "xxh3"])
def test_one_pass_verify_checks_every_chunk(monkeypatch: pytest.MonkeyPatch, algorithm: str) -> None:
    """Checksum and finiteness read a tensor chunk by chunk in one pass: the whole tensor is summed, a NaN
    in its last chunk is found, and when both are wrong the checksum is what is reported."""
    from bridge import finite

    monkeypatch.setattr(finite, "CHUNK_BYTES", 256)  # 128 bfloat16 per chunk: 1000 elements make 8 chunks
    t = torch.randn(1000).to(torch.bfloat16)
    view, specs, sums = _float_bucket(t, algorithm)
    verify_bucket(view, specs, sums, "reject", algorithm)
    t[999] = float("nan")  # the checksum was taken before: both are wrong now
    with pytest.raises(ChecksumError, match="model.layers.0.mlp.weight: checksum mismatch"):
        verify_bucket(view, specs, sums, "reject", algorithm)
    view, specs, sums = _float_bucket(t, algorithm)  # summed with the NaN in: only finiteness is wrong
    with pytest.raises(NonFiniteError, match="model.layers.0.mlp.weight: holds NaN or Inf"):
        verify_bucket(view, specs, sums, "reject", algorithm)
    verify_bucket(view, specs, sums, "allow", algorithm)


def test_attach_cache_maps_a_segment_once_and_unmaps_it_once_unlinked() -> None:
    from pathlib import Path

    from bridge.shm import AttachCache, Segment

    def mapped(name: str) -> bool:
        return name in Path("/proc/self/maps").read_text()

    owner = Segment.create("test", 1 << 16)
    cache = AttachCache()
    try:
        first = cache.attach(owner.name, 1 << 16)
        first.close()  # what a session does when its update ends: the mapping stays
        owner.buffer[:4] = b"next"  # the publisher writes the next update into the same segment
        again = cache.attach(owner.name, 1 << 16)
        assert again is first and bytes(again.buffer[:4]) == b"next"
        cache.prune()
        assert len(cache) == 1 and mapped(owner.name)  # still linked: kept
        owner.close()  # the publisher closes: unlinked, but our mapping would pin its memory
        assert mapped(owner.name)
        cache.prune()
        assert len(cache) == 0 and not mapped(owner.name)
    finally:
        owner.close()
        cache.close()


def test_private_attach_cache_keeps_a_mapping_until_this_process_writes_into_it() -> None:
    """What a TP worker does with bucket segments: a copy-on-write mapping kept across updates follows the
    file's new bytes; once model code wrote into it (a page copied on write), it is mapped afresh, so the
    next update never reads the page this process changed."""
    from bridge.shm import AttachCache, Segment, copied_pages, pagemap_readable

    if not pagemap_readable():
        pytest.skip("this kernel gives no /proc/self/pagemap: the cache maps afresh every time")
    size = 1 << 20
    owner = Segment.create("test", size)
    cache = AttachCache(private=True)
    try:
        owner.buffer[:] = b"a" * size
        first = cache.attach(owner.name, size)
        assert bytes(first.buffer[:1]) == b"a" and copied_pages(first.mm) == 0
        first.close()
        owner.buffer[: size // 2] = b"b" * (size // 2)  # the next update, written by the receiver
        again = cache.attach(owner.name, size)
        assert again is first and bytes(again.buffer[:1]) == b"b"
        again.buffer[size - 1 : size] = b"x"  # a loader writing into its input: that page is now a private copy
        assert copied_pages(again.mm) == 1
        assert bytes(owner.buffer[size - 1 : size]) == b"a"  # other processes never see it
        owner.buffer[size - 1 : size] = b"c"  # the next update changes that byte
        fresh = cache.attach(owner.name, size)
        assert fresh is not first and bytes(fresh.buffer[size - 1 : size]) == b"c"
        assert copied_pages(fresh.mm) == 0 and len(cache) == 1
    finally:
        owner.close()
        cache.close()


def test_receiver_maps_shm_buckets_once_and_lets_go_when_the_publisher_closes(start_receiver: Any) -> None:
    """Two updates over shm reuse one mapping per bucket; once the publisher closes, the receiver unmaps
    them within about a second, so no segment's memory stays pinned."""
    import time
    from pathlib import Path

    from bridge.config import config_from_dict
    from trainer_side import WeightPublisher

    def ours() -> set[str]:
        return {line.split()[-2].rsplit("/", 1)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if "/dev/shm/wb-bucket-" in line and line.endswith("(deleted)")}

    gate = FakeEngine()
    rx = start_receiver(config_from_dict({}), gate)

    def attached() -> Any:  # the shm transport's receiving end keeps the mappings
        return rx._planes["shm"]._attached

    weights = [(f"model.layers.{i}.mlp.weight", torch.randn(256, 256).to(torch.bfloat16)) for i in range(4)]
    config = config_from_dict({"transport": {"bucket_mb": 0.25}})
    with WeightPublisher(rx.endpoint, config=config, transport="shm") as pub:
        assert pub.publish(weights, 1).ok
        first = dict(attached()._kept)
        assert pub.publish(weights, 2).ok
        assert len(first) == 2 and attached()._kept == first  # the same two mappings, not new ones
        assert all(a is b for a, b in zip(first.values(), attached()._kept.values(), strict=True))
        assert gate.applied == [1, 2]
    deadline = time.monotonic() + 5
    while len(attached()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(attached()) == 0 and not ours()


def test_shm_plane_writes_the_update_after_a_failed_one_into_fresh_segments(start_receiver: Any) -> None:
    """A failed update's segments may still be read by an engine whose apply overran its deadline: the next
    update must not rewrite them. Successful updates keep reusing theirs."""
    from bridge.config import config_from_dict
    from bridge.errors import UpdateFailed
    from trainer_side import WeightPublisher

    gate, events = FakeEngine(), []
    rx = start_receiver(config_from_dict({}), gate, events)
    good = [("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))]
    bad = [("model.norm.weight", torch.full((64,), float("nan"), dtype=torch.bfloat16))]
    with WeightPublisher(rx.endpoint, transport="shm") as pub:
        def names() -> set[str]:
            return {s.name for s in pub._planes["shm"]._all}  # type: ignore[attr-defined]

        assert pub.publish(good, 1).ok
        first = names()
        with pytest.raises(UpdateFailed):
            pub.publish(bad, 2)
        wait_until(lambda: events, what="the receiver's refused event")
        assert [(k, d["kind"]) for k, d in events] == [("refused", "nonfinite")], events
        assert pub.publish(good, 3).ok
        after_failure = names()
        assert pub.publish(good, 4).ok
        assert first and after_failure and not first & after_failure
        assert names() == after_failure and gate.applied == [1, 3, 4]


@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_ready_buckets_reach_the_engine_in_runs_each_once_in_index_order(start_receiver: Any, mode: str) -> None:
    """The receiver hands its engine every bucket that is ready when the apply thread gets to it in one
    ``load_many`` (one RPC to the TP workers behind ``InferenceServer``), at most ``LOAD_RUN_MAX`` at a time:
    staged, the verified update in runs of ``LOAD_RUN_MAX``; streaming, the buckets that land while the engine
    still loads bucket 0 (slowly here) go together after it. Every bucket exactly once, in index order, and the
    engine holds the trainer's bytes."""
    import time

    from bridge.config import BridgeConfig
    from inference_side.contract import LOAD_RUN_MAX
    from trainer_side import WeightPublisher

    def slow_first(manifest: wire.Manifest, bucket: Any) -> None:
        if bucket.index == 0:
            time.sleep(0.5)

    gen = torch.Generator().manual_seed(0)
    weights = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(64, 256, generator=gen).bfloat16() for i in range(20)}
    config = BridgeConfig().replace(transport={"bucket_mb": 0.04, "depth": 16}, sync={"mode": mode})  # a tensor a bucket
    engine = FakeEngine(keep="bytes", on_load=slow_first)
    engine.expect(weights)
    rx = start_receiver(config, engine)
    with WeightPublisher([rx.endpoint], config=config) as publisher:
        report = publisher.publish(weights, version=1)
    assert report.ok and engine.applied == [1], report
    runs = engine.runs[1]
    assert [i for run in runs for i in run] == list(range(20)), runs
    assert max(len(run) for run in runs) <= LOAD_RUN_MAX == 8, runs
    if mode == "staged":
        assert runs == [list(range(0, 8)), list(range(8, 16)), list(range(16, 20))], runs
    else:
        # the 15 buckets in flight land while bucket 0 loads: the next runs take them, LOAD_RUN_MAX at a time
        assert runs[:3] == [[0], list(range(1, 9)), list(range(9, 16))], runs
