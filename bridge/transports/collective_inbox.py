"""The receiving end of the collective data plane (``transport.kind: gloo`` / ``nccl``); the sending end
is collective_plane.py.

A publisher offers a link over ZMQ (``wire.LinkOffer``); the inbox joins it on a helper thread (the
rendezvous blocks until every rank joined) and keeps it across updates, one link per publisher. For each
bucket header the receiver posts a point-to-point receive straight into the bucket's shared-memory
segment (NCCL: into a GPU buffer, copied into the segment once complete) and polls it from its loop, so
heartbeats and other publishers are never blocked behind a transfer.

Buckets still on the link when an update is refused are not consumed: the publisher drops its link after
any failed update (so no stale send can match a later receive) and offers a new one with the next
update. A receive that fails or outlives ``deadlines.bucket_s`` drops this side's link too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bridge import wire
from bridge.errors import TransportError, WireError
from bridge.shm import Segment
from bridge.transports.base import Landed, LandPlane, no_segment_name

if TYPE_CHECKING:
    from bridge.config import BridgeConfig

logger = logging.getLogger(__name__)


@dataclass
class PendingRecv:
    """One posted receive: bucket ``index`` of ``version`` from ``identity`` into ``segment``."""

    identity: bytes
    version: int
    index: int
    segment: Segment
    posted: float
    work: Any = None
    done: Future[None] | None = None  # the link's waiter thread finished waiting for ``work``
    tensor: Any = None  # what the backend writes into (a view of the segment, or a GPU buffer)
    error: str = ""
    link: Any = field(default=None, repr=False)

    def finish(self) -> None:
        """Wait for the completed receive and land its bytes in the segment; sets ``error`` on failure."""
        try:
            assert self.done is not None
            self.done.result()
            if self.tensor is not None and self.tensor.device.type != "cpu":
                import torch

                view = torch.frombuffer(self.segment.mm, dtype=torch.uint8, count=self.tensor.numel())
                view.copy_(self.tensor)
                del view
        except TransportError as exc:
            self.error = str(exc)
        self.tensor = self.work = None


@dataclass
class _Link:
    offer: wire.LinkOffer
    joining: Future[Any]
    # gloo marks a receive complete only inside ``wait()``: one thread per link waits for its receives
    # in order and the receiver's loop polls the futures
    waiter: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="wb-link-wait"))


class CollectiveInbox:
    def __init__(self, connect_s: float, bucket_s: float, local_host: str = "127.0.0.1") -> None:
        self.connect_s, self.bucket_s = connect_s, bucket_s
        self.local_host = local_host  # where this side's gloo pairs listen (transport.bind_host)
        self._links: dict[bytes, _Link] = {}
        self._pending: list[PendingRecv] = []
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="wb-link")

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def offer(self, identity: bytes, offer: wire.LinkOffer) -> None:
        """Join the offered link (in the background); an older link of the same publisher is dropped."""
        old = self._links.get(identity)
        if old is not None and old.offer.link == offer.link:
            return
        self.drop(identity)
        from bridge.transports.collective_plane import CollectiveLink

        logger.info("joining %s link %s as rank %s/%s via %s:%s", offer.backend, offer.link, offer.rank, offer.world, offer.host, offer.port)
        self._links[identity] = _Link(offer, self._pool.submit(
            CollectiveLink, offer.backend, offer.host, offer.port, offer.rank, offer.world, self.connect_s, True, self.local_host))

    def has_link(self, identity: bytes) -> bool:
        return identity in self._links

    def _link(self, identity: bytes) -> Any:
        entry = self._links.get(identity)
        if entry is None:
            raise TransportError("no collective link from this publisher (it must send a link offer before the manifest)")
        try:
            return entry.joining.result(timeout=self.connect_s)
        except TimeoutError as exc:
            self.drop(identity)
            raise TransportError(f"collective link {entry.offer.link}: not joined within {self.connect_s}s") from exc
        except TransportError:
            self.drop(identity)
            raise

    def post(self, identity: bytes, version: int, index: int, segment: Segment, size: int) -> None:
        """Start receiving bucket ``index`` (``size`` bytes) into ``segment``; raises TransportError without a usable link."""
        import torch

        from bridge.transports.collective_plane import link_tag

        link = self._link(identity)
        waiter = self._links[identity].waiter
        if link.device == "cpu":
            tensor = torch.frombuffer(segment.mm, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)
        else:
            tensor = torch.empty(size, dtype=torch.uint8, device=link.device)
        try:
            work = link.irecv(tensor, 0, link_tag(version, index))
        except RuntimeError as exc:
            self.drop(identity)
            raise TransportError(f"collective link: cannot receive bucket {index}: {exc}") from exc
        done = waiter.submit(link.settle, work, f"bucket {index} of version {version}")
        self._pending.append(PendingRecv(identity, version, index, segment, time.monotonic(), work, done, tensor, link=link))

    def poll(self) -> list[PendingRecv]:
        """Receives that completed (or failed, or timed out) since the last poll, in posting order."""
        done: list[PendingRecv] = []
        now = time.monotonic()
        waiting: set[bytes] = set()  # a publisher's buckets are handed on in the order they were announced
        for recv in list(self._pending):
            if recv.identity in waiting:
                continue
            if recv.done is not None and recv.done.done():
                recv.finish()
            elif now - recv.posted > self.bucket_s:
                recv.error = f"no bytes for bucket {recv.index} over the collective link within {self.bucket_s}s (deadlines.bucket_s)"
                recv.tensor = None  # the segment stays mapped by the backend's buffer until the link drops
            else:
                waiting.add(recv.identity)
                continue
            self._pending.remove(recv)
            if recv.error:
                logger.warning("collective receive of bucket %s failed: %s", recv.index, recv.error)
                current = self._links.get(recv.identity)
                if current is not None and current.joining.done() and not current.joining.exception() \
                        and current.joining.result() is recv.link:
                    self.drop(recv.identity)  # not a newer link offered meanwhile
            done.append(recv)
        return done

    def pending_for(self, identity: bytes) -> bool:
        return any(r.identity == identity for r in self._pending)

    def drop(self, identity: bytes) -> None:
        """Forget ``identity``'s link; its receives still in flight fail as the link goes away."""
        entry = self._links.pop(identity, None)
        if entry is None:
            return
        entry.waiter.shutdown(wait=False, cancel_futures=True)
        if entry.joining.done() and entry.joining.exception() is None:
            entry.joining.result().close()
        logger.info("dropped collective link %s", entry.offer.link)

    def close(self) -> None:
        for identity in list(self._links):
            self.drop(identity)
        for recv in self._pending:
            recv.tensor = recv.work = None
            recv.segment.close()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


