"""Delta updates without an engine: the manifest's delta on the wire, the publisher's choice, the receiver's base
check and rebuild, over real sockets and shared memory with a receiver in this process (``FakeEngine`` behind
it). The real engine: tests/test_delta_sync.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from bridge import wire
from bridge.config import BridgeConfig
from bridge.delta import DeltaEntry, DeltaManifest, encode
from bridge.errors import ManifestError, UpdateFailed, WireError, WrongBase
from bridge.report import FailureKind
from tests.fakes import FakeEngine
from tests.helpers import wait_until


def _weights(seed: int = 0) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {f"model.layers.{i}.mlp.down_proj.weight": (0.02 * torch.randn(64, 256, generator=gen)).bfloat16() for i in range(3)}
    out["model.norm.weight"] = torch.ones(256, dtype=torch.bfloat16)
    return out


def _step(weights: dict[str, Any], seed: int, density: float = 0.01) -> None:
    """Flip the lowest mantissa bit of ``density`` of each tensor's elements."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for tensor in weights.values():
        bits = tensor.view(torch.int16).view(-1)
        picked = torch.randperm(bits.numel(), generator=gen)[: max(1, int(density * bits.numel()))]
        bits[picked] ^= 1


def _config(**sync: Any) -> BridgeConfig:
    return BridgeConfig().replace(transport={"bucket_mb": 0.04}, sync=sync)


def _raw(tensor: Any) -> bytes:
    import torch

    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# ---- the manifest's delta on the wire -------------------------------------------------------------------------

def _delta_manifest(version: int = 5, base: int = 4) -> wire.Manifest:
    import torch

    old = torch.zeros(32, dtype=torch.bfloat16)
    new = old.clone()
    new[3] = 1.0
    d = encode(old, new, name="model.norm.weight", base_version=base, checksum="crc32")
    tensors = (wire.TensorSpec("model.norm.weight", "bfloat16", (32,), 0, 0, 64),
               wire.TensorSpec("model.layers.0.w", "float32", (4,), 0, 64, 16))
    entries = (DeltaEntry(0, d.spec.nbytes, d.spec.result_checksum, d.spec), DeltaEntry(64, 16, 7))
    return wire.Manifest(version=version, tensors=tensors, bucket_sizes=(128,), checksum="crc32",
                         delta=DeltaManifest(base, (128,), entries))


def test_manifest_with_delta_round_trips() -> None:
    manifest = _delta_manifest()
    decoded = wire.decode(wire.encode(wire.Begin(manifest)))
    assert isinstance(decoded, wire.Begin) and decoded.manifest == manifest
    delta = manifest.delta
    assert delta is not None and delta.base_version == 4
    assert set(delta.base_checksums) == {"model.norm.weight"}
    assert delta.result_sums(manifest)["model.layers.0.w"] == 7
    assert wire.decode(wire.encode(wire.Begin(replace(manifest, delta=None)))).manifest.delta is None  # type: ignore[union-attr]


