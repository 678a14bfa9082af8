"""The receiver's base for delta updates: its own copy of the version it last applied, and the rebuild of full
tensors from patches (docs/delta.md).

Where the copy lives: in the receiver's process (``SyncReceiver``), one per engine. In staged mode it **is** the
applied update's staging: once the engine confirmed an update (dense or delta), ``adopt`` keeps its full buckets
(the segments the engine loaded from; no copy), and the next delta is patched into those segments in place
(``patch``), which the engine then loads; what each patch overwrote is recorded, so a failed or abandoned
update is rolled back (``rollback``) to the base bit for bit. In streaming mode (buckets freed as they load)
each staged bucket of a dense update is copied into a bucket of the store as it is staged (``copy``) and adopted
once applied, so a streaming delta is patched in place too. A relay copies tensor by tensor (``take``, ``commit``).
It holds every tensor those updates carried, in the wire dtype, and the checksum each was verified against:
**one model of host RAM per receiver** (``sum(Manifest.tensors nbytes)`` of the model), besides the wire
buckets of an update in flight (a dense update's staging, which then becomes the store). It starts empty, so
an engine (re)started or cold-loaded refuses patches until a dense update filled it. It answers "is the named
base what this engine serves?" by version and recorded checksums (no rehash); a patch then checks the
checksum of each resulting full tensor before the bucket reaches the engine (``rebuild``, into a new
segment, also checks each base tensor's bytes again: it serves a relay's store, which others read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from bridge import wire
from bridge.delta import BucketDelta, DeltaTensor, apply_bytes, patch_in_place, undo_patches, warm_compiled
from bridge.errors import ChecksumError, NonFiniteError, WrongBase
from bridge.finite import all_finite
from bridge.shm import Segment, SegmentPool
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
        # staged mode (``adopt``): the applied version's full buckets themselves, the segments the engine loaded
        # from (``tensors`` are views into them), and their layout; a delta is patched into them in place
        self.segments: dict[int, Segment] = {}
        self.layout: tuple[tuple[wire.TensorSpec, ...], tuple[int, ...]] = ((), ())
        self.patching: bytes | None = None  # the update patching ``segments`` in place (``patch``) until it ends
        self.undo: list[object] = []  # what that update overwrote (``bridge.delta.undo_patches``)
        self.stale = False  # another update was applied while one patched: no base once that one ends
        # ``patch`` (the receiver's thread) and ``rollback`` (also the engine's apply thread, restoring a failed
        # update loaded bucket by bucket) take turns
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Host memory the kept tensors take."""
        return sum(t.nbytes for t in self.tensors.values())

    def clear(self, pool: SegmentPool | None = None) -> None:
        """Keep nothing; held segments go back to ``pool``, or are closed."""
        self.version, self.algorithm, self.tensors, self.sums = 0, "", {}, {}
        for segment in self.segments.values():
            pool.give(segment) if pool is not None else segment.close()
        self.segments, self.layout = {}, ((), ())
        self.patching, self.undo, self.stale = None, [], False

    def can_patch(self, manifest: wire.Manifest, identity: bytes) -> bool:
        """The delta ``manifest`` (its base checked: ``check``) can be patched into the held segments in place:
        they hold every bucket in its layout, and no other update patches them."""
        return (bool(self.segments) and self.layout == (manifest.tensors, manifest.bucket_sizes)
                and len(self.segments) == len(manifest.bucket_sizes) and self.patching in (None, identity))

    def patch(self, manifest: wire.Manifest, delta: BucketDelta, index: int, wire_bucket: StagedBucket, identity: bytes,
              nonfinite: str) -> StagedBucket:
        """Full bucket ``index`` of the delta ``manifest`` made **in place** in the held segment of that bucket
        (``can_patch``): each patch applied (``bridge.delta.patch_in_place``: the result's checksum checked; the
        base's was checked at ``check`` against the recorded one, the bytes verified when kept, so not rehashed),
        each tensor sent whole copied; under ``nonfinite: reject`` the values written are checked (the rest are
        the base's, checked when they came). What each overwrote is recorded: ``rollback`` puts the base back
        bit for bit (a failed or abandoned update), ``adopt`` keeps the result. Raises as ``rebuild`` does;
        this bucket's own writes are undone then too (by ``rollback``, which the failed update's end calls).
        The returned bucket's segment is the store's: the update must not free it."""
        with self._lock:
            return self._patch(manifest, delta, index, wire_bucket, identity, nonfinite)

    def _patch(self, manifest: wire.Manifest, delta: BucketDelta, index: int, wire_bucket: StagedBucket, identity: bytes,
               nonfinite: str) -> StagedBucket:
        import numpy as np

        self.patching = identity
        specs = manifest.by_bucket()[index]
        segment = self.segments[index]
        sums = []
        for spec, entry, payload, target in _pieces(specs, delta, segment, wire_bucket):
            if entry.delta is None:  # sent whole: its payload was verified against the header, and checked finite
                self.undo.append((target, None, target.copy()))
                target[:] = payload
            else:
                written = patch_in_place(target, DeltaTensor(entry.delta, memoryview(payload)), self.undo,  # type: ignore[arg-type]
                                         check_base_bytes=False)
                if nonfinite == "reject" and spec.dtype in wire.FLOAT_DTYPES and spec.nbytes:
                    values = target if written is None else written[1].view(np.uint8)
                    if values.nbytes and not all_finite(values, spec.dtype):
                        raise NonFiniteError(f"tensor {spec.name}: holds NaN or Inf (policy sync.nonfinite=reject)")
            sums.append(entry.checksum)
        return StagedBucket(index, segment, list(specs), tuple(sums))

    def rollback(self) -> None:
        """The update that patched the held segments failed or was abandoned: put back every byte it wrote.
        The store then holds its version again, bit for bit. Safe to call again, and from any thread."""
        with self._lock:
            undo_patches(self.undo)
            self.undo, self.patching = [], None
            if self.stale:
                self.clear()

    def restore(self) -> list[StagedBucket]:
        """The held version's full buckets, in index order, after ``rollback``: what an engine loads to serve that
        version again (``EngineGate.begin``'s ``restore``). Empty when nothing is held in buckets."""
        self.rollback()
        tensors, sizes = self.layout
        by_bucket: list[list[wire.TensorSpec]] = [[] for _ in sizes]
        for spec in tensors:
            by_bucket[spec.bucket].append(spec)
        if not self.version or len(self.segments) != len(sizes):
            return []
        return [StagedBucket(i, self.segments[i], specs, tuple(self.sums[s.name] for s in specs))
                for i, specs in enumerate(by_bucket)]

    def adopt(self, manifest: wire.Manifest, buckets: list[StagedBucket], identity: bytes, pool: SegmentPool) -> set[int]:
        """Staged mode: the update ``manifest`` was applied from these full buckets (verified); they become the
        base, **without a copy**: a bucket patched in place is the store's already, a receive segment of this
        update is taken over (the held one of that index goes back to ``pool``), a segment this receiver does
        not own (a publisher's shm segment) is copied into one. Returns the indexes of the buckets now held (the
        update must not free them). Without usable checksums (as ``commit``) nothing is kept; a LoRA adapter's
        update changes nothing here; an update applied while another patches the held segments leaves no
        base once that one ends (the next delta goes dense)."""
        import numpy as np

        if manifest.adapter is not None:
            return set()
        if self.patching not in (None, identity):
            self.stale = True
            return set()
        self.undo, self.patching = [], None
        complete = all(len(b.checksums) == len(b.specs) for b in buckets)
        if self.stale or manifest.checksum in ("", "none") or not complete or len(buckets) != len(manifest.bucket_sizes):
            self.clear(pool)
            return set()
        if self.layout != (manifest.tensors, manifest.bucket_sizes):
            for segment in self.segments.values():
                pool.give(segment)
            self.segments = {}
        kept: set[int] = set()
        tensors: dict[str, np.ndarray] = {}
        sums: dict[str, int] = {}
        for bucket in buckets:
            held = self.segments.get(bucket.index)
            segment = bucket.segment
            if segment is not held:
                if not segment.owner:  # the publisher's: copied into a segment of ours
                    own = held if held is not None and held.size >= segment.size else pool.take(segment.size)
                    if held is not None and held is not own:
                        pool.give(held)
                    self.segments[bucket.index] = own  # held from here on, so a failed copy gives it back (clear)
                    try:
                        np.frombuffer(own.buffer, dtype=np.uint8)[:segment.size] = np.frombuffer(segment.buffer, dtype=np.uint8)[:segment.size]
                    except (ValueError, OSError) as exc:  # the publisher's segment went away (it or this receiver closing)
                        logger.warning("version %d: bucket %d could not be kept as the delta base (%s); keeping no base",
                                       manifest.version, bucket.index, exc)
                        staged = {id(b.segment) for b in buckets}  # this update's own segments: it frees them
                        self.segments = {i: s for i, s in self.segments.items() if id(s) not in staged}
                        self.clear(pool)
                        return set()
                    segment = own
                else:
                    kept.add(bucket.index)
                    if held is not None:
                        pool.give(held)
                self.segments[bucket.index] = segment
            else:
                kept.add(bucket.index)
            view = np.frombuffer(segment.buffer, dtype=np.uint8)
            for spec, checksum in zip(bucket.specs, bucket.checksums, strict=True):
                tensors[spec.name] = view[spec.offset:spec.offset + spec.nbytes]
                sums[spec.name] = checksum
        self.tensors, self.sums, self.algorithm = tensors, sums, manifest.checksum
        self.layout = (manifest.tensors, manifest.bucket_sizes)
        self.version = manifest.version
        warm_compiled()  # a delta may come next: its patch loops loaded meanwhile (once per process)
        return kept

    def copy(self, manifest: wire.Manifest, bucket: StagedBucket, pool: SegmentPool, in_place: bool = True) -> StagedBucket:
        """Streaming mode (the engine's buckets are freed as they load): staged full bucket ``bucket`` of the update
        ``manifest`` copied into a segment for ``adopt`` once the update is applied, so the store keeps buckets a
        delta is patched into in place as in staged mode. With ``in_place``, when the held buckets have the
        manifest's layout and no other update patches them, the copy goes **over the held segment** of that
        index (no new pages: memory speed); the store is then in flux, ``version`` 0, until ``adopt``, so a
        failed or abandoned update leaves no base and the next delta goes dense. Otherwise into a segment from
        ``pool``, which the caller frees unless ``adopt`` took it (``holds``)."""
        import numpy as np

        with self._lock:
            held = self.segments.get(bucket.index)
            if not (in_place and held is not None and self.patching is None
                    and self.layout == (manifest.tensors, manifest.bucket_sizes)):
                held = None
            target = held if held is not None else pool.take(manifest.bucket_sizes[bucket.index])
            if held is not None:
                self.version = 0  # in flux from here until adopt
            size = manifest.bucket_sizes[bucket.index]
            np.frombuffer(target.buffer, dtype=np.uint8)[:size] = np.frombuffer(bucket.segment.buffer, dtype=np.uint8)[:size]
            return StagedBucket(bucket.index, target, list(bucket.specs), tuple(bucket.checksums))

    def holds(self, segment: Segment) -> bool:
        """``segment`` is one of the store's held buckets."""
        return any(s is segment for s in self.segments.values())

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
        self.layout = ((), ())  # the held segments (if any) are storage now, not buckets to patch in place
        for name, (data, checksum) in kept.items():
            self.tensors[name] = data
            self.sums[name] = checksum
        self.version = manifest.version
        warm_compiled()  # a delta may come next: its patch loops loaded meanwhile (once per process)

    def check(self, manifest: wire.Manifest) -> None:
        """Refuse (``WrongBase``, kind ``base``) a delta whose base is not what this receiver holds: nothing
        held (the engine was restarted or cold-loaded since), another version (another publisher came in
        between, or a version was missed), or a tensor whose recorded checksum differs. Reads no payload."""
        delta = manifest.delta
        if delta is None:
            return
        base = delta.base_version
        if self.patching is not None:
            raise WrongBase(f"{self.engine} is applying another delta on its base; the delta of version {manifest.version} "
                            f"applies to version {base}")
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