class CollectiveLandPlane(LandPlane):
    """Buckets arrive over a link the publisher offered (one per publisher, kept across updates)."""

    def __init__(self, config: BridgeConfig) -> None:
        super().__init__(config)
        self._inbox = CollectiveInbox(config.deadlines.connect_s, config.deadlines.bucket_s, config.transport.bind_host)

    def offer(self, identity: bytes, offer: wire.LinkOffer) -> None:
        self._inbox.offer(identity, offer)

    def begin(self, identity: bytes) -> None:
        if not self._inbox.has_link(identity):
            raise TransportError(f"transport {self.kind} needs a collective link, and this publisher offered none "
                                 "(or it was dropped after a failure)")

    def land(self, identity: bytes, version: int, header: wire.BucketHeader, frames: list[Any], size: int,
             take: Callable[[int], Segment]) -> Segment | None:
        no_segment_name(self.kind, header)
        if frames:
            raise WireError(f"bucket {header.index}: bytes arrived as a ZMQ frame, but the transport is {self.kind}")
        segment = take(size)
        try:
            self._inbox.post(identity, version, header.index, segment, size)
        except BaseException:
            segment.close()
            raise
        return None

    @property
    def busy(self) -> bool:
        return self._inbox.busy

    def poll(self) -> list[Landed]:
        return [Landed(r.identity, r.version, r.index, r.segment, r.error) for r in self._inbox.poll()]

    def pending_for(self, identity: bytes) -> bool:
        return self._inbox.pending_for(identity)

    def close(self) -> None:
        self._inbox.close()


class GlooLandPlane(CollectiveLandPlane):
    kind = "gloo"


class NcclLandPlane(CollectiveLandPlane):
    kind = "nccl"