def _broken(change: str) -> wire.Manifest:
    m = _delta_manifest()
    d = m.delta
    assert d is not None
    patch, dense = d.entries
    if change == "entries":
        return replace(m, delta=replace(d, entries=(patch,)))
    if change == "buckets":
        return replace(m, delta=replace(d, bucket_sizes=(128, 64)))
    if change == "base-not-older":
        return replace(m, version=4)
    if change == "overflow":
        return replace(m, delta=replace(d, entries=(patch, replace(dense, offset=120))))
    if change == "overlap":
        return replace(m, delta=replace(d, entries=(patch, replace(dense, offset=0))))
    if change == "dense-size":
        return replace(m, delta=replace(d, entries=(patch, replace(dense, nbytes=8))))
    if change == "patch-for-other-tensor":
        assert patch.delta is not None
        return replace(m, delta=replace(d, entries=(replace(patch, delta=replace(patch.delta, name="model.other")), dense)))
    if change == "patch-other-base":
        assert patch.delta is not None
        return replace(m, delta=replace(d, entries=(replace(patch, delta=replace(patch.delta, base_version=3)), dense)))
    if change == "adapter":
        return replace(m, adapter=wire.AdapterSpec("a", {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    raise AssertionError(change)


@pytest.mark.parametrize(("change", "words"), [
    ("entries", "1 entries for 2 tensors"), ("buckets", "2 buckets"), ("base-not-older", "not older"),
    ("overflow", "overflows wire bucket"), ("overlap", "overlaps"), ("dense-size", "sent dense in 8 bytes"),
    ("patch-for-other-tensor", "its patch is for model.other"), ("patch-other-base", "against version 3"),
    ("adapter", "adapter update cannot travel as a delta"),
])
def test_inconsistent_delta_manifest_is_refused(change: str, words: str) -> None:
    with pytest.raises((ManifestError, WireError), match=words):
        wire.decode(wire.encode(wire.Begin(_broken(change))))


# ---- the publisher's choice ------------------------------------------------------------------------------------

def _snapshots(old: dict[str, Any], new: dict[str, Any], checksum: str = "crc32") -> tuple[Any, Any]:
    from trainer_side.delta_publish import snapshot
    from trainer_side.packing import make_plan, plan_specs

    out = []
    for version, weights in ((1, old), (2, new)):
        plan, tensors = make_plan(list(weights.items()), "bfloat16", 1 << 20)
        manifest = wire.Manifest(version=version, tensors=plan_specs(plan), bucket_sizes=plan.bucket_sizes, checksum=checksum)
        out.append(snapshot(manifest, plan, tensors))
    return out[0], out[1]


def test_publisher_encodes_a_small_step_as_a_delta() -> None:
    from trainer_side.delta_publish import Encoded
    from trainer_side.delta_publish import encode as encode_update

    old = _weights()
    new = {k: v.clone() for k, v in old.items()}
    _step(new, seed=1)
    base, snap = _snapshots(old, new)
    encoded = encode_update(base, snap)
    assert isinstance(encoded, Encoded)
    assert encoded.summary["mode"] == "delta" and encoded.summary["base_version"] == 1
    assert encoded.delta.wire_bytes <= 0.05 * snap.manifest.total_bytes
    assert 0.009 <= encoded.summary["density"] <= 0.011
    encoded.delta.check(replace(snap.manifest, delta=encoded.delta))
    assert encoded.delta.result_sums(snap.manifest) == snap.checksums()


@pytest.mark.parametrize(("case", "words"), [
    ("new-weights", "of the elements changed"), ("other-tensors", "differ from the base version 1"),
    ("no-checksums", "a delta needs the same algorithm"), ("not-paying", "of dense (above"),
])
def test_publisher_goes_dense_and_says_why(case: str, words: str) -> None:
    import torch

    from trainer_side.delta_publish import encode as encode_update

    old = _weights()
    new = {k: v.clone() for k, v in old.items()}
    checksum, max_ratio = "crc32", 0.5
    if case == "new-weights":
        new = _weights(seed=9)
    elif case == "other-tensors":
        new["model.extra.weight"] = torch.ones(4, dtype=torch.bfloat16)
    elif case == "no-checksums":
        checksum = "none"
    else:
        _step(new, seed=1, density=0.3)
        max_ratio = 0.01
    base, snap = _snapshots(old, new, checksum)
    reason = encode_update(base, snap, max_ratio=max_ratio)
    assert isinstance(reason, str) and words in reason, reason


# ---- the receiver's base ------------------------------------------------------------------------------------

def test_base_store_refuses_what_it_does_not_hold() -> None:
    from inference_side.delta_base import BaseStore

    manifest = _delta_manifest(version=5, base=4)
    store = BaseStore("engine-x")
    with pytest.raises(WrongBase, match=r"engine-x holds no base .*\(restarted or cold-loaded\)"):
        store.check(manifest)
    store.version, store.algorithm = 3, "crc32"
    with pytest.raises(WrongBase, match="last applied version 3, the delta of version 5 applies to version 4"):
        store.check(manifest)
    store.version = 4
    with pytest.raises(WrongBase, match="model.norm.weight: engine-x holds no base for it"):
        store.check(manifest)
    assert manifest.delta is not None
    store.sums["model.norm.weight"] = manifest.delta.base_checksums["model.norm.weight"] ^ 1
    with pytest.raises(WrongBase, match="tensor model.norm.weight: wrong base"):
        store.check(manifest)
    store.sums["model.norm.weight"] ^= 1
    store.check(manifest)
    store.algorithm = "xxh3"
    with pytest.raises(WrongBase, match="under xxh3"):
        store.check(manifest)


# ---- end to end with a receiver in this process -----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["staged", "streaming"])
@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_deltas_rebuild_the_trainers_bytes(start_receiver: Any, transport: str, mode: str) -> None:
    from trainer_side import WeightPublisher

    engine = FakeEngine(keep="bytes")
    rx = start_receiver(_config(mode=mode), engine)
    weights = _weights()
    with WeightPublisher([rx.endpoint], config=_config(), transport=transport) as publisher:
        for version in range(1, 6):
            _step(weights, seed=version)
            report = publisher.publish(weights, version=version)
            assert report.delta["mode"] == ("dense" if version == 1 else "delta"), report.delta
            assert {k: bytes(v) for k, v in engine.received[version].items()} == {k: _raw(v) for k, v in weights.items()}
        assert publisher.base_bytes == sum(t.numel() * 2 for t in weights.values())
    assert rx.bases is not None and rx.bases.version == 5 and rx.bases.nbytes == publisher.base_bytes


def test_restarted_receiver_refuses_the_delta_and_gets_it_dense() -> None:
    from inference_side.receiver import SyncReceiver
    from trainer_side import WeightPublisher

    port = 18311
    first = SyncReceiver(FakeEngine(keep="bytes"), _config(), port=port)
    endpoint = first.start()
    events: list[tuple[str, dict[str, Any]]] = []
    weights = _weights()
    restarted = None
    try:
        with WeightPublisher([endpoint], config=_config()) as publisher:
            publisher.publish(weights, version=1)
            _step(weights, seed=1)
            assert publisher.publish(weights, version=2).delta["mode"] == "delta"
            first.stop()
            # the engine restarted on the same endpoint, cold-loaded from version 2: its receiver holds no base
            restarted = SyncReceiver(FakeEngine(keep="bytes", version=2), _config(), port=port,
                                     on_event=lambda k, d: events.append((k, d)))
            restarted.start()
            _step(weights, seed=2)
            report = publisher.publish(weights, version=3)
        (engine_report,) = report.engines
        assert report.ok and report.delta["mode"] == "delta", report
        assert "holds no base" in engine_report.dense_fallback and "restarted" in engine_report.dense_fallback
        assert [d["kind"] for e, d in events if e == "refused"] == [FailureKind.BASE.value]
        got = restarted.gate.received[3]  # type: ignore[attr-defined]
        assert {k: bytes(v) for k, v in got.items()} == {k: _raw(v) for k, v in weights.items()}
    finally:
        first.stop()
        if restarted is not None:
            restarted.stop()


def test_receiver_without_deltas_refuses_them_and_gets_dense(start_receiver: Any) -> None:
    from trainer_side import WeightPublisher

    events: list[tuple[str, dict[str, Any]]] = []
    engine = FakeEngine(keep="bytes")
    rx = start_receiver(_config(delta=False), engine, events)
    assert rx.bases is None
    weights = _weights()
    with WeightPublisher([rx.endpoint], config=_config()) as publisher:
        publisher.publish(weights, version=1)
        _step(weights, seed=1)
        report = publisher.publish(weights, version=2)
    assert report.delta["mode"] == "delta" and "keeps no base for delta updates" in report.engines[0].dense_fallback
    assert {k: bytes(v) for k, v in engine.received[2].items()} == {k: _raw(v) for k, v in weights.items()}
    wait_until(lambda: any(e == "refused" for e, _ in events), 5, "the refusal event")


def test_publisher_with_deltas_off_sends_dense_and_keeps_nothing(start_receiver: Any) -> None:
    from trainer_side import WeightPublisher

    rx = start_receiver(_config(), FakeEngine())
    weights = _weights()
    with WeightPublisher([rx.endpoint], config=_config(delta=False)) as publisher:
        for version in (1, 2):
            _step(weights, seed=version)
            assert publisher.publish(weights, version=version).delta == {}
        assert publisher.base_bytes == 0


def test_a_failed_delta_drops_the_base(start_receiver: Any) -> None:
    from bridge.report import ApplyResult
    from trainer_side import WeightPublisher

    refuse = {3}
    engine = FakeEngine(on_finish=lambda m: ApplyResult(False, "no", FailureKind.OTHER) if m.version in refuse else None)
    rx = start_receiver(_config(), engine)
    weights = _weights()
    with WeightPublisher([rx.endpoint], config=_config()) as publisher:
        publisher.publish(weights, version=1)
        _step(weights, seed=1)
        publisher.publish(weights, version=2)
        _step(weights, seed=2)
        with pytest.raises(UpdateFailed):
            publisher.publish(weights, version=3)
        assert publisher.bases is None
        _step(weights, seed=3)
        report = publisher.publish(weights, version=4)
    assert report.delta["mode"] == "dense" and "no base" in report.delta["why"]


def test_the_same_version_again_is_a_checked_noop(start_receiver: Any) -> None:
    """With bases kept, publishing the served version again goes dense and the engine's no-op is checked against
    the full tensors' checksums: equal weights pass, other weights are a conflict."""
    from trainer_side import WeightPublisher

    rx = start_receiver(_config(), FakeEngine(keep="bytes", noop_same_version=True))
    weights = _weights()
    with WeightPublisher([rx.endpoint], config=_config()) as publisher:
        publisher.publish(weights, version=1)
        _step(weights, seed=1)
        assert publisher.publish(weights, version=2).delta["mode"] == "delta"
        again = publisher.publish(weights, version=2)
        assert again.engines[0].noop and again.engines[0].engine.get("content_checked") is True
        assert "not newer than the base version 2" in again.delta["why"]
        _step(weights, seed=2)
        with pytest.raises(UpdateFailed) as info:
            publisher.publish(weights, version=2)
    assert set(info.value.kinds.values()) == {FailureKind.CONFLICT}


def test_a_relay_rebuilds_once_and_forwards_dense(start_receiver: Any) -> None:
    """A relay holds the base for its host: it refuses nothing, rebuilds the patched tensors into its staging and
    hands its engines full tensors over shared memory (the engines' receivers see a dense update)."""
    from inference_side.relay import Relay
    from trainer_side import WeightPublisher

    gates = [FakeEngine(keep="bytes"), FakeEngine(keep="bytes")]
    events: list[tuple[str, dict[str, Any]]] = []
    receivers = [start_receiver(_config(), g, events) for g in gates]
    relay = Relay([r.endpoint for r in receivers], _config(), name="relay-delta")
    try:
        weights = _weights()
        with WeightPublisher(relay.endpoint(), config=_config()) as publisher:
            for version in range(1, 4):
                _step(weights, seed=version)
                report = publisher.publish(weights, version=version)
                assert report.ok and report.delta["mode"] == ("dense" if version == 1 else "delta"), report.delta
                assert not report.delta.get("dense_fallback"), report.delta
                for gate in gates:
                    assert {k: bytes(v) for k, v in gate.received[version].items()} == {k: _raw(v) for k, v in weights.items()}
        assert events == []
        assert all(r.bases is not None and r.bases.version == 3 for r in receivers)  # the engines could take deltas too
    finally:
        relay.shutdown()
