"""ZMQ data plane: bucket bytes travel as one zero-copy frame after the header (tcp:// or ipc://).

Packing buffers form a ring of ``depth + 1`` slots reused across buckets and updates; a slot is
packed again only once ZMQ has let go of its last frame (a MessageTracker per socket it went to);
a slot still held after ``WAIT_S`` (a slow or dead receiver) is abandoned to ZMQ and replaced.

An update from many trainer ranks (a manifest with ``shards``, trainer_side/multi_rank.py): each rank
sends, on its own socket, one ``RankBucket`` per bucket holding its ranges, and rank 0's header carries
no bytes, only the ranges' checksums. The receiving end lands each rank's ranges at their place in the
bucket's staging segment (a strided range through a strided view) and hands the bucket on once every rank
the manifest names for it sent its part and the header came; the ranges are then verified
(inference_side/ranges.py) like those of the shm path. A rank that sends bytes the manifest does not give
it, twice, or the wrong amount fails the update naming it; a rank that sends nothing of an announced
bucket within ``deadlines.bucket_s`` (it died mid-send) fails it naming the rank."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bridge.errors import WireError
from bridge.transports.base import Landed, LandPlane, OutgoingBucket, SendPlane, no_segment_name

if TYPE_CHECKING:
    from bridge import wire
    from bridge.config import BridgeConfig
    from bridge.shards import RangeSpec
    from bridge.shm import Segment

WAIT_S = 1.0


class ZmqSendPlane(SendPlane):
    kind = "zmq"

    def __init__(self) -> None:
        self._slots = 3
        self._buffers: dict[int, Any] = {}
        self._trackers: dict[int, list[Any]] = {}

    def configure(self, depth: int) -> None:
        self._slots = depth + 1

    def allocate(self, index: int, size: int) -> Any:
        import torch

        slot = index % self._slots
        if not _settled(self._trackers.pop(slot, []), WAIT_S):
            self._buffers.pop(slot, None)  # ZMQ still holds it: leave it to ZMQ, pack into a new one
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < size:
            buf = self._buffers[slot] = torch.empty(size, dtype=torch.uint8)
        return buf[:size]

    @property
    def held_bytes(self) -> int:
        return sum(int(b.numel()) for b in self._buffers.values())

    def seal(self, index: int, buffer: Any) -> OutgoingBucket:
        return OutgoingBucket(index, buffer, (memoryview(buffer.numpy()),))

    def borrow(self, index: int, tensor: Any) -> OutgoingBucket | None:
        return OutgoingBucket(index, tensor, (memoryview(tensor.numpy()),))

    def sent(self, index: int, tracker: Any) -> None:
        if tracker is not None:
            self._trackers.setdefault(index % self._slots, []).append(tracker)

    def release(self, failed: bool = False) -> None:
        for slot, trackers in self._trackers.items():
            if not _settled(trackers, 0.0):
                self._buffers.pop(slot, None)
        self._trackers.clear()

    def close(self) -> None:
        self.release()
        self._buffers.clear()


def _settled(trackers: list[Any], timeout_s: float) -> bool:
    """True once ZMQ released every frame behind ``trackers`` (waiting at most ``timeout_s`` each)."""
    import zmq

    for tracker in trackers:
        if timeout_s > 0:
            try:
                tracker.wait(timeout_s)
            except zmq.NotDone:
                return False
        if not tracker.done:
            return False
    return True


def scatter(view: memoryview, base: int, ranges: Sequence[RangeSpec], data: Any) -> None:
    """Lay ``data`` (the ranges' bytes as sent: each range's runs concatenated, the ranges one after the
    other) out in ``view``, where their tensor starts at byte ``base`` (a mapping of names to offsets when
    the ranges span several tensors). The caller checked ``len(data)``."""
    import numpy as np

    dst = np.frombuffer(view, dtype=np.uint8)
    src = np.frombuffer(data, dtype=np.uint8)
    at = 0
    for r in ranges:
        start = (base[r.name] if isinstance(base, dict) else base) + r.offset
        if r.run:
            window = np.lib.stride_tricks.as_strided(dst[start:], shape=(r.count, r.run), strides=(r.stride, 1))
            window[...] = src[at : at + r.nbytes].reshape(r.count, r.run)
        else:
            dst[start : start + r.nbytes] = src[at : at + r.nbytes]
        at += r.nbytes


@dataclass
class _Landing:
    """One bucket of a sharded update: its staging segment, the ranks whose part arrived, and when its
    header came (0.0: not yet)."""

    segment: Segment | None = None
    arrived: set[int] = field(default_factory=set)
    announced: float = 0.0


@dataclass
class _Sharded:
    """A sharded update in progress: each bucket's ranges by rank (manifest order) and its landings."""

    version: int
    sizes: tuple[int, ...]
    offsets: dict[str, int]
    ranks: list[dict[int, list[RangeSpec]]]
    world: int
    landing: dict[int, _Landing] = field(default_factory=dict)
    sent: set[tuple[int, int]] = field(default_factory=set)  # (bucket, rank) parts arrived, landed ones too

    def complete(self, index: int) -> bool:
        return set(self.ranks[index]) <= self.landing[index].arrived


