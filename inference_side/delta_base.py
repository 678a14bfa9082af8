"""The receiver's base for delta updates: its own copy of the version it last applied, and the rebuild of full
tensors from patches into staging (docs/delta.md).

Where the copy lives: in the receiver's process (``SyncReceiver``), one per engine, filled from the staged
buckets of every update it applied (dense or delta) once the engine confirmed the apply (streaming: copied
as each bucket is staged, kept once the update is applied). It holds every
tensor those updates carried, in the wire dtype, and the checksum each was verified against: **one model of
host RAM per receiver** (``sum(Manifest.tensors nbytes)`` of the model), besides the staging of an update in
flight. It starts empty, so an engine (re)started or cold-loaded refuses patches until a dense update
filled it. It answers "is the named base what this engine serves?" by version and recorded checksums (no
rehash), and ``rebuild`` then checks each base tensor's bytes again (``delta.apply_bytes``) and the
checksum of each resulting full tensor before the bucket reaches the engine.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from bridge import wire
from bridge.delta import BucketDelta, DeltaTensor, apply_bytes
from bridge.errors import ChecksumError, WrongBase
from bridge.shm import SegmentPool
from inference_side.contract import StagedBucket
from inference_side.verify import verify_bucket

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)


class BaseStore:
    """The version this receiver last applied, tensor by tensor (bytes and checksum under ``algorithm``)."""

    def __init__(self, engine: str = "this engine") -> None:
        self.engine = engine
        self.version = 0  # 0: nothing kept (started, or the last apply could not be kept)
        self.algorithm = ""
        self.tensors: dict[str, np.ndarray] = {}
        self.sums: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        """Host memory the kept tensors take."""
        return sum(t.nbytes for t in self.tensors.values())

    def clear(self) -> None:
        self.version, self.algorithm, self.tensors, self.sums = 0, "", {}, {}

    def keep(self, manifest: wire.Manifest, buckets: list[StagedBucket]) -> None:
        """An update of base weights was applied from these staged buckets (full tensors and their verified
        checksums): copy them (``take`` each, then ``commit``)."""
        kept: dict[str, tuple[np.ndarray, int]] = {}
        for bucket in buckets:
            kept.update(self.take(bucket))
        self.commit(manifest, kept, complete=all(len(b.checksums) == len(b.specs) for b in buckets))

    def take(self, bucket: StagedBucket, in_place: bool = True) -> dict[str, tuple[np.ndarray, int]]:
        """A copy of each tensor of a staged bucket (full tensors, verified) and its checksum, for ``commit``
        once the update is applied. Called as each bucket is staged, so the copy overlaps the transfer
        instead of delaying the acknowledgement. A tensor whose base is held at the same size is copied **in
        place** over it (no new pages: the copy runs at memory speed): its base was read only by its own
        bucket's rebuild, done by now. The store is then in flux: ``version`` is 0 until ``commit``, so a
        failed or abandoned update leaves no base, and the next delta is refused (kind ``base``) and resent
        dense. ``in_place=False`` always copies into new arrays and leaves the held version intact until
        ``commit`` (a relay keeps serving joins from it while an update is in flight)."""
        import numpy as np

        view = np.frombuffer(bucket.segment.buffer, dtype=np.uint8)
        out: dict[str, tuple[np.ndarray, int]] = {}
        for spec, checksum in zip(bucket.specs, bucket.checksums, strict=False):
            src = view[spec.offset:spec.offset + spec.nbytes]
            held = self.tensors.get(spec.name)
            if in_place and held is not None and held.nbytes == src.nbytes:
                self.version = 0  # in flux from here until commit
                np.copyto(held, src)
                out[spec.name] = (held, checksum)
            else:
                out[spec.name] = (src.copy(), checksum)
        return out

    def commit(self, manifest: wire.Manifest, kept: dict[str, tuple[np.ndarray, int]], complete: bool = True) -> None:
        """The update ``manifest`` was applied; ``kept`` holds a copy of each of its tensors and its checksum
        (``copy`` of every bucket, taken while staged). Without usable checksums (``none``, a bucket sent
        without them: ``complete`` false) the copy is dropped, and patches are refused until an update with
        checksums. A LoRA adapter's update changes nothing here."""
        if manifest.adapter is not None:
            return
        if manifest.checksum in ("", "none") or not complete or len(kept) != len(manifest.tensors):
            self.clear()
            return
        if manifest.checksum != self.algorithm:
            self.tensors, self.sums, self.algorithm = {}, {}, manifest.checksum
        for name, (data, checksum) in kept.items():
            self.tensors[name] = data
            self.sums[name] = checksum
        self.version = manifest.version

    def check(self, manifest: wire.Manifest) -> None:
        """Refuse (``WrongBase``, kind ``base``) a delta whose base is not what this receiver holds: nothing
        held (the engine was restarted or cold-loaded since), another version (another publisher came in
        between, or a version was missed), or a tensor whose recorded checksum differs. Reads no payload."""
        delta = manifest.delta
        if delta is None:
            return
        base = delta.base_version
        if not self.version:
            raise WrongBase(f"{self.engine} holds no base for a delta: it applied no update since it started (restarted "
                            f"or cold-loaded); the delta of version {manifest.version} applies to version {base}")
        if self.version != base:
            raise WrongBase(f"{self.engine} last applied version {self.version}, the delta of version {manifest.version} "
                            f"applies to version {base} (another publisher in between, or a missed version)")
        if self.algorithm != manifest.checksum:
            raise WrongBase(f"{self.engine} recorded its base under {self.algorithm or 'no checksum'}, the delta's "
                            f"checksums are {manifest.checksum}")
        for name, expected in delta.base_sums(manifest).items():
            held = self.sums.get(name)
            if held is None:
                raise WrongBase(f"tensor {name}: {self.engine} holds no base for it (version {base} did not carry it here)")
            if held != expected:
                raise WrongBase(f"tensor {name}: wrong base: the delta applies to version {base} whose {manifest.checksum} is "
                                f"{expected:#x}, {self.engine} served {held:#x}")


