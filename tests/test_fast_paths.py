"""Issue 4 speed-ups that must not change what is accepted: crc32c named in the manifest, the fast
finiteness check, and send planes that reuse their buffers across updates."""

from __future__ import annotations

import pytest
import torch

from bridge import wire
from bridge.checksums import function, preferred
from bridge.errors import ChecksumError, NonFiniteError, WireError
from inference_side.receiver import all_finite, verify_bucket
from trainer_side.packing import make_plan, pack_bucket, plan_specs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_is_exact(dtype: torch.dtype) -> None:
    t = torch.randn(4096).to(dtype)
    assert all_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[1234] = bad
        assert not all_finite(u), f"{bad} in {dtype} not caught"
    both = t.clone()
    both[0], both[1] = float("inf"), float("-inf")  # sums to NaN, still caught
    assert not all_finite(both)
    huge = torch.full((64,), torch.finfo(dtype).max, dtype=dtype)  # the sum overflows; every element is finite
    assert all_finite(huge)


def test_crc32c_manifest_round_trip_and_verify() -> None:
    named = [("model.layers.0.mlp.weight", torch.randn(64, 32).to(torch.bfloat16)), ("model.norm.weight", torch.ones(32))]
    plan, tensors = make_plan(named, "bfloat16", 1 << 20)
    out = torch.empty(plan.bucket_sizes[0], dtype=torch.uint8)
    sums = pack_bucket(plan, tensors, 0, out, checksum="crc32c")
    manifest = wire.Manifest(version=3, tensors=plan_specs(plan), bucket_sizes=plan.bucket_sizes, checksum="crc32c")
    decoded = wire.decode(wire.encode(wire.Begin(manifest)))
    assert isinstance(decoded, wire.Begin) and decoded.manifest.checksum == "crc32c"
    view = memoryview(out.numpy())
    verify_bucket(view, list(plan_specs(plan)), tuple(sums), "reject", "crc32c")
    with pytest.raises(ChecksumError, match="checksum mismatch"):  # the same sums are wrong under crc32
        verify_bucket(view, list(plan_specs(plan)), tuple(sums), "reject", "crc32")
    out[3] ^= 1
    with pytest.raises(ChecksumError, match="model.layers.0.mlp.weight: checksum mismatch"):
        verify_bucket(view, list(plan_specs(plan)), tuple(sums), "reject", "crc32c")


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
    assert preferred() in ("crc32", "crc32c")


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
        stuck.connect(f"tcp://127.0.0.1:{_free_port()}")
        plane.sent(1, stuck.send(plane.seal(1, held).frames[0], copy=False, track=True))
        fresh = plane.allocate(3, 1 << 20)  # same slot as bucket 1, still held by ZMQ: a new buffer
        assert fresh.data_ptr() != held.data_ptr()
        stuck.close(0)
        plane.close()
    finally:
        ctx.destroy(linger=0)  # closes every socket, also when an assertion failed


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- sync.checksum: none (the raw data plane) ---------------------------------------------------------

class _Gate:
    def __init__(self) -> None:
        self.applied: list[int] = []

    def info(self) -> wire.EngineInfo:
        return wire.EngineInfo(dtype="bfloat16", version=0, tp_size=1, transports=("zmq", "shm"), host="test")

    def validate(self, manifest: wire.Manifest) -> None:
        return None

    def apply(self, manifest: wire.Manifest, buckets: list[object], timings: dict[str, float]) -> object:
        from inference_side.receiver import ApplyResult

        self.applied.append(manifest.version)
        return ApplyResult(True)


def _publish_unchecked(receiver_sync: dict[str, object], weights: list[tuple[str, torch.Tensor]]) -> tuple[_Gate, object]:
    from bridge.config import config_from_dict
    from bridge.errors import UpdateFailed
    from inference_side.receiver import SyncReceiver
    from trainer_side import WeightPublisher

    gate = _Gate()
    rx = SyncReceiver(gate, config_from_dict({"sync": receiver_sync}))
    rx.start()
    try:
        with WeightPublisher(rx.endpoint, config=config_from_dict({"sync": {"checksum": "none"}}), transport="shm") as pub:
            try:
                return gate, pub.publish(weights, 1)
            except UpdateFailed as exc:
                return gate, exc
    finally:
        rx.stop()


def test_unchecked_update_is_refused_by_an_engine_that_verifies() -> None:
    gate, result = _publish_unchecked({}, [("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))])
    assert "publisher sends no checksums" in str(result) and "sync.verify_checksums: true" in str(result), result
    assert gate.applied == []


def test_unchecked_update_applies_where_checksums_are_off_but_nan_is_still_refused() -> None:
    good = [("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))]
    gate, result = _publish_unchecked({"verify_checksums": False}, good)
    assert getattr(result, "ok", False), result
    assert gate.applied == [1]
    bad = [("model.norm.weight", torch.full((64,), float("nan"), dtype=torch.bfloat16))]
    gate, result = _publish_unchecked({"verify_checksums": False}, bad)
    assert "tensor model.norm.weight: holds NaN or Inf" in str(result), result
    assert gate.applied == []


def test_pack_without_checksums_writes_the_same_bytes() -> None:
    named = [("a.weight", torch.randn(300)), ("b.weight", torch.randn(7, 5))]
    plan, tensors = make_plan(named, "bfloat16", 1 << 20)
    with_sums, without = torch.zeros(plan.bucket_sizes[0], dtype=torch.uint8), torch.zeros(plan.bucket_sizes[0], dtype=torch.uint8)
    sums = pack_bucket(plan, tensors, 0, with_sums, checksum="crc32c")
    zeros = pack_bucket(plan, tensors, 0, without, checksum="none")
    assert torch.equal(with_sums, without)
    assert zeros == [0, 0] and all(sums)