class ZmqLandPlane(LandPlane):
    """The bytes came as the one frame after the header: copied into a receive segment. A sharded update's
    bytes came from each rank's own socket, each rank's ranges landed where they lie (see the module)."""

    kind = "zmq"

    def __init__(self, config: BridgeConfig) -> None:
        super().__init__(config)
        self._sharded: dict[bytes, _Sharded] = {}
        self._done: list[Landed] = []

    def expect(self, identity: bytes, manifest: wire.Manifest) -> None:
        from bridge.shards import bucket_ranges

        self.drop(identity)
        if manifest.shards is None:
            return
        per_bucket = bucket_ranges(manifest.shards, manifest.tensors, len(manifest.bucket_sizes))
        ranks: list[dict[int, list[RangeSpec]]] = []
        for ranges in per_bucket:
            by_rank: dict[int, list[RangeSpec]] = {}
            for r in ranges:
                by_rank.setdefault(r.rank, []).append(r)
            ranks.append(by_rank)
        self._sharded[identity] = _Sharded(manifest.version, manifest.bucket_sizes,
                                           {t.name: t.offset for t in manifest.tensors}, ranks, manifest.shards.world_size)

    def piece(self, identity: bytes, version: int, piece: wire.RankBucket, frames: list[Any],
              take: Callable[[int], Segment]) -> None:
        update = self._sharded.get(identity)
        rank, index = piece.rank, piece.index
        if update is None or update.version != version:
            raise WireError(f"trainer rank {rank} sent bucket {index} of version {piece.version}, but the update in "
                            f"progress is not one from many ranks")
        if index >= len(update.sizes):
            raise WireError(f"trainer rank {rank} sent bucket {index}; version {version} has {len(update.sizes)} buckets")
        if rank >= update.world:
            raise WireError(f"trainer rank {rank} sent bucket {index}, but it is not one of the update's ranks "
                            f"0..{update.world - 1}")
        mine = update.ranks[index].get(rank)
        if mine is None:
            raise WireError(f"trainer rank {rank} sent bytes of bucket {index}, where the shard manifest gives it no range")
        if (index, rank) in update.sent:
            raise WireError(f"trainer rank {rank} sent its ranges of bucket {index} twice")
        want = sum(r.nbytes for r in mine)
        got = len(frames[0].buffer) if len(frames) == 1 else -1
        if got != want:
            raise WireError(f"trainer rank {rank} sent {max(got, 0)} bytes of bucket {index} in {len(frames)} frame(s); "
                            f"its ranges there hold {want} bytes in one frame")
        landing = update.landing.setdefault(index, _Landing())
        if landing.segment is None:
            landing.segment = take(update.sizes[index])
        update.sent.add((index, rank))
        scatter(landing.segment.buffer, update.offsets, mine, frames[0].buffer)  # type: ignore[arg-type]
        landing.arrived.add(rank)
        if landing.announced and update.complete(index):
            self._finish(identity, update, index)

    def _finish(self, identity: bytes, update: _Sharded, index: int, error: str = "") -> None:
        landing = update.landing.pop(index)
        assert landing.segment is not None
        self._done.append(Landed(identity, update.version, index, landing.segment, error))

    @property
    def busy(self) -> bool:
        return bool(self._done)

    def poll(self) -> list[Landed]:
        done, self._done = self._done, []
        return done

    def pending_for(self, identity: bytes) -> bool:
        update = self._sharded.get(identity)
        if any(landed.identity == identity for landed in self._done):  # landed, not yet polled
            return True
        return update is not None and any(landing.announced for landing in update.landing.values())

    def tick(self) -> None:
        """A bucket whose header came but whose ranks did not all send their part within ``deadlines.bucket_s``
        fails naming them (a rank that died mid-send)."""
        if not self._sharded:
            return
        now, limit = time.monotonic(), self.config.deadlines.bucket_s
        for identity, update in list(self._sharded.items()):
            for index, landing in list(update.landing.items()):
                if landing.announced and now - landing.announced > limit:
                    late = sorted(set(update.ranks[index]) - landing.arrived)
                    self._finish(identity, update, index,
                                 f"trainer rank {late[0]} sent nothing of bucket {index} of version {update.version} "
                                 f"within {limit}s of its header" + (f" (nor did ranks {late[1:]})" if len(late) > 1 else ""))

    def drop(self, identity: bytes) -> None:
        update = self._sharded.pop(identity, None)
        if update is not None:
            for landing in update.landing.values():
                if landing.segment is not None:
                    landing.segment.close()
        for landed in [d for d in self._done if d.identity == identity]:
            self._done.remove(landed)
            landed.segment.close()

    def close(self) -> None:
        for identity in list(self._sharded):
            self.drop(identity)

    def land(self, identity: bytes, version: int, header: wire.BucketHeader, frames: list[Any], size: int,
             take: Callable[[int], Segment]) -> Segment | None:
        no_segment_name(self.kind, header)
        update = self._sharded.get(identity)
        if update is not None and update.version == version:
            if frames:
                raise WireError(f"bucket {header.index} of an update from many trainer ranks carries bytes after its "
                                f"header; each rank sends its own")
            landing = update.landing.setdefault(header.index, _Landing())
            if landing.announced:
                raise WireError(f"bucket {header.index} of version {version} announced twice")
            landing.announced = time.monotonic()
            if landing.segment is None:
                landing.segment = take(size)
            if update.complete(header.index):
                update.landing.pop(header.index)
                return landing.segment
            return None
        if len(frames) != 1 or len(frames[0].buffer) != size:
            got = len(frames[0].buffer) if frames else 0
            raise WireError(f"bucket {header.index}: {got} bytes arrived, manifest says {size} (truncated?)")
        segment = take(size)
        segment.buffer[:size] = frames[0].buffer
        return segment
