"""Delta updates on the publisher's side: the bases it keeps, the patches it encodes, the dense resend to
engines that refuse them (docs/delta.md).

Memory: the publisher keeps the last version every engine applied, packed as it went on the wire (every
tensor in the wire dtype, ``Manifest.total_bytes``): **one model of host RAM between publishes, two while it
publishes** (the bases and the version being sent), plus the encoded patches (a few % of a model at RL
densities). On a GPU trainer the bases are in host memory already: packing copies each tensor to the host.

One publish with deltas on (``sync.delta: true``) and a base kept:

1. every bucket is packed into host memory (the new version and its checksums);
2. each tensor is compared with its base bit for bit and, when few enough elements changed (at most
   ``DELTA_MAX_CHANGED`` of the update's, estimated on a sample), encoded (``bridge.delta.encode_bytes``: sparse, xor or dense,
   the smallest); each sends its patch when that is smaller than its bytes, and the update goes as a delta
   only if the bytes on the wire are at most ``DELTA_MAX_RATIO`` of dense (``plan_deltas``);
3. the delta goes to every engine; an engine that does not serve the base refuses it with kind ``base``
   before any payload, and is then sent the same version dense, its ``EngineReport.dense_fallback`` naming
   why;
4. once every engine applied the version it becomes the base; a failure anywhere drops the base (the next
   publish goes dense to all).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from bridge import checksums, wire
from bridge.config import BridgeConfig
from bridge.delta import DeltaEntry, DeltaManifest, DeltaTensor, encode_bytes, plan_deltas
from bridge.report import FailureKind
from bridge.sender import PublishReport, UpdateSender
from bridge.transports.base import OutgoingBucket, SendPlane
from trainer_side.packing import PackPlan, pack_bucket

if TYPE_CHECKING:
    import numpy as np

# an update goes as a delta only when its bytes on the wire are at most this share of dense: a delta that
# saves less is not worth depending on the engines' base (nor the encode and rebuild time)
DELTA_MAX_RATIO = 0.5
# above this share of changed elements (over the whole update) nothing is encoded: a new model, or random
# weights; checked with one pass of comparisons before spending the compression
DELTA_MAX_CHANGED = 0.5
SAMPLE_STRIDE = 61  # elements compared for that check: one in 61 (prime: no alignment with rows of a power of 2)


@dataclass
class Snapshot:
    """One version packed in host memory: every full bucket of ``manifest`` and each tensor's checksum."""

    manifest: wire.Manifest
    buffers: list[Any]  # per bucket, a flat uint8 numpy array of its bytes
    sums: list[tuple[int, ...]]  # per bucket, its tensors' checksums in manifest order

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def tensor(self, spec: wire.TensorSpec) -> np.ndarray:
        return self.buffers[spec.bucket][spec.offset:spec.offset + spec.nbytes]

    def checksums(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for specs, sums in zip(self.manifest.by_bucket(), self.sums, strict=True):
            out.update(zip((s.name for s in specs), sums, strict=True))
        return out


def snapshot(manifest: wire.Manifest, plan: PackPlan, tensors: list[Any]) -> Snapshot:
    """Pack every bucket of ``manifest`` (laid out by ``plan``) into new host buffers, summing each tensor."""
    import torch

    buffers, sums = [], []
    for index, size in enumerate(manifest.bucket_sizes):
        buffer = torch.empty(size, dtype=torch.uint8)
        sums.append(tuple(pack_bucket(plan, tensors, index, buffer, checksum=manifest.checksum)))
        buffers.append(buffer.numpy())
    return Snapshot(manifest, buffers, sums)


@dataclass(frozen=True)
class Encoded:
    """A delta update ready to send: its ``DeltaManifest``, each wire bucket's payloads (offset, bytes) and
    their checksums (what the bucket headers carry), and the plan's summary (telemetry)."""

    delta: DeltaManifest
    payloads: tuple[tuple[tuple[int, Any], ...], ...]
    sums: tuple[tuple[int, ...], ...]
    summary: dict[str, Any]


def _align(n: int) -> int:
    return (n + wire.ALIGN - 1) // wire.ALIGN * wire.ALIGN


def encode(base: Snapshot, new: Snapshot, max_ratio: float = DELTA_MAX_RATIO,
           max_changed: float = DELTA_MAX_CHANGED) -> Encoded | str:
    """``new`` as patches against ``base`` (the version the engines serve), or the reason it goes dense: the
    tensors differ (names, dtypes, shapes), the checksums differ in algorithm or are off, too many elements
    changed, or the patches would not save enough."""
    import numpy as np

    bm, nm = base.manifest, new.manifest
    if bm.version >= nm.version:
        return f"version {nm.version} is not newer than the base version {bm.version} (the engines answer it as served)"
    if nm.checksum in ("", "none") or nm.checksum != bm.checksum:
        return f"checksums {nm.checksum} (the base's: {bm.checksum}): a delta needs the same algorithm on both"
    if [(t.name, t.dtype, t.shape) for t in bm.tensors] != [(t.name, t.dtype, t.shape) for t in nm.tensors]:
        return f"the tensors (names, dtypes, shapes) differ from the base version {bm.version}'s"
    base_specs = {t.name: t for t in bm.tensors}
    numel = changed = 0
    for spec in nm.tensors:  # an estimate on every SAMPLE_STRIDE-th element: a fraction of a pass over memory
        width = wire.DTYPE_SIZES[spec.dtype]
        old_bits = base.tensor(base_specs[spec.name]).view(f"<u{width}")[::SAMPLE_STRIDE]
        changed += int(np.count_nonzero(old_bits != new.tensor(spec).view(f"<u{width}")[::SAMPLE_STRIDE]))
        numel += old_bits.size
    if numel and changed > max_changed * numel:
        return f"about {changed / numel:.1%} of the elements changed since version {bm.version} (above {max_changed:.0%}: dense)"
    base_sums, new_sums = base.checksums(), new.checksums()
    deltas: list[DeltaTensor] = []
    for spec in nm.tensors:
        deltas.append(encode_bytes(base.tensor(base_specs[spec.name]), new.tensor(spec), name=spec.name, dtype=spec.dtype,
                                   shape=spec.shape, base_version=bm.version, checksum=nm.checksum,
                                   base_checksum=base_sums[spec.name]))
    plan = plan_deltas([d.spec for d in deltas], max_ratio)
    if plan.mode == "dense":
        return f"the patches would be {sum(d.spec.nbytes for d in deltas) / max(plan.dense_bytes, 1):.1%} of dense (above {max_ratio:.0%})"
    send = {c.name: c.send == "delta" for c in plan.choices}
    by_name = {d.spec.name: d for d in deltas}
    fn = checksums.function(nm.checksum)
    entries: dict[str, DeltaEntry] = {}
    payloads, sums, sizes = [], [], []
    for specs in nm.by_bucket():
        offset, items, bucket_sums = 0, [], []
        for spec in specs:
            if send[spec.name]:
                d = by_name[spec.name]
                data: Any = d.payload
                entry = DeltaEntry(offset, d.spec.nbytes, new_sums[spec.name], d.spec)
                bucket_sums.append(fn(data))
            else:
                data = new.tensor(spec)
                entry = DeltaEntry(offset, spec.nbytes, new_sums[spec.name])
                bucket_sums.append(new_sums[spec.name])
            entries[spec.name] = entry
            items.append((offset, data))
            offset = _align(offset + entry.nbytes)
        payloads.append(tuple(items))
        sums.append(tuple(bucket_sums))
        sizes.append(max(offset, wire.ALIGN))
    delta = DeltaManifest(bm.version, tuple(sizes), tuple(entries[t.name] for t in nm.tensors))
    patched = sum(d.spec.numel for d in deltas)
    summary = {**plan.summary(), "base_version": bm.version,
               "density": round(sum(d.spec.changed for d in deltas) / patched, 6) if patched else 0.0}
    return Encoded(delta, tuple(payloads), tuple(sums), summary)


class DeltaSender(UpdateSender):
    """An ``UpdateSender`` that keeps its bases and sends deltas when they pay (``sync.delta``); the
    trainer's ``WeightPublisher`` is one."""

    def __init__(self, endpoints: list[str] | str, config: BridgeConfig | str | None = None, **kwargs: Any) -> None:
        super().__init__(endpoints, config, **kwargs)
        self.bases: Snapshot | None = None  # the last version every engine applied (sync.delta: true)
        self._pending: Snapshot | None = None  # the version being published: the bases once every engine applied it

    @property
    def base_bytes(self) -> int:
        """Host memory the bases take (0 without)."""
        return self.bases.nbytes if self.bases is not None else 0

    def _publish_delta(self, manifest: wire.Manifest, plan: PackPlan, tensors: list[Any], t_start: float) -> PublishReport:
        """Publish ``manifest`` (full layout of ``plan``): as a delta against the bases where it pays and the
        engines serve them, else dense; raise UpdateFailed unless every engine applied it (module doc)."""
        try:
            report = self._send_delta(manifest, plan, tensors, t_start)
        except BaseException:
            self.bases = self._pending = None  # what the engines serve is unknown
            raise
        self.bases = self._pending if report.ok else None
        self._pending = None
        self._raise_failed(report)
        return report

    def _send_delta(self, manifest: wire.Manifest, plan: PackPlan, tensors: list[Any], t_start: float) -> PublishReport:
        t0 = time.perf_counter()
        new = self._pending = snapshot(manifest, plan, tensors)
        encoded = encode(self.bases, new) if self.bases is not None else (
            "no base: the first update of this publisher, or the last one failed on an engine")
        encode_s = time.perf_counter() - t0
        dense = manifest.total_bytes
        if isinstance(encoded, str):
            report = self._stream_report(manifest, self._plane(), _dense_producer(self._plane(), new), t_start)
            telemetry: dict[str, Any] = {"mode": "dense", "why": encoded, "wire_bytes": dense, "dense_bytes": dense, "ratio": 1.0}
            return replace(report, seconds={**report.seconds, "encode": encode_s}, delta=telemetry)
        report = self._stream_report(replace(manifest, delta=encoded.delta), self._plane(),
                                     _delta_producer(self._plane(), encoded), t_start)
        refused = {e.endpoint: e.reason for e in report.engines if e.kind == FailureKind.BASE}
        wire_bytes = encoded.delta.wire_bytes
        if refused:  # those engines do not serve the base: the same version, dense
            with self._only(refused):
                again = self._stream_report(manifest, self._plane(), _dense_producer(self._plane(), new), time.perf_counter())
            resent = {e.endpoint: replace(e, dense_fallback=refused[e.endpoint]) for e in again.engines}
            report = replace(report, engines=tuple(resent.get(e.endpoint, e) for e in report.engines))
            wire_bytes += dense * len(refused)
        telemetry = {**encoded.summary, "mode": "delta", "dense_fallback": refused,
                     "wire_bytes_all_engines": wire_bytes}
        return replace(report, seconds={**report.seconds, "encode": encode_s}, delta=telemetry)


def _dense_producer(plane: SendPlane, new: Snapshot) -> Any:
    """Bucket ``index`` of ``new`` as it is (full tensors), copied from the snapshot into the plane's buffer."""

    def produce(index: int, size: int) -> tuple[OutgoingBucket, tuple[int, ...]]:
        buffer = plane.allocate(index, size)
        if size:
            buffer.numpy()[:size] = new.buffers[index]
        return plane.seal(index, buffer), new.sums[index]

    return produce


def _delta_producer(plane: SendPlane, encoded: Encoded) -> Any:
    """Wire bucket ``index`` of ``encoded``: its payloads at their offsets, with their checksums."""
    import numpy as np

    def produce(index: int, size: int) -> tuple[OutgoingBucket, tuple[int, ...]]:
        buffer = plane.allocate(index, size)
        out = buffer.numpy()
        for offset, data in encoded.payloads[index]:
            raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes | bytearray | memoryview) else data
            out[offset:offset + raw.nbytes] = raw
        return plane.seal(index, buffer), encoded.sums[index]

    return produce
