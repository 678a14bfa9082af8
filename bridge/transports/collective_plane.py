"""A collective data plane over ``torch.distributed`` process groups: NCCL on GPUs, gloo on CPU, one code.

Every group is made on a private ``TCPStore`` (the sender is its master, on an ephemeral port) and built
directly from the backend class, so it never touches ``torch.distributed``'s default group or any of
vLLM's own groups. Rank 0 is the sender; ranks 1..n receive. A bucket travels as one ``broadcast``
(fan-out: the sender's bytes leave once per link the backend needs, not once per receiver in user code).
Every operation waits at most ``timeout_s`` and raises :class:`TransportError` naming what timed out.

The publisher's :class:`CollectiveSendPlane` (``transport.kind: gloo`` or ``nccl``) offers each receiver
a rank over ZMQ (``wire.LinkOffer``), joins, and then sends every bucket point to point right after its
ZMQ header; control messages stay on ZMQ. The link lives across updates and is rebuilt after any update
that failed. The receiving end is collective_inbox.py.
"""

from __future__ import annotations

import logging
import socket
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from bridge import wire
from bridge.errors import ConfigError, TransportError
from bridge.transports import COLLECTIVE
from bridge.transports.base import OutgoingBucket, SendPlane

if TYPE_CHECKING:
    from bridge.config import BridgeConfig

logger = logging.getLogger(__name__)
BACKENDS = COLLECTIVE
STORE_PREFIX = "weight-bridge"


class CollectiveLink:
    """One end of a sender -> receivers group. ``port=0`` on the sender picks a free port (see ``port``)."""

    def __init__(self, backend: str, host: str, port: int, rank: int, world: int, timeout_s: float = 60.0,
                 join: bool = True, local_host: str = "127.0.0.1") -> None:
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ConfigError(f"unknown collective backend {backend!r}; available: {', '.join(BACKENDS)}")
        if world < 2 or not 0 <= rank < world:
            raise ConfigError(f"rank {rank} of world {world}: a link needs a sender and at least one receiver")
        self.backend, self.rank, self.world, self.timeout_s = backend, rank, world, timeout_s
        self.local_host = local_host  # gloo: the address this rank listens on for its peers
        self.device = "cpu"
        if backend == "nccl":  # one GPU per rank (NCCL refuses two ranks on one device)
            import torch

            self.device = f"cuda:{rank % max(torch.cuda.device_count(), 1)}"
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=timeout_s)
        # the sender's store listens on ``host`` only (torch's own listener would take every interface)
        listen_fd = None
        if rank == 0:
            listener = socket.create_server((host, port), backlog=max(world, 16))
            port = listener.getsockname()[1]
            listen_fd = listener.detach()  # the store owns the descriptor from here on
        try:
            self.store: Any = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout,
                                            wait_for_workers=False, master_listen_fd=listen_fd)
        except (RuntimeError, TimeoutError) as exc:
            raise TransportError(f"collective link: cannot reach the store at {host}:{port} within {timeout_s}s: {exc}") from exc
        self.host, self.port = host, int(self.store.port)
        self.pg: Any = None
        if join:
            self.join()

    def join(self) -> None:
        """Rendezvous with every other rank (blocks until all joined, at most ``timeout_s``). The sender
        makes its store with ``join=False``, tells the receivers its port, then joins."""
        import torch.distributed as dist

        backend, rank, world, timeout = self.backend, self.rank, self.world, timedelta(seconds=self.timeout_s)
        prefixed = dist.PrefixStore(STORE_PREFIX, self.store)
        try:
            if backend == "gloo":
                options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                options._timeout = timeout
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.local_host)]
                self.pg = dist.ProcessGroupGloo(prefixed, rank, world, options)
            else:
                nccl_options = dist.ProcessGroupNCCL.Options()
                nccl_options._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, nccl_options)
        except (RuntimeError, TimeoutError) as exc:
            raise TransportError(f"collective link ({backend}): rendezvous of {world} ranks failed within {self.timeout_s}s: {exc}") from exc
        logger.info("collective link %s rank %s/%s on %s:%s", backend, rank, world, self.host, self.port)

    def broadcast(self, tensor: Any, what: str = "bucket") -> None:
        """Rank 0's ``tensor`` into every receiver's ``tensor`` (same size and dtype on every rank)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self._wait(self.pg.broadcast([tensor], opts), what)

    def send(self, tensor: Any, dst: int, tag: int = 0, what: str = "bucket") -> None:
        self._wait(self.pg.send([tensor], dst, tag), what)

    def recv(self, tensor: Any, src: int = 0, tag: int = 0, what: str = "bucket") -> None:
        self._wait(self.pg.recv([tensor], src, tag), what)

    def isend(self, tensor: Any, dst: int, tag: int) -> Any:
        """Start sending; the returned work completes once the bytes left (see :meth:`settle`)."""
        return self.pg.send([tensor], dst, tag)

    def irecv(self, tensor: Any, src: int, tag: int) -> Any:
        """Start receiving into ``tensor``; poll the returned work's ``is_completed()``."""
        return self.pg.recv([tensor], src, tag)

    def settle(self, work: Any, what: str) -> None:
        """Wait for a started send or receive; raise TransportError if it failed or timed out."""
        self._wait(work, what)

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo raises on timeout or on a peer that went away
            raise TransportError(f"collective link ({self.backend}) rank {self.rank}: {what} failed or timed out "
                                 f"after {self.timeout_s}s: {exc}") from exc
        if ok is False:
            raise TransportError(f"collective link ({self.backend}) rank {self.rank}: {what} timed out after {self.timeout_s}s")

    def close(self) -> None:
        self.pg = None
        self.store = None


