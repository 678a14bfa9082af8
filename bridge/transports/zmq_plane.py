"""ZMQ data plane: bucket bytes travel as one zero-copy frame after the header (tcp:// or ipc://).

Packing buffers form a ring of ``depth + 1`` slots reused across buckets and updates; a slot is
packed again only once ZMQ has let go of its last frame (a MessageTracker per socket it went to);
a slot still held after ``WAIT_S`` (a slow or dead receiver) is abandoned to ZMQ and replaced."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bridge.errors import WireError
from bridge.transports.base import LandPlane, OutgoingBucket, SendPlane, no_segment_name

if TYPE_CHECKING:
    from bridge import wire
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


class ZmqLandPlane(LandPlane):
    """The bytes came as the one frame after the header: copied into a receive segment."""

    kind = "zmq"

    def land(self, identity: bytes, version: int, header: wire.BucketHeader, frames: list[Any], size: int,
             take: Callable[[int], Segment]) -> Segment | None:
        no_segment_name(self.kind, header)
        if len(frames) != 1 or len(frames[0].buffer) != size:
            got = len(frames[0].buffer) if frames else 0
            raise WireError(f"bucket {header.index}: {got} bytes arrived, manifest says {size} (truncated?)")
        segment = take(size)
        segment.buffer[:size] = frames[0].buffer
        return segment