def _pieces(specs: list[wire.TensorSpec], delta: BucketDelta, segment: Segment,
            wire_bucket: StagedBucket) -> Iterator[tuple[wire.TensorSpec, Any, Any, Any]]:
    """For each tensor of a full bucket: its spec, its delta entry, its payload in ``wire_bucket`` and its place
    in ``segment`` (flat ``uint8`` views). A tensor sent whole must carry its entry's checksum in the wire
    bucket's header (``ChecksumError`` otherwise), checked before it is yielded."""
    import numpy as np

    entries = dict(zip((t.name for t in specs), delta.entries, strict=True))
    out = np.frombuffer(segment.buffer, dtype=np.uint8)
    source = np.frombuffer(wire_bucket.segment.buffer, dtype=np.uint8)
    sent = dict(zip((s.name for s in wire_bucket.specs), wire_bucket.checksums, strict=False))
    for spec in specs:
        entry = entries[spec.name]
        if entry.delta is None and spec.name in sent and sent[spec.name] != entry.checksum:
            raise ChecksumError(f"tensor {spec.name}: its bucket's checksum {sent[spec.name]:#x} differs from the "
                                f"delta entry's {entry.checksum:#x}")
        yield (spec, entry, source[entry.offset:entry.offset + entry.nbytes], out[spec.offset:spec.offset + spec.nbytes])


def rebuild(manifest: wire.Manifest, delta: BucketDelta, index: int, wire_bucket: StagedBucket, store: BaseStore,
            pool: SegmentPool, nonfinite: str) -> StagedBucket:
    """Full bucket ``index`` of ``manifest`` rebuilt into a segment from ``pool``: each patch applied to the
    stored base (``apply_bytes``: the base's bytes checked against the patch's base checksum, the result's
    against its result checksum), each dense tensor copied; under ``nonfinite: reject`` the rebuilt floats
    are checked too. ``delta`` is the table the bucket's header carried (checked against the manifest). The
    wire bucket (verified already: its payload checksums) is only read. Raises the
    delta codec's errors (``WrongBase``, ``CorruptPatch``, ``ManifestError``) or ``NonFiniteError``; the new
    segment is closed then. A dense tensor's header checksum must equal its entry's (``ChecksumError``)."""
    specs = manifest.by_bucket()[index]
    segment = pool.take(manifest.bucket_sizes[index])
    try:
        sums = []
        for spec, entry, payload, target in _pieces(specs, delta, segment, wire_bucket):
            if entry.delta is None:
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
