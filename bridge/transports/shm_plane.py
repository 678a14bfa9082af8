"""Same-host shared memory: the trainer packs each bucket once into a segment; receivers on the
host (and every TP worker behind them) map it in place. Zero copies on the wire."""

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

        seg = Segment.create("bucket", size)
        self._segments[index] = seg
        return torch.frombuffer(seg.mm, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)

    def seal(self, index: int, buffer: Any) -> OutgoingBucket:
        return OutgoingBucket(index, buffer, (), segment=self._segments[index].name)

    def release(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
