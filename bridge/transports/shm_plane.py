"""Same-host shared memory: the trainer packs each bucket once into a segment; receivers on the
host (and every TP worker behind them) map it in place. Zero copies on the wire.

Segments are kept per bucket index and reused by the next update (receivers may map a bucket until
they acknowledge, so a segment is rewritten only by a later update); ``close`` unlinks them. After a
failed update they are not reused: an engine whose apply ran past its deadline may still be reading
them, so the next update writes into fresh segments."""

from __future__ import annotations

from typing import Any

from bridge.shm import Segment
from bridge.transports.base import OutgoingBucket, SendPlane


class ShmSendPlane(SendPlane):
    kind = "shm"

    def __init__(self) -> None:
        self._segments: dict[int, Segment] = {}

    def allocate(self, index: int, size: int) -> Any:
        import torch

        seg = self._segments.get(index)
        if seg is None or seg.size != size:
            if seg is not None:
                seg.close()
            seg = self._segments[index] = Segment.create("bucket", size)
        return torch.frombuffer(seg.mm, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)

    def seal(self, index: int, buffer: Any) -> OutgoingBucket:
        return OutgoingBucket(index, buffer, (), segment=self._segments[index].name)

    def release(self, failed: bool = False) -> None:
        if failed:
            self.close()

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
