"""Same-host shared memory: the trainer packs each bucket once into a segment; receivers on the
host (and every TP worker behind them) map it in place. Zero copies on the wire.

A segment is rewritten only once no receiver will read it again: within an update, when every receiver
released its bucket in a credit (streaming receivers do once the bucket is loaded and no incomplete
layer holds it), else by a later update. So staged receivers get one segment per bucket (the whole
update lies in /dev/shm until they answer) and streaming ones a ring of about ``depth`` + 1 segments
plus those an incomplete layer holds. Segments are kept for the next update (warm pages, and receivers
keep them mapped); a bucket takes the smallest free segment that fits, the one freed last among equals,
so a streaming update cycles through as few as it needs and the rest are unlinked when it ends. After a
failed update they are not reused: an engine whose apply ran past its deadline may still be reading
them, so the next update writes into fresh segments; ``close`` unlinks them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bridge.errors import WireError
from bridge.shm import AttachCache, Segment
from bridge.transports.base import LandPlane, OutgoingBucket, SendPlane

if TYPE_CHECKING:
    from bridge import wire
    from bridge.config import BridgeConfig

PRUNE_EVERY_S = 1.0


class ShmSendPlane(SendPlane):
    kind = "shm"

    def __init__(self) -> None:
        self._all: list[Segment] = []
        self._free: list[Segment] = []
        self._use: dict[int, Segment] = {}  # bucket index -> its segment in the update in progress
        self._reused: set[int] = set()  # buckets of this update whose segment went back to _free

    def configure(self, depth: int) -> None:
        """An update begins: every segment is free (the previous update was answered)."""
        self._use = {}
        self._free = list(self._all)
        self._reused = set()

    def reusable(self, buckets: set[int]) -> None:
        for index in buckets - self._reused:
            seg = self._use.get(index)
            if seg is not None:
                self._reused.add(index)
                self._free.append(seg)

    def allocate(self, index: int, size: int) -> Any:
        import torch

        seg = self._use[index] = self._take(size)
        return torch.frombuffer(seg.mm, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)

    def _take(self, size: int) -> Segment:
        fits = [i for i, s in enumerate(self._free) if s.size >= size]
        if not fits:
            seg = Segment.create("bucket", size)
            self._all.append(seg)
            return seg
        return self._free.pop(min(fits, key=lambda i: (self._free[i].size, -i)))

    def seal(self, index: int, buffer: Any) -> OutgoingBucket:
        return OutgoingBucket(index, buffer, (), segment=self._use[index].name)

    @property
    def held_bytes(self) -> int:
        return sum(s.size for s in self._all)  # in /dev/shm

    def release(self, failed: bool = False) -> None:
        if failed:
            self.close()
            return
        if not self._use:  # nothing packed here (a relay's forward sends segments it does not own)
            return
        used = {id(s) for s in self._use.values()}
        for seg in [s for s in self._all if id(s) not in used]:  # not needed by the last update: let go
            seg.close()
        self._all = [s for s in self._all if id(s) in used]

    def close(self) -> None:
        for seg in self._all:
            seg.close()
        self._all, self._free, self._use, self._reused = [], [], {}, set()


class ShmLandPlane(LandPlane):
    """The bytes lie in the publisher's segment, named by the header: mapped once and kept (segments whose
    file is gone are unmapped about once a second)."""

    kind = "shm"

    def __init__(self, config: BridgeConfig) -> None:
        super().__init__(config)
        self._attached = AttachCache()
        self._pruned = 0.0

    def expect(self, identity: bytes, manifest: wire.Manifest) -> None:
        """Every update lands here, one from many trainer ranks too: each rank wrote its ranges into the
        publisher's segments (trainer_side/multi_rank.py)."""

    def land(self, identity: bytes, version: int, header: wire.BucketHeader, frames: list[Any], size: int,
             take: Callable[[int], Segment]) -> Segment | None:
        if not header.segment:
            raise WireError(f"bucket {header.index}: the transport is shm but its header names no segment")
        return self._attached.attach(header.segment, size)

    def tick(self) -> None:
        now = time.monotonic()
        if len(self._attached) and now - self._pruned >= PRUNE_EVERY_S:
            self._pruned = now
            self._attached.prune()

    def close(self) -> None:
        self._attached.close()
