"""ZMQ data plane: bucket bytes travel as one zero-copy frame after the header (tcp:// or ipc://)."""

from __future__ import annotations

from typing import Any

from bridge.transports.base import OutgoingBucket, SendPlane


class ZmqSendPlane(SendPlane):
    kind = "zmq"

    def allocate(self, index: int, size: int) -> Any:
        import torch

        return torch.empty(size, dtype=torch.uint8)

    def seal(self, index: int, buffer: Any) -> OutgoingBucket:
        return OutgoingBucket(index, buffer, (memoryview(buffer.numpy()),))
