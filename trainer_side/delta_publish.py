"""Delta updates on the publisher's side: the bases it keeps, the patches it encodes bucket by bucket, the dense
resend to engines that refuse them (docs/delta.md).

One publish with deltas on (``sync.delta: true``):

1. **Up front**, before ``Begin``: the update goes as a delta when a base is kept (the last version every
   engine applied) with the same tensors in the same layout and checksum algorithm, older than this version,
   and at most ``DELTA_MAX_CHANGED`` of the elements changed, estimated on one element in ``SAMPLE_STRIDE``
   read from the trainer's tensors (cast to the wire dtype) and the base (``plan_update``). The manifest then
   names the base version and each tensor's base checksum, which the engines check at ``Begin``.
2. **Bucket by bucket**, while the previous one is on the wire (``encode_in_place``): each trainer tensor of
   bucket *i* is compared with its base (``bridge.delta.changed_positions``: the changed elements and the new
   checksum in one read of each, on one thread) and encoded from those positions
   (``bridge.delta.encode_bytes``, the checksums passed, not rehashed); it sends its patch when that is
   smaller than its bytes. The base's bucket is then **patched in place** (the changed elements written), so
   it holds the new version without a copy of the model (tensors not CPU, contiguous and in the wire dtype
   are packed into a scratch buffer first and compared from there). The wire bucket (each payload 64-byte
   aligned, its table of patches in the header) is copied into the plane's buffer. A bucket whose patches
   would not be at most ``DELTA_MAX_RATIO`` of its bytes (or more than ``DELTA_MAX_CHANGED`` of whose
   elements changed: the estimate was wrong) is copied whole into the base's buffer and goes whole, straight
   from there where the plane can send it without a copy (``SendPlane.borrow``: ZMQ, gloo).
3. An engine that does not serve the base refuses the delta with kind ``base`` before any payload, and is
   then sent the same version dense from the packed bytes (``EngineReport.dense_fallback`` names why).
4. Once every engine applied the version, its packed bytes are the next base; a failure anywhere drops the
   base (the next publish goes dense to all).

A dense publish while deltas are on (no base, or the estimate says dense) packs into host memory that
becomes the next base (reusing the old base's buffers) and sends it from there: no copy over the plain
dense path with ZMQ and gloo, one copy into the segment with shm.

Memory: **one model of host RAM in the wire dtype** (``Manifest.total_bytes``; ``base_bytes``), during a
publish too, since bucket *i* of the base becomes bucket *i* of the new version in place, plus the buckets in
flight (the plane's buffers, as for a dense update) and one bucket's worth of encoded patches (and of scratch,
where tensors need packing first). On a GPU
trainer the bases are in host memory already: packing copies each tensor to the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from bridge import checksums, wire
from bridge.config import BridgeConfig
from bridge.curve import on_this_host
from bridge.delta import (
    ZSTD_LEVEL,
    BucketDelta,
    DeltaEntry,
    DeltaManifest,
    changed_positions,
    encode_bytes,
    update_telemetry,
    warm_compiled,
)
from bridge.report import FailureKind
from bridge.sender import PublishReport, UpdateSender
from bridge.transports.base import OutgoingBucket, SendPlane
from trainer_side.packing import PackPlan, dtype_name, materialize, pack_bucket

if TYPE_CHECKING:
    import numpy as np

# a bucket goes as patches only when its bytes on the wire are at most this share of its dense bytes: a delta
# that saves less is not worth the encode and the rebuild
DELTA_MAX_RATIO = 0.5
# above this share of changed elements (over the whole update, and then per bucket) nothing is encoded: a new
# model, or random weights; checked on a sample before spending the compression
DELTA_MAX_CHANGED = 0.5
# elements compared for that check: one in 1021 (prime: no alignment with rows of a power of 2; sparse enough to
# touch one cache line in 32 of a bf16 tensor, where one in 61 read every other line, about a full pass), and at
# most about SAMPLE_PER_TENSOR of a large tensor (its share weighted by its size: a 50% verdict needs no more, and
# the sample runs before Begin, on every sync; 350m: 13-24 ms -> 6-7 ms); each bucket then counts its changed elements
# exactly
SAMPLE_STRIDE = 1021
SAMPLE_PER_TENSOR = 256


@dataclass
class Snapshot:
    """One version packed in host memory: per full bucket of ``manifest`` its bytes (a uint8 CPU torch tensor;
    None: not packed, or given up) and its tensors' checksums in manifest order."""

    manifest: wire.Manifest
    buffers: list[Any]
    sums: list[tuple[int, ...]]

    @classmethod
    def empty(cls, manifest: wire.Manifest) -> Snapshot:
        n = len(manifest.bucket_sizes)
        return cls(manifest, [None] * n, [()] * n)

    @property
    def complete(self) -> bool:
        return all(b is not None for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel()) for b in self.buffers if b is not None)

    def tensor(self, spec: wire.TensorSpec) -> np.ndarray:
        return self.buffers[spec.bucket].numpy()[spec.offset:spec.offset + spec.nbytes]

    def checksums(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for specs, sums in zip(self.manifest.by_bucket(), self.sums, strict=True):
            out.update(zip((s.name for s in specs), sums, strict=False))
        return out


class Buffers:
    """Host buffers to pack buckets into: fresh, or handed back (a base bucket no longer needed). ``take``
    returns the smallest free one that fits, cut to size, so a publish reuses warm pages."""

    def __init__(self, free: list[Any] | None = None) -> None:
        self.free = [b for b in (free or []) if b is not None]

    def take(self, size: int) -> Any:
        import torch

        fits = [i for i, b in enumerate(self.free) if b.numel() >= size]
        if not fits:
            return torch.empty(size, dtype=torch.uint8)
        # by position: list.remove would compare tensors with ==, element by element
        best = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        return best[:size]

    def give(self, buffer: Any) -> None:
        if buffer is not None:
            self.free.append(buffer)


def plan_update(base: Snapshot | None, manifest: wire.Manifest, plan: PackPlan, tensors: list[Any],
                max_changed: float = DELTA_MAX_CHANGED) -> str:
    """Decided before ``Begin``: "" when ``manifest`` goes as a delta against ``base``, else why it goes dense
    (no base, not newer, another layout or checksum algorithm, or too many elements changed: estimated on
    every ``SAMPLE_STRIDE``-th element of each tensor, or fewer, about ``SAMPLE_PER_TENSOR`` of a large one,
    each tensor's changed share weighted by its size; cast to its wire dtype as packing casts it, against the
    base's bytes; a DTensor is left out of the sample, as gathering it twice would cost a collective)."""
    import torch

    if base is None:
        return "no base: the first update of this publisher, or the last one failed on an engine"
    bm = base.manifest
    if bm.version >= manifest.version:
        return f"version {manifest.version} is not newer than the base version {bm.version} (the engines answer it as served)"
    if manifest.checksum in ("", "none") or manifest.checksum != bm.checksum:
        return f"checksums {manifest.checksum} (the base's: {bm.checksum}): a delta needs the same algorithm on both"
    if bm.tensors != manifest.tensors or bm.bucket_sizes != manifest.bucket_sizes or not base.complete:
        return f"the tensors (names, dtypes, shapes, layout) differ from the base version {bm.version}'s"
    numel, changed = 0, 0.0
    for spec, tensor in zip(manifest.tensors, tensors, strict=True):  # plan_specs keeps the plan's order
        if hasattr(tensor, "full_tensor") or spec.nbytes == 0:
            continue
        width = wire.DTYPE_SIZES[spec.dtype]
        stride = max(SAMPLE_STRIDE, spec.numel // SAMPLE_PER_TENSOR)
        strided = tensor.detach().reshape(-1)[::stride]
        sample = torch.empty(strided.numel(), dtype=getattr(torch, spec.dtype))  # stride 1, on the host
        sample.copy_(strided)  # cast as packing casts
        new_bits = sample.view(torch.uint8).numpy().view(f"<u{width}")
        old_bits = base.tensor(spec).view(f"<u{width}")[::stride]
        changed += int((old_bits != new_bits).sum()) * spec.numel / old_bits.size
        numel += spec.numel
    if numel and changed > max_changed * numel:
        return f"about {changed / numel:.1%} of the elements changed since version {bm.version} (above {max_changed:.0%}: dense)"
    return ""


def _align(n: int) -> int:
    return (n + wire.ALIGN - 1) // wire.ALIGN * wire.ALIGN


def _raw(tensor: Any, dtype: str) -> np.ndarray | None:
    """The bytes of a trainer's tensor as they go on the wire (flat uint8, a view), or None when it needs packing
    first (another dtype: a cast; strided; not on the CPU; a DTensor)."""
    import torch

    src = materialize(tensor)
    if src.device.type != "cpu" or dtype_name(src.dtype) != dtype or not src.is_contiguous():
        return None
    try:
        raw: np.ndarray = src.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError, ValueError):
        return None
    return raw


def encode_in_place(base: Snapshot, plan: PackPlan, tensors: list[Any], index: int, buffers: Buffers,
                    max_ratio: float = DELTA_MAX_RATIO, max_changed: float = DELTA_MAX_CHANGED,
                    encode: bool = True, level: int | None = ZSTD_LEVEL) -> tuple[tuple[BucketDelta, list[tuple[int, Any]], tuple[int, ...]] | None, tuple[int, ...]]:
    """Full bucket ``index`` of the trainer's ``tensors`` (layout ``plan``, that of ``base``) encoded against
    ``base``'s bucket, which is **patched in place** into the new version's bytes: the changed elements written
    during the compare itself. Returns (its table, its payloads (offset, bytes)
    and their checksums; None when it goes whole: more than ``max_changed`` of its elements changed, the
    patches above ``max_ratio`` of its bytes, or ``encode`` false) and the new tensors' checksums. Patches are
    compressed with zstd at ``level`` where that makes them smaller; None leaves them uncompressed.

    One read of the base and of the trainer's tensors (``changed_positions``: the compare and the new checksum
    in one pass) where the tensors are CPU, contiguous and in the wire dtype; others are
    packed first into a buffer from ``buffers`` (cast as packing casts) and compared from there. A tensor sends
    its patch when that is smaller than its bytes, else its bytes."""
    manifest = base.manifest
    algorithm = manifest.checksum
    buffer = base.buffers[index]
    if not encode:  # whole: the new version straight into the base's buffer
        return None, tuple(pack_bucket(plan, tensors, index, buffer, checksum=algorithm))
    held = buffer.numpy()
    members = plan.bucket_members(index)
    specs = manifest.by_bucket()[index]
    raws = [_raw(tensors[i], plan.dtypes[i]) for i in members]
    scratch, packed = None, None
    if any(r is None for r in raws):
        scratch = buffers.take(int(buffer.numel()))
        packed = pack_bucket(plan, tensors, index, scratch, checksum=algorithm)
        news = [scratch.numpy()[s.offset:s.offset + s.nbytes] for s in specs]
    else:
        news = [r for r in raws if r is not None]
    olds = [held[s.offset:s.offset + s.nbytes] for s in specs]
    found: list[tuple[np.ndarray, np.ndarray]] = []
    sums: list[int] = []
    numel = changed = 0
    for k, (spec, old, new) in enumerate(zip(specs, olds, news, strict=True)):
        assert spec.name == plan.names[members[k]]
        width = wire.DTYPE_SIZES[spec.dtype]
        # the base is patched into the new version in the same pass: it ends as the new version either way
        positions, values, total = changed_positions(old, new, width, None if packed is not None else algorithm, patch=True)
        found.append((positions, values))
        if packed is not None:
            sums.append(packed[k])
        else:
            assert total is not None
            sums.append(total)
        numel += spec.nbytes // width
        changed += int(positions.size)
    result = None
    if not numel or changed <= max_changed * numel:
        fn = checksums.function(algorithm)
        entries, items, wire_sums = [], [], []
        offset = dense = 0
        for spec, old, new, (positions, values), base_sum, new_sum in zip(specs, olds, news, found, base.sums[index], sums,
                                                                            strict=True):
            d = encode_bytes(old, new, name=spec.name, dtype=spec.dtype, shape=spec.shape, base_version=manifest.version,
                             checksum=algorithm, base_checksum=base_sum, result_checksum=new_sum, positions=positions,
                             values=values, level=level)
            data: Any
            if d.spec.nbytes < spec.nbytes:
                entry, data, data_sum = DeltaEntry(offset, d.spec.nbytes, new_sum, d.spec), d.payload, fn(d.payload)
            else:  # its bytes: the base's (patched into them already)
                entry, data, data_sum = DeltaEntry(offset, spec.nbytes, new_sum), old, new_sum
            entries.append(entry)
            items.append((offset, data))
            wire_sums.append(data_sum)
            dense += spec.nbytes
            offset = _align(offset + entry.nbytes)
        if not dense or sum(e.nbytes for e in entries) <= max_ratio * dense:
            size = min(max(offset, wire.ALIGN), manifest.bucket_sizes[index])
            result = BucketDelta(size, tuple(entries)), items, tuple(wire_sums)
    if scratch is not None:
        buffers.give(scratch)
    return result, tuple(sums)


class DeltaSender(UpdateSender):
    """An ``UpdateSender`` that keeps its bases and sends deltas when they pay (``sync.delta``); the
    trainer's ``WeightPublisher`` is one."""

    def __init__(self, endpoints: list[str] | str, config: BridgeConfig | str | None = None, **kwargs: Any) -> None:
        super().__init__(endpoints, config, **kwargs)
        self.bases: Snapshot | None = None  # the last version every engine applied (sync.delta: true)
        # whether each engine is reached on this host (sync.delta_compress), resolved once, not per publish
        self._on_this_host = {p.endpoint: on_this_host(p.endpoint) for p in self._peers}

    @property
    def base_bytes(self) -> int:
        """Host memory the bases take (0 without)."""
        return self.bases.nbytes if self.bases is not None else 0

    def _publish_delta(self, manifest: wire.Manifest, plan: PackPlan, tensors: list[Any], t_start: float) -> PublishReport:
        """Publish ``manifest`` (full layout of ``plan``): as a delta against the bases where it pays and the
        engines serve them, else dense; raise UpdateFailed unless every engine applied it (module doc)."""
        warm_compiled()  # the compare loops, loaded while this (first: dense) version is sent (once per process)
        base, self.bases = self.bases, None  # its buffers go to the new version bucket by bucket
        new = Snapshot.empty(manifest)
        report = self._send_delta(base, new, manifest, plan, tensors, t_start)
        self.bases = new if report.ok and new.complete else None
        self._raise_failed(report)
        return report

    def _active(self) -> bool:
        """Some engine still takes the update being sent (none refused it or failed yet)."""
        return any(p.ack is None for p in self._peers)

    def _send_delta(self, base: Snapshot | None, new: Snapshot, manifest: wire.Manifest, plan: PackPlan,
                    tensors: list[Any], t_start: float) -> PublishReport:
        t0 = time.perf_counter()
        why = plan_update(base, manifest, plan, tensors)
        sample_s = time.perf_counter() - t0
        plane = self._plane()
        dense = manifest.total_bytes
        if why:
            buffers = Buffers(base.buffers if base is not None else None)  # the old base's bytes are not needed
            report = self._stream_report(manifest, plane, _whole_producer(plane, new, plan, tensors, buffers), t_start)
            telemetry = {**update_telemetry(manifest, ()), "mode": "dense", "why": why, "ratio": 1.0}
            return replace(report, seconds={**report.seconds, "sample": sample_s}, delta=telemetry)
        assert base is not None
        tables: list[BucketDelta | None] = [None] * len(manifest.bucket_sizes)
        timing = {"encode": 0.0}
        # patches compressed unless every engine is on this host (sync.delta_compress)
        compress = self.config.sync.compresses_patches(all(self._on_this_host[p.endpoint] for p in self._peers))
        level = ZSTD_LEVEL if compress else None
        buffers = Buffers()  # scratch for buckets that need packing before the compare (a cast, a GPU tensor)

        def produce(index: int, size: int) -> tuple[OutgoingBucket, tuple[int, ...]]:
            t_enc = time.perf_counter()
            encoded, sums = encode_in_place(base, plan, tensors, index, buffers, encode=self._active(), level=level)
            timing["encode"] += time.perf_counter() - t_enc
            new.buffers[index], new.sums[index] = base.buffers[index], sums  # patched: the new version's bytes
            base.buffers[index] = None
            if encoded is None:
                return _send_whole(plane, index, new.buffers[index]), sums
            table, items, wire_sums = encoded
            tables[index] = table
            out = plane.allocate(index, table.size)
            view = out.numpy()
            for offset, data in items:
                raw = data if not isinstance(data, bytes | bytearray | memoryview) else memoryview(data)
                view[offset:offset + len(raw)] = raw
            return replace(plane.seal(index, out), delta=table), wire_sums

        # taken before any bucket is patched: the base's checksums, which the engines check at Begin
        delta_manifest = replace(manifest, delta=DeltaManifest(base.manifest.version, tuple(base.checksums()[t.name] for t in manifest.tensors)))
        report = self._stream_report(delta_manifest, plane, produce, t_start)
        refused = {e.endpoint: e.reason for e in report.engines if e.kind == FailureKind.BASE}
        telemetry = update_telemetry(manifest, tables, base.manifest.version)
        wire_bytes = telemetry["wire_bytes"] * (len(report.engines) - len(refused))
        if refused:  # those engines do not serve the base: the same version, dense
            with self._only(refused):
                again = self._stream_report(manifest, plane, _whole_producer(plane, new, plan, tensors, buffers), time.perf_counter())
            resent = {e.endpoint: replace(e, dense_fallback=refused[e.endpoint]) for e in again.engines}
            report = replace(report, engines=tuple(resent.get(e.endpoint, e) for e in report.engines))
            wire_bytes += dense * len(refused)
        telemetry = {**telemetry, "mode": "delta", "base_version": base.manifest.version, "compressed": compress,
                     "ratio": round(telemetry["wire_bytes"] / dense, 6) if dense else 1.0,
                     "tensors": len(manifest.tensors), "dense_buckets": sum(1 for t in tables if t is None),
                     "dense_fallback": refused, "wire_bytes_all_engines": wire_bytes}
        return replace(report, seconds={**report.seconds, "encode": timing["encode"], "sample": sample_s}, delta=telemetry)


def _send_whole(plane: SendPlane, index: int, buffer: Any) -> OutgoingBucket:
    """Packed bucket ``index`` as it is: sent from ``buffer`` itself where the plane can, else copied into
    the plane's buffer."""
    out = plane.borrow(index, buffer)
    if out is not None:
        return out
    target = plane.allocate(index, int(buffer.numel()))
    if buffer.numel():
        target.copy_(buffer)
    return plane.seal(index, target)


def _whole_producer(plane: SendPlane, new: Snapshot, plan: PackPlan, tensors: list[Any], buffers: Buffers) -> Any:
    """Bucket ``index`` of ``new`` whole (full tensors), packed first if it is not yet (into a buffer from
    ``buffers``, kept in ``new``: the next base)."""

    def produce(index: int, size: int) -> tuple[OutgoingBucket, tuple[int, ...]]:
        if new.buffers[index] is None:
            buffer = buffers.take(size)
            new.sums[index] = tuple(pack_bucket(plan, tensors, index, buffer, checksum=new.manifest.checksum))
            new.buffers[index] = buffer
        return _send_whole(plane, index, new.buffers[index]), new.sums[index]

    return produce