def rebuild(manifest: wire.Manifest, delta: BucketDelta, index: int, wire_bucket: StagedBucket, store: BaseStore,
            pool: SegmentPool, nonfinite: str) -> StagedBucket:
    """Full bucket ``index`` of ``manifest`` rebuilt into a segment from ``pool``: each patch applied to the
    stored base (``apply_bytes``: the base's bytes checked against the patch's base checksum, the result's
    against its result checksum), each dense tensor copied; under ``nonfinite: reject`` the rebuilt floats
    are checked too. ``delta`` is the table the bucket's header carried (checked against the manifest). The
    wire bucket (verified already: its payload checksums) is only read. Raises the
    delta codec's errors (``WrongBase``, ``CorruptPatch``, ``ManifestError``) or ``NonFiniteError``; the new
    segment is closed then. A dense tensor's header checksum must equal its entry's (``ChecksumError``)."""
    import numpy as np

    specs = manifest.by_bucket()[index]
    entries = dict(zip((t.name for t in specs), delta.entries, strict=True))
    segment = pool.take(manifest.bucket_sizes[index])
    try:
        out = np.frombuffer(segment.buffer, dtype=np.uint8)
        source = np.frombuffer(wire_bucket.segment.buffer, dtype=np.uint8)
        sent = dict(zip((s.name for s in wire_bucket.specs), wire_bucket.checksums, strict=False))
        sums = []
        for spec in specs:
            entry = entries[spec.name]
            payload = source[entry.offset:entry.offset + entry.nbytes]
            target = out[spec.offset:spec.offset + spec.nbytes]
            if entry.delta is None:
                if spec.name in sent and sent[spec.name] != entry.checksum:
                    raise ChecksumError(f"tensor {spec.name}: its bucket's checksum {sent[spec.name]:#x} differs from the "
                                        f"delta entry's {entry.checksum:#x}")
                target[:] = payload
            else:
                base = store.tensors.get(spec.name)
                if base is None:
                    raise WrongBase(f"tensor {spec.name}: {store.engine} holds no base for it")
                apply_bytes(base, DeltaTensor(entry.delta, memoryview(payload)), target)  # type: ignore[arg-type]
            sums.append(entry.checksum)
        if nonfinite == "reject":
            verify_bucket(segment.buffer, specs, tuple(sums), nonfinite, "none")
    except BaseException:
        segment.close()
        raise
    return StagedBucket(index, segment, list(specs), tuple(sums))
