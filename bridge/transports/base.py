"""The data-plane interface. A send plane gives the publisher a buffer to pack a bucket into and
turns it into what travels; the receiver side turns what arrived into a shared-memory segment
that every TP worker on the host maps in place."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OutgoingBucket:
    """A packed bucket: ``tensor`` is a uint8 torch view of its bytes; ``frames`` travel after the
    header (empty when the bytes are reachable by ``segment`` name)."""

    index: int
    tensor: Any
    frames: tuple[Any, ...]
    segment: str = ""


class SendPlane(ABC):
    kind: str = ""

    @abstractmethod
    def allocate(self, index: int, size: int) -> Any:
        """A uint8 torch tensor of ``size`` bytes to pack bucket ``index`` into."""

    @abstractmethod
    def seal(self, index: int, buffer: Any) -> OutgoingBucket:
        """The packed buffer as it travels."""

    def release(self) -> None:
        """Free everything held for the last update (called once every receiver answered)."""
        return None  # noqa: B027 - optional hook; most planes hold nothing
