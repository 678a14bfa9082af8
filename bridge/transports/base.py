"""The data-plane interface: each transport owns both ends. A ``SendPlane`` gives the publisher a buffer
to pack a bucket into and turns it into what travels; a ``LandPlane`` turns what arrived at a receiver
into a shared-memory segment that every TP worker on the host maps in place.

A plane lives as long as its publisher: buffers are reused from one update to the next, so packing
writes into pages already faulted in rather than fresh ones (first touch)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bridge.errors import WireError

if TYPE_CHECKING:
    from bridge import wire
    from bridge.config import BridgeConfig
    from bridge.shm import Segment


@dataclass(frozen=True)
class OutgoingBucket:
    """A packed bucket: ``tensor`` is a uint8 torch view of its bytes; ``frames`` travel after the
    header (empty when the bytes are reachable by ``segment`` name). ``delta``: the ``BucketDelta`` its
    header carries (a delta update's bucket of patches; bridge/delta.py), None for full tensors."""

    index: int
    tensor: Any
    frames: tuple[Any, ...]
    segment: str = ""
    delta: Any = None


class SendPlane(ABC):
    kind: str = ""

    @classmethod
    def from_config(cls, config: BridgeConfig) -> SendPlane:
        """A new plane for a publisher with ``config`` (planes that need settings read them here)."""
        return cls()

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

    def borrow(self, index: int, tensor: Any) -> OutgoingBucket | None:
        """Bucket ``index`` as it travels straight from ``tensor`` (a uint8 CPU torch tensor the caller owns and
        leaves untouched until the update ends), without packing it into a buffer of the plane; None where
        the plane cannot (shared memory: the bytes must lie in one of its segments), and the caller copies
        into ``allocate`` instead."""
        return None

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


@dataclass
class Landed:
    """Bucket ``index`` of ``version`` from publisher ``identity`` finished landing in ``segment`` after
    its header was handled (a collective receive); ``error`` non-empty: it did not."""

    identity: bytes
    version: int
    index: int
    segment: Segment
    error: str = ""


class LandPlane(ABC):
    """The receiving end of a transport, owned by one receiver (driven from its single socket thread).

    For each bucket header of an update over this transport, ``land`` returns the segment that holds the
    bucket's bytes, or None when they arrive later (then a later ``poll`` returns them as ``Landed``)."""

    kind: str = ""

    def __init__(self, config: BridgeConfig) -> None:
        self.config = config

    def offer(self, identity: bytes, offer: wire.LinkOffer) -> None:
        """A publisher invites this receiver into a link (collective planes only). Raises BridgeError."""
        raise WireError(f"transport {self.kind} takes no link offers")

    def begin(self, identity: bytes) -> None:  # noqa: B027 - optional hook
        """An update from ``identity`` over this plane begins: raise TransportError if it cannot arrive."""

    def expect(self, identity: bytes, manifest: wire.Manifest) -> None:
        """An update from ``identity`` begins with ``manifest``; one with ``shards`` is written by many trainer
        ranks, and a plane that cannot take their ranges refuses it here (WireError)."""
        if manifest.shards is not None:
            raise WireError(f"transport {self.kind} takes no updates from many trainer ranks (use shm or zmq)")

    def piece(self, identity: bytes, version: int, piece: wire.RankBucket, frames: list[Any],
              take: Callable[[int], Segment]) -> None:
        """Trainer rank ``piece.rank``'s ranges of a bucket of ``identity``'s sharded update arrived as
        ``frames`` (ZMQ planes only). Raises WireError naming the rank when they are not what the manifest
        assigns it."""
        raise WireError(f"transport {self.kind} takes no byte ranges from trainer ranks")

    def drop(self, identity: bytes) -> None:  # noqa: B027 - optional hook
        """``identity``'s update ended (refused, aborted, timed out): forget what of it is still landing."""

    @abstractmethod
    def land(self, identity: bytes, version: int, header: wire.BucketHeader, frames: list[Any], size: int,
             take: Callable[[int], Segment]) -> Segment | None:
        """Land bucket ``header.index`` (``size`` bytes; ``frames``: the ZMQ frames after its header) into a
        segment: one of the publisher's, or one from ``take(size)``. Raises WireError or TransportError
        naming what is wrong (then no segment of ``take`` stays open)."""

    @property
    def busy(self) -> bool:
        """Buckets are landing in the background (the receiver polls more often)."""
        return False

    def poll(self) -> list[Landed]:
        """Buckets that finished landing (or failed) since the last poll, in the order announced."""
        return []

    def pending_for(self, identity: bytes) -> bool:
        """Buckets of ``identity`` are still landing."""
        return False

    def tick(self) -> None:  # noqa: B027 - optional hook
        """Called about every loop of the receiver: housekeeping."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The receiver stops: free everything."""


def no_segment_name(kind: str, header: wire.BucketHeader) -> None:
    """A bucket header of a transport whose bytes do not lie in a publisher's segment names none."""
    if header.segment:
        raise WireError(f"bucket {header.index} names a shared-memory segment but the manifest's transport is {kind}, not shm")