def link_tag(version: int, index: int) -> int:
    """The point-to-point tag of bucket ``index`` of ``version``: a bucket of an abandoned update can never
    be taken for the same bucket of the next one."""
    return ((version & 0x3FF) << 21) | (index & 0x1FFFFF)


class CollectiveSendPlane(SendPlane):
    """Buckets as point-to-point sends over a collective link (one rank per receiver, the publisher rank 0).

    Packing buffers form a ring of ``depth + 1`` slots, as on ZMQ; a slot is packed again once every
    send out of it completed. Any failed update drops the link; the next update offers a new one."""

    kind = backend = "gloo"

    @classmethod
    def from_config(cls, config: BridgeConfig) -> SendPlane:
        return cls(host=config.transport.collective_host, timeout_s=config.deadlines.connect_s)

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 60.0) -> None:
        self.host, self.timeout_s = host, timeout_s
        self._link: CollectiveLink | None = None
        self._peers: tuple[str, ...] = ()
        self._slots = 3
        self._buffers: dict[int, Any] = {}
        self._works: dict[int, list[Any]] = {}
        self.links_made = 0  # how many links this plane offered (one, unless an update failed)

    def configure(self, depth: int) -> None:
        self._slots = depth + 1

    def offers(self, endpoints: list[str]) -> list[wire.LinkOffer]:
        if self._link is not None and tuple(endpoints) == self._peers:
            return []
        self._drop()
        world = len(endpoints) + 1
        self._link = CollectiveLink(self.backend, self.host, 0, 0, world, self.timeout_s, join=False, local_host=self.host)
        self._peers = tuple(endpoints)
        self.links_made += 1
        link_id = uuid.uuid4().hex[:16]
        return [wire.LinkOffer(link_id, self.backend, self.host, self._link.port, rank, world) for rank in range(1, world)]

    def connect(self) -> None:
        if self._link is not None and self._link.pg is None:
            try:
                self._link.join()
            except TransportError:
                self._drop()
                raise

    def allocate(self, index: int, size: int) -> Any:
        import torch

        slot = index % self._slots
        self._settle(self._works.pop(slot, []), f"bucket {index - self._slots} (slot {slot})")
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < size:
            buf = self._buffers[slot] = torch.empty(size, dtype=torch.uint8)
        return buf[:size]

    @property
    def held_bytes(self) -> int:
        return sum(int(b.numel()) for b in self._buffers.values())

    def seal(self, index: int, buffer: Any) -> OutgoingBucket:
        return OutgoingBucket(index, buffer, ())

    def borrow(self, index: int, tensor: Any) -> OutgoingBucket | None:
        self._settle(self._works.pop(index % self._slots, []), f"bucket {index - self._slots} (slot {index % self._slots})")
        return OutgoingBucket(index, tensor, ())

    def push(self, version: int, out: OutgoingBucket, peer: int) -> None:
        if self._link is None or self._link.pg is None:
            raise TransportError("collective link is not connected")
        tensor = out.tensor if self._link.device == "cpu" else out.tensor.to(self._link.device, non_blocking=True)
        try:
            work = self._link.isend(tensor, peer + 1, link_tag(version, out.index))
        except RuntimeError as exc:
            raise TransportError(f"collective link ({self.backend}): send of bucket {out.index} to rank {peer + 1} failed: {exc}") from exc
        self._works.setdefault(out.index % self._slots, []).append((work, tensor))

    def _settle(self, works: list[Any], what: str) -> None:
        for work, _tensor in works:
            if self._link is None:
                return
            self._link.settle(work, what)

    def release(self, failed: bool = False) -> None:
        if failed:
            self._drop()
            return
        try:
            for slot in list(self._works):
                self._settle(self._works.pop(slot), f"slot {slot}")
        except TransportError:
            logger.warning("collective link: a send did not complete; the next update builds a new link", exc_info=True)
            self._drop()

    def _drop(self) -> None:
        self._works.clear()
        if self._link is not None:
            self._link.close()
        self._link, self._peers = None, ()

    def close(self) -> None:
        self._drop()
        self._buffers.clear()


class GlooSendPlane(CollectiveSendPlane):
    kind = backend = "gloo"


class NcclSendPlane(CollectiveSendPlane):
    """NCCL: buckets are packed on the host and copied to this rank's GPU before the send (GPU machines only)."""

    kind = backend = "nccl"
