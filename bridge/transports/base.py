"""The data-plane interface. A send plane gives the publisher a buffer to pack a bucket into and
turns it into what travels; the receiver side turns what arrived into a shared-memory segment
that every TP worker on the host maps in place.

A plane lives as long as its publisher: buffers are reused from one update to the next, because on
this kind of machine writing into fresh pages (first touch) costs several times a warm copy."""

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

    def configure(self, depth: int) -> None:  # noqa: B027 - optional hook
        """Told the number of buckets in flight per receiver before each update."""

    def reusable(self, buckets: set[int]) -> None:  # noqa: B027 - optional hook
        """Buckets of the update in progress that no receiver will read again (each receiver released them
        in its credits): their buffers may take later buckets. Called before each ``allocate``."""

    @abstractmethod
    def allocate(self, index: int, size: int) -> Any:
        """A uint8 torch tensor of ``size`` bytes to pack bucket ``index`` into."""

    @abstractmethod
    def seal(self, index: int, buffer: Any) -> OutgoingBucket:
        """The packed buffer as it travels."""

    def offers(self, endpoints: list[str]) -> list[Any]:
        """Messages, one per endpoint in order, each receiver must get before the manifest (a collective
        plane invites the receivers into its link here); empty when there is nothing to join."""
        return []

    def connect(self) -> None:  # noqa: B027 - optional hook
        """The offers were sent: finish joining (the collective rendezvous). Raises TransportError."""

    def sent(self, index: int, tracker: Any) -> None:  # noqa: B027 - optional hook
        """The frames of bucket ``index`` were handed to one socket; ``tracker`` says when they left."""

    def push(self, version: int, out: OutgoingBucket, peer: int) -> None:  # noqa: B027 - optional hook
        """Send bucket ``out`` of ``version`` to receiver number ``peer`` out of band, right after its
        header (planes whose bytes do not travel as ZMQ frames or shared memory)."""

    @property
    def held_bytes(self) -> int:
        """Bytes of packing buffers this plane keeps for the next update."""
        return 0

    def release(self, failed: bool = False) -> None:
        """The update is over (every receiver answered, ``failed`` if any refused or went away); buffers
        may be kept for the next one."""
        return None  # noqa: B027 - optional hook; most planes hold nothing

    def close(self) -> None:
        """Free everything (the publisher closes)."""
        self.release()
