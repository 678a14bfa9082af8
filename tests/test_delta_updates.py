"""Delta updates without an engine: the manifest's delta on the wire, the publisher's choice, the receiver's base
check and rebuild, over real sockets and shared memory with a receiver in this process (``FakeEngine`` behind
it). The real engine: tests/test_delta_sync.py."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from bridge import wire
from bridge.config import BridgeConfig
from bridge.delta import BucketDelta, DeltaEntry, DeltaManifest, encode
from bridge.errors import ManifestError, UpdateFailed, WireError, WrongBase
from bridge.report import FailureKind
from tests.fakes import FakeEngine
from tests.helpers import manifest, spec, wait_until


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
    """Deltas on whatever the transport (``auto``, the default, sends none over shm)."""
    return BridgeConfig().replace(transport={"bucket_mb": 0.04}, sync={"delta": True, **sync})


def _raw(tensor: Any) -> bytes:
    import torch

    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# ---- the manifest's delta and the buckets' tables on the wire ------------------------------------------------

def _delta_update(version: int = 5, base: int = 4) -> tuple[wire.Manifest, wire.BucketHeader]:
    """A delta update of two tensors in one bucket: the first as a patch, the second whole."""
    import torch

    old = torch.zeros(32, dtype=torch.bfloat16)
    new = old.clone()
    new[3] = 1.0
    d = encode(old, new, name="model.norm.weight", base_version=base, checksum="crc32")
    tensors = (wire.TensorSpec("model.norm.weight", "bfloat16", (32,), 0, 0, 64),
               wire.TensorSpec("model.layers.0.w", "float32", (4,), 0, 64, 16))
    manifest = wire.Manifest(version=version, tensors=tensors, bucket_sizes=(80,), checksum="crc32",
                             delta=DeltaManifest(base, (d.spec.base_checksum, 11)))
    table = BucketDelta(80, (DeltaEntry(0, d.spec.nbytes, d.spec.result_checksum, d.spec), DeltaEntry(64, 16, 7)))
    return manifest, wire.BucketHeader(version=version, index=0, checksums=(1, 7), delta=table)


def test_delta_update_round_trips() -> None:
    manifest, header = _delta_update()
    decoded = wire.decode(wire.encode(wire.Begin(manifest)))
    assert isinstance(decoded, wire.Begin) and decoded.manifest == manifest
    assert wire.decode(wire.encode(header)) == header
    delta, table = manifest.delta, header.delta
    assert delta is not None and delta.base_version == 4 and table is not None
    assert delta.base_sums(manifest)["model.layers.0.w"] == 11
    assert table.result_sums()[1] == 7 and table.wire_bytes == table.entries[0].nbytes + 16
    table.check(manifest, 0)
    assert wire.decode(wire.encode(wire.Begin(replace(manifest, delta=None)))).manifest.delta is None  # type: ignore[union-attr]
    assert wire.decode(wire.encode(replace(header, delta=None))).delta is None  # type: ignore[union-attr]


@pytest.mark.parametrize(("change", "words"), [
    ("sums", "1 base checksums for 2 tensors"), ("base-not-older", "not older"),
    ("adapter", "adapter update cannot travel as a delta"),
])
def test_inconsistent_delta_manifest_is_refused(change: str, words: str) -> None:
    m, _ = _delta_update()
    d = m.delta
    assert d is not None
    if change == "sums":
        m = replace(m, delta=replace(d, base_checksums=d.base_checksums[:1]))
    elif change == "base-not-older":
        m = replace(m, version=4)
    else:
        m = replace(m, adapter=wire.AdapterSpec("a", {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    with pytest.raises((ManifestError, WireError), match=words):
        wire.decode(wire.encode(wire.Begin(m)))


@pytest.mark.parametrize(("change", "words"), [
    ("entries", "1 entries for 2 tensors"), ("larger-than-full", "exceeds the full bucket's 80"),
    ("overflow", "overflows wire bucket"), ("overlap", "overlaps"), ("dense-size", "sent dense in 8 bytes"),
    ("patch-for-other-tensor", "its patch is for model.other"), ("patch-other-base", "against version 3"),
    ("patch-other-base-sum", "the manifest named"), ("not-a-delta", "the update is not a delta"),
])
def test_inconsistent_bucket_table_is_refused(change: str, words: str) -> None:
    """What the receiver checks on each bucket header of a delta update before landing it (``BucketDelta.check``)."""
    m, header = _delta_update()
    t = header.delta
    assert t is not None
    patch, dense = t.entries
    assert patch.delta is not None
    tables = {
        "entries": replace(t, entries=(patch,)), "larger-than-full": replace(t, size=128),
        "overflow": replace(t, entries=(patch, replace(dense, offset=72))),
        "overlap": replace(t, entries=(patch, replace(dense, offset=0))),
        "dense-size": replace(t, entries=(patch, replace(dense, nbytes=8))),
        "patch-for-other-tensor": replace(t, entries=(replace(patch, delta=replace(patch.delta, name="model.other")), dense)),
        "patch-other-base": replace(t, entries=(replace(patch, delta=replace(patch.delta, base_version=3)), dense)),
        "patch-other-base-sum": replace(t, entries=(replace(patch, delta=replace(patch.delta, base_checksum=patch.delta.base_checksum ^ 1)), dense)),
        "not-a-delta": t,
    }
    if change == "not-a-delta":
        m = replace(m, delta=None)
    decoded = wire.decode(wire.encode(replace(header, delta=tables[change])))
    assert isinstance(decoded, wire.BucketHeader) and decoded.delta is not None
    with pytest.raises((ManifestError, WireError), match=words):
        decoded.delta.check(m, 0)


# ---- the publisher's choice ------------------------------------------------------------------------------------

def _snapshots(old: dict[str, Any], new: dict[str, Any], checksum: str = "crc32") -> tuple[Any, Any, Any, list[Any]]:
    """The base (version 1 of ``old``, packed), and version 2 of ``new``: an empty snapshot, its plan and tensors."""
    from trainer_side.delta_publish import Snapshot
    from trainer_side.packing import make_plan, pack_bucket, plan_specs

    out = []
    for version, weights in ((1, old), (2, new)):
        plan, tensors = make_plan(list(weights.items()), "bfloat16", 1 << 20)
        manifest = wire.Manifest(version=version, tensors=plan_specs(plan), bucket_sizes=plan.bucket_sizes, checksum=checksum)
        out.append((Snapshot.empty(manifest), plan, tensors))
    (base, plan, tensors), new_snap = out[0], out[1]
    for index in range(len(base.buffers)):
        import torch

        base.buffers[index] = torch.empty(base.manifest.bucket_sizes[index], dtype=torch.uint8)
        base.sums[index] = tuple(pack_bucket(plan, tensors, index, base.buffers[index], checksum=checksum))
    return base, *new_snap


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_publisher_encodes_a_small_step_as_a_delta(dtype: str) -> None:
    """Each bucket encoded against the base, which is patched in place into the new version: the same bytes and
    checksums packing the new version gives, a table that checks, under 5% of dense. Trainer tensors in the wire
    dtype are compared straight; float32 ones are packed (cast) first."""
    import numpy as np
    import torch

    from bridge.delta import DeltaTensor, apply_bytes, update_telemetry
    from trainer_side.delta_publish import Buffers, encode_in_place, plan_update
    from trainer_side.packing import pack_bucket

    old = _weights()
    new = {k: v.clone() for k, v in old.items()}
    _step(new, seed=1)
    if dtype == "float32":
        old, new = ({k: v.float() for k, v in w.items()} for w in (old, new))
    base, snap, plan, tensors = _snapshots(old, new)
    assert plan_update(base, snap.manifest, plan, tensors) == ""
    old_buffers = [b.clone() for b in base.buffers]
    tables = []
    for index, size in enumerate(snap.manifest.bucket_sizes):
        expected = torch.empty(size, dtype=torch.uint8)
        expected_sums = tuple(pack_bucket(plan, tensors, index, expected, checksum="crc32"))
        encoded, sums = encode_in_place(base, plan, tensors, index, Buffers())
        assert encoded is not None
        assert torch.equal(base.buffers[index], expected) and sums == expected_sums
        table, items, wire_sums = encoded
        manifest = replace(snap.manifest, delta=DeltaManifest(1, tuple(base.checksums()[t.name] for t in snap.manifest.tensors)))
        table.check(manifest, index)
        assert table.result_sums() == sums and len(wire_sums) == len(items) == len(table.entries)
        for t, entry, (_, data) in zip(snap.manifest.by_bucket()[index], table.entries, items, strict=True):
            out = np.empty(t.nbytes, dtype=np.uint8)  # the receiver's rebuild from the old base gives the new bytes
            held = old_buffers[index].numpy()[t.offset:t.offset + t.nbytes]
            if entry.delta is None:
                out[:] = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
            else:
                apply_bytes(held, DeltaTensor(entry.delta, memoryview(data)), out)
            assert np.array_equal(out, expected.numpy()[t.offset:t.offset + t.nbytes])
        tables.append(table)
    telemetry = update_telemetry(snap.manifest, tables, 1)
    assert telemetry["wire_bytes"] <= 0.05 * snap.manifest.total_bytes
    assert 0.009 <= telemetry["density"] <= 0.011
    assert set(telemetry["groups"]) == {"mlp", "norm"} and telemetry["groups"]["mlp"]["density"] > 0.009


@pytest.mark.parametrize(("case", "words"), [
    ("new-weights", "of the elements changed"), ("other-tensors", "differ from the base version 1"),
    ("no-checksums", "a delta needs the same algorithm"), ("no-base", "no base"),
])
def test_publisher_goes_dense_and_says_why(case: str, words: str) -> None:
    import torch

    from trainer_side.delta_publish import plan_update

    old = _weights()
    new = {k: v.clone() for k, v in old.items()}
    checksum = "crc32"
    if case == "new-weights":
        new = _weights(seed=9)
    elif case == "other-tensors":
        new["model.extra.weight"] = torch.ones(4, dtype=torch.bfloat16)
    elif case == "no-checksums":
        checksum = "none"
    base, snap, plan, tensors = _snapshots(old, new, checksum)
    reason = plan_update(None if case == "no-base" else base, snap.manifest, plan, tensors)
    assert words in reason, reason


def test_the_estimate_reads_any_tensor_shape_and_dtype() -> None:
    """The up-front sample of ``plan_update`` on tensors of one element, 0-d, empty, strided (a transposed
    view) and in float32 cast to the wire's bfloat16 as packing casts it: no change estimated on the same
    weights, every element changed on new ones."""
    import torch

    from trainer_side.delta_publish import plan_update

    def weights(seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        return {"model.layers.0.self_attn.sinks": torch.randn(8, generator=gen),
                "model.layers.0.step": torch.tensor(seed, dtype=torch.int64),
                "model.layers.0.empty": torch.zeros(0),
                "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=gen).t(),
                "model.norm.weight": torch.randn(1, generator=gen)}

    base, snap, plan, tensors = _snapshots(weights(1), weights(1))
    assert plan_update(base, snap.manifest, plan, tensors) == ""
    base, snap, plan, tensors = _snapshots(weights(1), weights(2))
    assert "of the elements changed" in plan_update(base, snap.manifest, plan, tensors)


@pytest.mark.parametrize(("big", "small", "dense"), [(0.40, 1.0, False), (0.55, 0.0, True), (0.0, 1.0, False)],
                         ids=["big-40%-small-all", "big-55%-small-none", "big-none-small-all"])
def test_the_estimate_weighs_each_tensor_by_its_size(big: float, small: float, dense: bool) -> None:
    """A large tensor is sampled on about ``SAMPLE_PER_TENSOR`` elements, a small one on one in
    ``SAMPLE_STRIDE``: the update's changed share is each tensor's share weighted by its size. 4M elements with
    40% changed and 64k all changed are 41% of the update (a delta), though most sampled elements changed."""
    import torch

    from trainer_side.delta_publish import plan_update

    gen = torch.Generator().manual_seed(3)
    old = {"model.embed_tokens.weight": torch.randn(4096, 1024, generator=gen).to(torch.bfloat16),
           "model.norm.weight": torch.randn(65536, generator=gen).to(torch.bfloat16)}
    new = {k: v.clone() for k, v in old.items()}
    for name, share in (("model.embed_tokens.weight", big), ("model.norm.weight", small)):
        flat = new[name].view(-1)
        hit = torch.rand(flat.numel(), generator=gen) < share
        flat[hit] = (flat[hit].float() * 2 + 1).to(torch.bfloat16)  # every hit element's bits change
    base, snap, plan, tensors = _snapshots(old, new)
    reason = plan_update(base, snap.manifest, plan, tensors)
    assert ("of the elements changed" in reason) == dense, reason


@pytest.mark.parametrize("case", ["new-weights", "not-paying"])
def test_a_bucket_goes_whole_when_its_patches_do_not_pay(case: str) -> None:
    """The estimate said delta, but this bucket changed more than it said: it goes whole (``encode_in_place``
    gives no table) and the base's buffer then holds the new version's bytes, as packing writes them."""
    import torch

    from trainer_side.delta_publish import Buffers, encode_in_place
    from trainer_side.packing import pack_bucket

    old = _weights()
    new = _weights(seed=9) if case == "new-weights" else {k: v.clone() for k, v in old.items()}
    if case == "not-paying":
        _step(new, seed=1, density=0.3)
    base, snap, plan, tensors = _snapshots(old, new)
    expected = torch.empty(snap.manifest.bucket_sizes[0], dtype=torch.uint8)
    expected_sums = tuple(pack_bucket(plan, tensors, 0, expected, checksum="crc32"))
    kept = base.buffers[0].clone()
    encoded, sums = encode_in_place(base, plan, tensors, 0, Buffers(), max_ratio=0.01 if case == "not-paying" else 0.5)
    assert encoded is None and sums == expected_sums and torch.equal(base.buffers[0], expected)
    base.buffers[0] = kept
    encoded, sums = encode_in_place(base, plan, tensors, 0, Buffers(), max_ratio=1.0, max_changed=1.0)
    assert encoded is not None and torch.equal(base.buffers[0], expected)


def test_buffers_hand_out_the_smallest_free_buffer_that_fits() -> None:
    """Several free buffers of different sizes (a model's buckets are not all the same size): ``take`` gives the
    smallest that fits, cut to size, and a fresh one when none fits."""
    import torch

    from trainer_side.delta_publish import Buffers

    small, big, mid = (torch.zeros(n, dtype=torch.uint8) for n in (64, 256, 128))
    pool = Buffers([small, big, mid])
    got = pool.take(100)
    assert got.numel() == 100 and got.data_ptr() == mid.data_ptr()
    got = pool.take(64)
    assert got.data_ptr() == small.data_ptr()
    assert pool.take(300).data_ptr() not in (small.data_ptr(), big.data_ptr(), mid.data_ptr())
    assert [b.numel() for b in pool.free] == [256]


# ---- the receiver's base ------------------------------------------------------------------------------------

def test_base_store_refuses_what_it_does_not_hold() -> None:
    from inference_side.delta_base import BaseStore

    manifest, _ = _delta_update(version=5, base=4)
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
    store.sums["model.layers.0.w"] = 11
    store.sums["model.norm.weight"] = manifest.delta.base_sums(manifest)["model.norm.weight"] ^ 1
    with pytest.raises(WrongBase, match="tensor model.norm.weight: wrong base"):
        store.check(manifest)
    store.sums["model.norm.weight"] ^= 1
    store.check(manifest)
    store.algorithm = "xxh3"
    with pytest.raises(WrongBase, match="under xxh3"):
        store.check(manifest)


def test_base_store_takes_each_bucket_in_place_and_is_in_flux_until_commit() -> None:
    """``take`` copies a staged tensor over its held base of the same size (the same array: no new pages) and
    leaves the store without a version until ``commit``; a tensor of another size gets a new array."""
    import os

    import numpy as np

    from bridge.shm import Segment
    from inference_side.contract import StagedBucket
    from inference_side.delta_base import BaseStore

    a, b = spec("model.a", "float32", (4,), offset=0), spec("model.b", "float32", (2,), offset=64)
    m = manifest([a, b], [128], version=2)
    seg = Segment(f"wb-test-take-{os.getpid()}", 128, create=True)
    try:
        view = np.frombuffer(seg.buffer, dtype=np.uint8)
        view[:] = np.arange(128, dtype=np.uint8)
        store = BaseStore()
        held_a = np.zeros(16, dtype=np.uint8)
        store.tensors, store.sums, store.version, store.algorithm = {"model.a": held_a, "model.b": np.zeros(4, np.uint8)}, {}, 1, "crc32"
        kept = store.take(StagedBucket(0, seg, [a, b], (7, 8)))
        assert kept["model.a"][0] is held_a and bytes(held_a) == bytes(range(16)), "same size: copied in place"
        assert kept["model.b"][0] is not store.tensors["model.b"] and bytes(kept["model.b"][0]) == bytes(range(64, 72))
        assert store.version == 0, "in flux until the update is committed"
        store.commit(replace(m, checksum="crc32"), kept)
        assert store.version == 2 and store.sums == {"model.a": 7, "model.b": 8}
    finally:
        seg.close()


def _store_with_version(tensors: dict[str, Any], version: int) -> tuple[Any, wire.Manifest, list[Any], Any]:
    """A base store that adopted ``tensors`` (bf16, two buckets) as applied ``version``: store, manifest,
    the tensors' specs, and the receive pool."""
    import numpy as np

    from bridge.shm import SegmentPool
    from inference_side.contract import StagedBucket
    from inference_side.delta_base import BaseStore
    from trainer_side.packing import make_plan, pack_bucket, plan_specs

    plan, ts = make_plan(list(tensors.items()), "bfloat16", 1 << 14)
    assert len(plan.bucket_sizes) >= 2
    m = wire.Manifest(version=version, tensors=plan_specs(plan), bucket_sizes=plan.bucket_sizes, checksum="xxh3")
    pool = SegmentPool("test-store")
    pool.trim(1 << 30)
    buckets = []
    for index, size in enumerate(m.bucket_sizes):
        import torch

        seg = pool.take(size)
        packed = torch.empty(size, dtype=torch.uint8)
        sums = tuple(pack_bucket(plan, ts, index, packed, checksum="xxh3"))
        np.frombuffer(seg.buffer, dtype=np.uint8)[:] = packed.numpy()
        buckets.append(StagedBucket(index, seg, list(m.by_bucket()[index]), sums))
    store = BaseStore("engine-x")
    assert store.adopt(m, buckets, b"pub", pool) == set(range(len(buckets))), "receive segments taken over, not copied"
    return store, m, buckets, pool


def _patches(store: Any, m: wire.Manifest, new: dict[str, Any], version: int) -> tuple[wire.Manifest, list[Any]]:
    """The delta of ``new`` against what ``store`` holds: its manifest and, per bucket, (table, wire bucket)."""
    import numpy as np

    from bridge.delta import encode_bytes
    from bridge.shm import Segment
    from inference_side.contract import StagedBucket

    dm = replace(m, version=version, delta=DeltaManifest(m.version, tuple(store.sums[t.name] for t in m.tensors)))
    out = []
    for index in range(len(m.bucket_sizes)):
        entries, payloads, offset = [], [], 0
        for spec_ in m.by_bucket()[index]:
            old = store.tensors[spec_.name]
            d = encode_bytes(old, np.frombuffer(_raw(new[spec_.name]), dtype=np.uint8), name=spec_.name, dtype=spec_.dtype,
                             shape=spec_.shape, base_version=m.version, checksum="xxh3", base_checksum=store.sums[spec_.name])
            entries.append(DeltaEntry(offset, d.spec.nbytes, d.spec.result_checksum, d.spec))
            payloads.append((offset, bytes(d.payload)))
            offset = (offset + d.spec.nbytes + wire.ALIGN - 1) // wire.ALIGN * wire.ALIGN
        table = BucketDelta(max(offset, wire.ALIGN), tuple(entries))
        seg = Segment.create("test-wire", table.size)
        view = np.frombuffer(seg.buffer, dtype=np.uint8)
        for at, data in payloads:
            view[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
        out.append((table, StagedBucket(index, seg, table.wire_specs(dm, index), ())))
    return dm, out


def test_base_store_copies_streamed_buckets_over_its_own_and_is_in_flux_until_adopted() -> None:
    """Streaming: ``copy`` writes a staged bucket over the store's held bucket of that index (the same segment: no
    new pages) and leaves the store without a version until ``adopt``, which keeps those buckets as the base to
    patch; not in place (asked so, or while another update patches the store), a copy goes into a pool segment,
    which ``adopt`` takes over."""
    import numpy as np

    from inference_side.contract import StagedBucket

    store, m, buckets, pool = _store_with_version(_weights(), 1)
    incoming: list[Any] = []
    try:
        held = dict(store.segments)
        m2 = replace(m, version=2)
        for b in buckets:
            seg = pool.take(m.bucket_sizes[b.index])
            np.frombuffer(seg.buffer, dtype=np.uint8)[:] = np.frombuffer(b.segment.buffer, dtype=np.uint8)[::-1]
            incoming.append(StagedBucket(b.index, seg, b.specs, b.checksums))
        first = store.copy(m2, incoming[0], pool)
        assert first.segment is held[0] and store.holds(first.segment), "copied over the held bucket"
        assert bytes(first.segment.buffer[:m.bucket_sizes[0]]) == bytes(incoming[0].segment.buffer[:m.bucket_sizes[0]])
        assert store.version == 0, "in flux until the update is adopted"
        second = store.copy(m2, incoming[1], pool, in_place=False)
        assert second.segment is not held[1] and not store.holds(second.segment), "a pool segment"
        copies = [first, second] + [store.copy(m2, b, pool) for b in incoming[2:]]
        store.adopt(m2, copies, b"pub", pool)
        assert store.version == 2 and store.segments[0] is held[0] and store.segments[1] is second.segment
        assert store.can_patch(replace(m2, version=3), b"other"), "the next delta is patched in place"
        store.patching = b"other"
        stray = store.copy(replace(m2, version=3), incoming[0], pool).segment
        assert not store.holds(stray), "not over the held buckets while another update patches them"
        stray.close()
    finally:
        store.clear()
        for b in buckets + incoming:
            b.segment.close()
        pool.close()


def test_base_store_patches_its_own_buckets_and_a_failed_delta_leaves_the_base_bit_identical() -> None:
    """Staged mode: the store adopts the applied buckets (no copy); a delta is patched in place into them, and
    the engine loads those very segments. A delta whose second bucket is corrupt is refused (CorruptPatch)
    and, rolled back, leaves every byte of the base as it was; the next delta then applies and is adopted."""
    import numpy as np
    import torch

    from bridge.errors import CorruptPatch, NonFiniteError

    v1 = {f"model.layers.{i}.mlp.down_proj.weight": (0.02 * torch.randn(64, 96, generator=torch.Generator().manual_seed(i))).bfloat16()
          for i in range(3)}
    store, m, buckets, pool = _store_with_version(v1, 1)
    try:
        held = {name: bytes(t) for name, t in store.tensors.items()}
        assert held == {k: _raw(v) for k, v in v1.items()} and store.version == 1
        v2 = {k: v.clone() for k, v in v1.items()}
        _step(v2, seed=2)
        dm, parts = _patches(store, m, v2, 2)
        assert store.can_patch(dm, b"pub")
        (table0, wire0), (table1, wire1) = parts[0], parts[1]
        first = store.patch(dm, table0, 0, wire0, b"pub", "reject")
        assert first.segment is buckets[0].segment, "patched in the held segment itself"
        assert store.can_patch(dm, b"pub") and not store.can_patch(dm, b"other")
        with pytest.raises(WrongBase, match="applying another delta"):
            store.check(dm)  # another publisher's delta waits for this one to end
        broken = np.frombuffer(wire1.segment.buffer, dtype=np.uint8)
        broken[table1.entries[0].offset] ^= 0x10  # a flipped byte in the second bucket's first patch
        with pytest.raises(CorruptPatch):
            store.patch(dm, table1, 1, wire1, b"pub", "reject")
        store.rollback()
        assert {name: bytes(t) for name, t in store.tensors.items()} == held, "the base, bit for bit"
        assert store.version == 1 and store.patching is None
        broken[table1.entries[0].offset] ^= 0x10
        staged = [store.patch(dm, table, i, w, b"pub", "reject") for i, (table, w) in enumerate(parts)]
        assert store.adopt(dm, staged, b"pub", pool) == set(range(len(staged)))
        assert store.version == 2 and {name: bytes(t) for name, t in store.tensors.items()} == {k: _raw(v) for k, v in v2.items()}
        assert [b.segment for b in staged] == [b.segment for b in buckets]
        for _, w in parts:
            w.segment.close()
        # under nonfinite: reject a NaN written by a patch is refused (only the written values are checked)
        v3 = {k: v.clone() for k, v in v2.items()}
        first_name = m.by_bucket()[0][0].name
        v3[first_name].view(-1)[5] = float("nan")
        dm3, parts3 = _patches(store, dm, v3, 3)
        assert parts3[0][0].entries[0].delta is not None and parts3[0][0].entries[0].delta.encoding == "sparse"
        with pytest.raises(NonFiniteError, match=first_name):
            store.patch(dm3, parts3[0][0], 0, parts3[0][1], b"pub", "reject")
        store.rollback()
        assert {name: bytes(t) for name, t in store.tensors.items()} == {k: _raw(v) for k, v in v2.items()}
        for _, w in parts3:
            w.segment.close()
    finally:
        store.clear()
        pool.close()


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


def test_patches_to_engines_on_this_host_go_uncompressed_unless_asked(start_receiver: Any) -> None:
    """``sync.delta_compress: auto`` (the default): a publisher whose engines are all on its host (here a loopback
    ``tcp://`` receiver) sends its patches uncompressed (codec ``none``, 6 bytes per changed bf16 element); ``true``
    compresses them with zstd, fewer bytes on the wire. The engine's bytes are the trainer's either way."""
    from trainer_side import WeightPublisher

    sent: dict[Any, list[Any]] = {}
    for setting in ("auto", True):
        engine = FakeEngine(keep="bytes")
        rx = start_receiver(_config(), engine)
        assert rx.endpoint.startswith("tcp://127.0.0.1:"), rx.endpoint
        weights = _weights()
        with WeightPublisher([rx.endpoint], config=_config(delta_compress=setting)) as publisher:
            for version in range(1, 4):
                _step(weights, seed=version)
                report = publisher.publish(weights, version=version)
                assert {k: bytes(v) for k, v in engine.received[version].items()} == {k: _raw(v) for k, v in weights.items()}
                if version > 1:
                    assert report.delta["mode"] == "delta", report.delta
                    sent.setdefault(setting, []).append((report.delta["compressed"], report.delta["wire_bytes"]))
    changed = sum(max(1, int(0.01 * t.numel())) for t in _weights().values() if t.numel() > 256)  # _step's flips
    assert [c for c, _ in sent["auto"]] == [False, False] and [c for c, _ in sent[True]] == [True, True], sent
    assert all(w >= changed * 6 for _, w in sent["auto"]), (sent, changed)
    assert all(packed < plain for (_, packed), (_, plain) in zip(sent[True], sent["auto"], strict=True)), sent


@pytest.mark.parametrize(("publisher", "receiver", "transport", "deltas", "kept"), [
    ("auto", "auto", "shm", False, (False, False)),  # one host: dense, no base on either side
    ("auto", "auto", "zmq", True, (True, True)),
    (True, "auto", "shm", True, (True, True)),  # the publisher keeps its base (Manifest.keep_base): so does the receiver
    ("auto", True, "shm", False, (False, True)),  # true: every update kept
    (False, "auto", "zmq", False, (False, False)),
], ids=["auto-auto-shm", "auto-auto-zmq", "true-auto-shm", "auto-true-shm", "false-auto-zmq"])
def test_sync_delta_auto_sends_deltas_and_keeps_bases_only_off_shm(start_receiver: Any, publisher: Any, receiver: Any,
                                                                    transport: str, deltas: bool,
                                                                    kept: tuple[bool, bool]) -> None:
    """``sync.delta: auto`` (the default): a publisher sends deltas over every transport but shm and marks the
    versions it keeps as its base (``Manifest.keep_base``); a receiver keeps those, and every delta, as its base,
    and nothing of a publisher that sends no deltas. Four versions, every engine's bytes the trainer's."""
    from trainer_side import WeightPublisher

    def config(delta: Any) -> BridgeConfig:
        return BridgeConfig().replace(transport={"bucket_mb": 0.04}, sync={"delta": delta})

    engine = FakeEngine(keep="bytes")
    rx = start_receiver(config(receiver), engine)
    weights = _weights()
    with WeightPublisher([rx.endpoint], config=config(publisher), transport=transport) as pub:
        modes = []
        for version in range(1, 5):
            _step(weights, seed=version)
            report = pub.publish(weights, version=version)
            assert report.ok and not report.engines[0].dense_fallback, report
            modes.append(report.delta.get("mode", "dense"))
            assert {k: bytes(v) for k, v in engine.received[version].items()} == {k: _raw(v) for k, v in weights.items()}
        assert modes == ["dense", *(["delta"] * 3 if deltas else ["dense"] * 3)], modes
        dense = sum(t.numel() * 2 for t in weights.values())
        assert pub.base_bytes == (dense if kept[0] else 0)
    assert (rx.bases.nbytes if rx.bases is not None else 0) == (dense if kept[1] else 0)


def test_with_auto_a_dense_update_that_leaves_no_base_frees_the_receivers_store(start_receiver: Any) -> None:
    """A receiver (``auto``) keeps a zmq publisher's versions as its base; a version from a publisher that sends
    no deltas (``auto`` over shm) replaces what the engine serves, so the store lets its version go; the zmq
    publisher's next version is refused as a delta (no base) and comes dense, and is kept again."""
    from trainer_side import WeightPublisher

    config = BridgeConfig().replace(transport={"bucket_mb": 0.04})
    assert config.sync.delta == "auto"
    rx = start_receiver(config, FakeEngine(keep="bytes"))
    weights = _weights()
    dense = sum(t.numel() * 2 for t in weights.values())
    with WeightPublisher([rx.endpoint], config=config, transport="zmq") as remote:
        remote.publish(weights, version=1)
        _step(weights, seed=1)
        assert remote.publish(weights, version=2).delta["mode"] == "delta"
        assert rx.bases is not None and rx.bases.nbytes == dense
        with WeightPublisher([rx.endpoint], config=config, transport="shm") as local:
            _step(weights, seed=2)
            assert local.publish(weights, version=3).delta == {}
        assert rx.bases.nbytes == 0
        _step(weights, seed=3)
        report = remote.publish(weights, version=4)
        assert report.ok and report.engines[0].dense_fallback, report  # no base here: resent dense
        assert rx.bases.version == 4 and rx.bases.nbytes == dense


def test_restarted_receiver_refuses_the_delta_and_gets_it_dense() -> None:
    from inference_side.receiver import SyncReceiver
    from tests.helpers import free_port
    from trainer_side import WeightPublisher

    port = free_port()  # the restarted receiver binds it again
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
    """The engine refuses a staged delta after the receiver patched it into its base's own buckets: the publisher
    drops its base (the next update goes dense), the receiver's base is put back bit for bit (still the last
    applied version), and the deltas after the dense one apply."""
    from bridge.report import ApplyResult
    from trainer_side import WeightPublisher

    refuse = {3}
    engine = FakeEngine(keep="bytes", on_finish=lambda m: ApplyResult(False, "no", FailureKind.OTHER) if m.version in refuse else None)
    rx = start_receiver(_config(), engine)
    weights = _weights()
    with WeightPublisher([rx.endpoint], config=_config()) as publisher:
        publisher.publish(weights, version=1)
        _step(weights, seed=1)
        publisher.publish(weights, version=2)
        served = {k: _raw(v) for k, v in weights.items()}
        assert rx.bases is not None and rx.bases.segments, "staged: the store holds the applied buckets"
        _step(weights, seed=2)
        with pytest.raises(UpdateFailed):
            publisher.publish(weights, version=3)
        assert publisher.bases is None
        wait_until(lambda: rx.bases is not None and rx.bases.patching is None, 5, "the failed update's end")
        assert rx.bases.version == 2 and {k: bytes(v) for k, v in rx.bases.tensors.items()} == served
        _step(weights, seed=3)
        report = publisher.publish(weights, version=4)
        assert report.delta["mode"] == "dense" and "no base" in report.delta["why"]
        _step(weights, seed=4)
        assert publisher.publish(weights, version=5).delta["mode"] == "delta"
    assert {k: bytes(v) for k, v in engine.received[5].items()} == {k: _raw(v) for k, v in weights.items()}
    assert rx.bases.version == 5 and {k: bytes(v) for k, v in rx.bases.tensors.items()} == {k: _raw(v) for k, v in weights.items()}


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


def test_deltas_over_gloo_rebuild_bit_identical_and_a_wrong_base_gets_dense(start_receiver: Any) -> None:
    """The collective plane carries wire buckets like any bucket: two receivers over one real gloo link take
    four deltas in a row bit-identical; then one whose recorded base differs refuses the next delta before any
    payload (kind ``base``) and is resent that version dense over gloo, while the other takes the delta."""
    from trainer_side import WeightPublisher

    config = _config().replace(deadlines={"connect_s": 20, "bucket_s": 20})
    engines = [FakeEngine(keep="bytes", transports=("zmq", "gloo")) for _ in range(2)]
    events: list[tuple[str, dict[str, Any]]] = []
    rxs = [start_receiver(config, engines[0], events), start_receiver(config, engines[1])]
    weights = _weights()
    with WeightPublisher([rx.endpoint for rx in rxs], config=config, transport="gloo") as publisher:
        for version in range(1, 6):
            _step(weights, seed=version)
            report = publisher.publish(weights, version=version)
            assert report.ok and report.delta["mode"] == ("dense" if version == 1 else "delta"), report.delta
            assert not report.delta.get("dense_fallback") and report.delta.get("dense_buckets", 0) == 0, report.delta
            for engine in engines:
                assert {k: bytes(v) for k, v in engine.received[version].items()} == {k: _raw(v) for k, v in weights.items()}
        assert all(m.transport == "gloo" for m in engines[0].manifests.values())
        store = rxs[0].bases
        assert store is not None
        store.sums["model.norm.weight"] ^= 1  # what this engine recorded as served is not the publisher's base
        _step(weights, seed=6)
        report = publisher.publish(weights, version=6)
    first, second = report.engines
    assert report.ok and report.delta["mode"] == "delta", report
    assert "tensor model.norm.weight: wrong base" in first.dense_fallback and not second.dense_fallback, report.engines
    assert report.delta["dense_fallback"] == {rxs[0].endpoint: first.dense_fallback}
    assert [d["kind"] for e, d in events if e == "refused"] == [FailureKind.BASE.value]
    for engine in engines:
        assert {k: bytes(v) for k, v in engine.received[6].items()} == {k: _raw(v) for k, v in weights.items()}


@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_records_carry_wire_bytes_and_density_per_group(start_receiver: Any, mode: str) -> None:
    """The publisher's report and the engine's SyncRecord agree on the bytes on the wire, dense bytes and density,
    overall and per tensor group (here mlp at 1% and norm untouched); a dense sync's groups carry their full
    bytes and density 0."""
    from inference_side.ledger import Ledger, RecordingGate
    from trainer_side import WeightPublisher

    engine = FakeEngine(keep="bytes")
    ledger = Ledger("engine-g")
    rx = start_receiver(_config(mode=mode), RecordingGate(engine, ledger, streaming=mode == "streaming"))
    weights = _weights()
    norm = "model.norm.weight"
    with WeightPublisher([rx.endpoint], config=_config()) as publisher:
        dense = publisher.publish(weights, version=1)
        for name, tensor in weights.items():
            if name != norm:
                _step({name: tensor}, seed=2)
        report = publisher.publish(weights, version=2)
    first, second = ledger.records()
    assert first.delta_base == 0 and first.groups == dense.delta["groups"]
    assert first.groups["mlp"] == {"wire_bytes": 3 * 64 * 256 * 2, "dense_bytes": 3 * 64 * 256 * 2, "density": 0.0}
    assert second.delta_base == 1 and report.delta["mode"] == "delta"
    assert (second.wire_bytes, second.dense_bytes, second.density) == (report.delta["wire_bytes"], report.delta["dense_bytes"], report.delta["density"])
    assert second.groups == report.delta["groups"] and set(second.groups) == {"mlp", "norm"}
    assert 0.009 <= second.groups["mlp"]["density"] <= 0.011 and second.groups["norm"]["density"] == 0.0
    assert second.groups["norm"]["wire_bytes"] == 0 and second.groups["mlp"]["wire_bytes"] < 0.05 * second.groups["mlp"]["dense_bytes"]


def test_a_delta_publish_is_pipelined_bucket_by_bucket(start_receiver: Any) -> None:
    """When the engine loads bucket 0 of a delta (streaming), the publisher has packed only the buckets the
    engine's credits let it send, not the whole version: each bucket is packed, encoded and sent in turn.
    Packing reads each tensor through ``detach`` (trainer_side.packing.materialize), last: a tensor counts as
    packed once its last ``detach`` of the publish is done."""
    import torch

    from trainer_side import WeightPublisher

    detached: dict[str, list[float]] = {}

    class Counted(torch.Tensor):
        def detach(self) -> Any:  # type: ignore[override]
            detached.setdefault(self.label, []).append(time.monotonic())  # type: ignore[attr-defined]
            return torch.Tensor.detach(self).as_subclass(torch.Tensor)

    def counted(weights: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, tensor in weights.items():
            out[name] = tensor.as_subclass(Counted)
            out[name].label = name
        return out

    first_load: list[float] = []

    def on_load(manifest: wire.Manifest, bucket: Any) -> None:
        if manifest.version == 2 and bucket.index == 0:
            time.sleep(0.3)  # the publisher meanwhile packs what its credits allow, and no more
            first_load.append(time.monotonic())

    gen = torch.Generator().manual_seed(0)
    weights = {f"model.layers.{i}.mlp.down_proj.weight": (0.02 * torch.randn(64, 256, generator=gen)).bfloat16() for i in range(12)}
    rx = start_receiver(_config(mode="streaming"), FakeEngine(keep="bytes", on_load=on_load))
    with WeightPublisher([rx.endpoint], config=_config()) as publisher:  # one tensor per bucket, depth 2
        publisher.publish(weights, version=1)
        _step(weights, seed=1)
        detached.clear()
        report = publisher.publish(counted(weights), version=2)
    assert report.ok and report.delta["mode"] == "delta" and report.delta["dense_buckets"] == 0, report.delta
    assert len(detached) == 12 and first_load, detached
    packed_before = sum(1 for times in detached.values() if times[-1] < first_load[0])
    assert packed_before <= 4, f"{packed_before} of 12 buckets were packed before the engine loaded bucket 0"
    assert rx.gate.received[2].keys() == weights.keys()


# ---- a staged delta loaded as each bucket is verified, rolled back through the engine ---------------------------

@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_a_delta_loads_as_verified_and_a_late_failure_restores_the_served_version(start_receiver: Any, mode: str) -> None:
    """Into an engine that ``restores``, a delta patched in the receiver's base store opens at Begin and each
    bucket is loaded once verified, before the update's End (staged dense updates still load after it). When
    such an update fails after buckets were loaded (a NaN in its last bucket; the engine refusing at finish), the
    engine is handed the served version back, bit for bit (the store rolled back), and the receiver still holds
    that version; the updates after it apply. In streaming mode too: the store keeps the dense update's buckets
    (copied as they were staged), which the deltas are patched into."""
    from bridge.report import ApplyResult
    from trainer_side import WeightPublisher

    seen: dict[int, list[bool]] = {}  # version -> for each load: had every bucket of the update arrived yet?
    rx: Any = None

    def on_load(m: wire.Manifest, bucket: Any) -> None:
        seen.setdefault(m.version, []).append(all(s["staged"] == s["buckets"] for s in rx.summary()))

    engine = FakeEngine(keep="bytes", restores=True, on_load=on_load,
                        on_finish=lambda m: ApplyResult(False, "no", FailureKind.OTHER) if m.version == 6 else None)
    # one bucket in flight: bucket i + 1 is sent after bucket i was staged and its load handed to the apply thread
    rx = start_receiver(BridgeConfig().replace(transport={"bucket_mb": 0.04, "depth": 1}, sync={"mode": mode}), engine)
    weights = _weights()
    with WeightPublisher([rx.endpoint], config=_config()) as publisher:
        publisher.publish(weights, version=1)
        assert mode == "streaming" or all(seen[1]), "a dense staged update loads once every bucket arrived"
        wait_until(lambda: rx.bases.version == 1, 5, "the receiver keeping version 1")
        assert len(rx.bases.segments) == len(engine.manifests[1].bucket_sizes), "the store holds buckets to patch"
        for version in (2, 3):
            _step(weights, seed=version)
            assert publisher.publish(weights, version=version).delta["mode"] == "delta"
            assert {k: bytes(v) for k, v in engine.received[version].items()} == {k: _raw(v) for k, v in weights.items()}
        buckets = len(engine.manifests[3].bucket_sizes)
        assert buckets >= 3 and len(seen[3]) == buckets
        assert not all(seen[2] + seen[3]), "some bucket of a delta was loaded before the last one arrived"
        served = {k: _raw(v) for k, v in weights.items()}
        last = list(weights)[-1]
        _step(weights, seed=4)
        weights[last].view(-1)[3] = float("nan")  # refused by the receiver when its bucket lands
        with pytest.raises(UpdateFailed, match="NaN"):
            publisher.publish(weights, version=4)
        wait_until(lambda: engine.restored, 5, "the engine's restore")
        assert engine.restored[-1] == (4, served), "the engine got the served version back, every tensor"
        assert engine.aborted and engine.aborted[-1][0] == 4
        weights[last].view(-1)[3] = 0.0
        assert publisher.publish(weights, version=5).delta["mode"] == "dense"  # the publisher dropped its base
        served = {k: _raw(v) for k, v in weights.items()}
        _step(weights, seed=6)
        with pytest.raises(UpdateFailed, match="no"):  # a delta the engine refuses at finish, every bucket loaded
            publisher.publish(weights, version=6)
        assert engine.restored[-1] == (6, served) and len(engine.restored) == 2
        wait_until(lambda: rx.bases.patching is None, 5, "the failed update's end")
        assert rx.bases.version == 5 and {k: bytes(v) for k, v in rx.bases.tensors.items()} == served
        publisher.publish(weights, version=7)
        _step(weights, seed=8)
        assert publisher.publish(weights, version=8).delta["mode"] == "delta"
    assert {k: bytes(v) for k, v in engine.received[8].items()} == {k: _raw(v) for k, v in weights.items()}
    assert engine.violations == []


def test_with_early_load_off_a_staged_delta_loads_after_its_last_bucket(start_receiver: Any) -> None:
    """``sync.delta_early_load: false``: a staged delta goes to the engine once every bucket arrived, as a dense
    update does, and ``begin`` gets no restore."""
    from trainer_side import WeightPublisher

    seen: list[bool] = []
    rx: Any = None
    engine = FakeEngine(keep="bytes", restores=True,
                        on_load=lambda m, b: seen.append(all(s["staged"] == s["buckets"] for s in rx.summary())))
    rx = start_receiver(_config(delta_early_load=False), engine)
    weights = _weights()
    with WeightPublisher([rx.endpoint], config=_config()) as publisher:
        for version in (1, 2, 3):
            _step(weights, seed=version)
            assert publisher.publish(weights, version=version).delta["mode"] == ("dense" if version == 1 else "delta")
    assert len(seen) >= 9 and all(seen), "every bucket loaded after the last one arrived"
    assert {k: bytes(v) for k, v in engine.received[3].items()} == {k: _raw(v) for k, v in weights.items()}


def test_no_delta_is_patched_into_the_base_while_the_engine_restores_from_it(start_receiver: Any) -> None:
    """While an engine reloads the served version from the receiver's base store (a failed delta loaded as it
    arrived), another publisher's delta on that base is refused (kind ``base``, resent dense) instead of being
    patched into the very buckets the engine is reading."""
    import threading

    from bridge.report import ApplyResult
    from trainer_side import WeightPublisher

    engine = FakeEngine(keep="bytes", restores=True, restore_delay_s=1.0,
                        on_finish=lambda m: ApplyResult(False, "no", FailureKind.OTHER) if m.version == 3 else None)
    rx = start_receiver(_config(), engine)
    ours = _weights()
    with WeightPublisher([rx.endpoint], config=_config()) as a, WeightPublisher([rx.endpoint], config=_config()) as b:
        a.publish(ours, version=1)
        _step(ours, seed=2)
        assert a.publish(ours, version=2).delta["mode"] == "delta"
        served = {k: _raw(v) for k, v in ours.items()}
        theirs = {k: v.clone() for k, v in ours.items()}
        b.publish(theirs, version=2)  # the served version: a checked no-op, which B keeps as its base
        assert b.bases is not None and b.bases.manifest.version == 2
        _step(ours, seed=3)
        failed: list[BaseException] = []
        first = threading.Thread(target=lambda: failed.append(pytest.raises(UpdateFailed, a.publish, ours, version=3).value))
        first.start()
        wait_until(lambda: engine.restoring, 10, "the engine restoring the served version")
        _step(theirs, seed=4)
        report = b.publish(theirs, version=4)  # a delta against version 2, while version 2 is being restored
        first.join(30)
    assert failed and engine.restored == [(3, served)], "the restore read the served version, untouched"
    why = report.engines[0].dense_fallback
    assert report.ok and "applying a delta as it arrives" in why, why
    assert {k: bytes(v) for k, v in engine.received[4].items()} == {k: _raw(v) for k, v in theirs.items()}
