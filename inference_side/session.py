"""One publisher's update as the receiver holds it, from its manifest to the engine's answer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bridge import wire
from bridge.report import ApplyResult, LoadResult
from bridge.shm import Segment, SegmentPool
from inference_side.contract import StagedBucket

REFUSED_KEEP = 1024  # publishers remembered (the most recent): a refused update's late buckets, a checked no-op


@dataclass
class LoadRun:
    """Verified buckets waiting for one ``EngineGate.load_many`` on the apply thread. The receiver's loop adds
    the buckets that become ready while the run has not started (``join``); the apply thread takes them all
    when it starts it (``start``), so a bucket that arrives later opens the next run."""

    buckets: list[StagedBucket]
    started: bool = False
    _lock: Any = field(default_factory=threading.Lock, repr=False)

    def join(self, bucket: StagedBucket, most: int) -> bool:
        """Add ``bucket`` unless the run started or holds ``most`` already; whether it was added."""
        with self._lock:
            if self.started or len(self.buckets) >= most:
                return False
            self.buckets.append(bucket)
            return True

    def start(self) -> list[StagedBucket]:
        """The apply thread begins the run: no bucket joins it any more; its buckets, in order."""
        with self._lock:
            self.started = True
            return list(self.buckets)


@dataclass
class Session:
    identity: bytes
    manifest: wire.Manifest
    started: float
    last_seen: float
    streaming: bool = False  # buckets go to the engine as they are verified (sync.mode: streaming)
    early: bool = False  # a delta patched in the base store, loaded from it as verified (SyncReceiver._loads_early)
    buckets: dict[int, StagedBucket] = field(default_factory=dict)  # verified, not yet loaded
    pending: Future[ApplyResult] | None = None  # the engine's finish (after every load)
    apply_started: float = 0.0
    overdue: bool = False  # the publisher was told the apply deadline passed; no second ack
    last_ping: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    bytes_in: int = 0
    # streaming (or a delta loaded early): runs of ready buckets are loaded in order on the apply thread; a
    # bucket's credit goes back once it is loaded, so at most ``transport.depth`` are held here
    loads: list[tuple[LoadRun, Future[LoadResult]]] = field(default_factory=list)
    loaded: set[int] = field(default_factory=set)
    held: frozenset[str] = frozenset()  # receive segments the engine still maps (its last LoadResult)
    on_abort: Callable[[str], None] | None = None  # set while the update is open in the engine and not finishing
    lent: list[Segment] = field(default_factory=list)  # loaded receive segments a worker may still map
    spare: list[Segment] = field(default_factory=list)  # receive segments free for the next bucket
    ended: wire.End | None = None  # End arrived while buckets were still landing
    checksums: dict[int, tuple[int, ...]] = field(default_factory=dict)  # headers of buckets still landing
    deltas: dict[int, Any] = field(default_factory=dict)  # a delta update: each bucket's BucketDelta (None: sent whole)
    unreleased: dict[int, str] = field(default_factory=dict)  # loaded shm buckets -> segment, a worker may hold
    verified_by_peer: int = 0  # shm buckets another receiver on this host verified (see host_verdicts)
    sums: dict[str, int] = field(default_factory=dict)  # tensor -> checksum its bucket's header carried
    # streaming, keeping delta bases: each staged bucket's copy for the store (BaseStore.copy), and the segments of
    # those copies the store does not hold (freed here unless adopted)
    copies: dict[int, StagedBucket] = field(default_factory=dict)
    copied: list[Segment] = field(default_factory=list)
    # staged delta patched in the base store's own segments: those buckets are the store's (never freed here),
    # and ``rollback`` (the store's) puts its base back unless the update was applied and adopted
    borrowed: set[int] = field(default_factory=set)
    rollback: Callable[[], None] | None = None
    _ranges: list[list[Any]] | None = None  # a sharded update's ranges per bucket (see ranges())

    def ranges(self) -> list[list[Any]]:
        """A sharded update's byte ranges per bucket, in the order of a bucket header's checksums (computed
        once per update)."""
        if self._ranges is None:
            from bridge.shards import bucket_ranges

            assert self.manifest.shards is not None
            self._ranges = bucket_ranges(self.manifest.shards, self.manifest.tensors, len(self.manifest.bucket_sizes))
        return self._ranges

    def close(self, reason: str = "update abandoned", pool: SegmentPool | None = None) -> None:
        """End the session (the engine's open update is aborted with ``reason``); with ``pool``, receive
        segments no worker can still map go back to it."""
        idle = self.on_abort is None and all(f.done() for _, f in self.loads) and (self.pending is None or self.pending.done())
        rollback, self.rollback = self.rollback, None
        if rollback is not None:
            rollback()
        for seg in [b.segment for i, b in self.buckets.items() if i not in self.borrowed] + self.lent:
            if pool is not None and idle and seg.owner:
                pool.give(seg)
            else:
                seg.close()
        for seg in self.spare + self.copied:  # not mapped by any worker (see SyncReceiver._receive_segment)
            pool.give(seg) if pool is not None else seg.close()
        self.buckets.clear()
        self.copies.clear()
        self.copied.clear()
        self.lent.clear()
        self.spare.clear()
        abort, self.on_abort = self.on_abort, None
        if abort is not None:
            abort(reason)

    def receive_segment(self, size: int, pool: SegmentPool) -> Segment:
        """A receive segment for the next bucket: in streaming, a spare one that no worker maps any more (its
        pages are already faulted in); else, or when none fits, one from ``pool``."""
        if not self.streaming:
            return pool.take(size)
        for seg in [s for s in self.lent if s.name not in self.held]:
            self.lent.remove(seg)
            self.spare.append(seg)
        fits = [s for s in self.spare if s.size >= size]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self.spare.remove(seg)
            return seg
        return pool.take(size)

    def released(self) -> tuple[int, ...]:
        """Loaded shm buckets whose segment no worker maps any more, not yet told to the publisher."""
        released = tuple(i for i, name in self.unreleased.items() if name not in self.held)
        for index in released:
            del self.unreleased[index]
        return released


def remember(seen: dict[bytes, int], identity: bytes, version: int) -> None:
    """Note ``version`` for publisher ``identity``, keeping the most recent REFUSED_KEEP publishers."""
    seen.pop(identity, None)
    seen[identity] = version
    while len(seen) > REFUSED_KEEP:  # a long run meets many publishers: keep the latest
        seen.pop(next(iter(seen)))
