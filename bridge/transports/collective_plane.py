"""A collective data plane over ``torch.distributed`` process groups: NCCL on GPUs, gloo on CPU, one code.

Every group is made on a private ``TCPStore`` (the sender is its master, on an ephemeral port) and built
directly from the backend class, so it never touches ``torch.distributed``'s default group or any of
vLLM's own groups. Rank 0 is the sender; ranks 1..n receive. A bucket travels as one ``broadcast``
(fan-out: the sender's bytes leave once per link the backend needs, not once per receiver in user code).
Every operation waits at most ``timeout_s`` and raises :class:`TransportError` naming what timed out.

Status: the link is exercised by tests at the transport level (tests/test_collective_plane.py); the
publisher/receiver pair does not use it yet (they move buckets over ZMQ or shared memory).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from bridge.errors import ConfigError, TransportError

logger = logging.getLogger(__name__)
BACKENDS = ("gloo", "nccl")
STORE_PREFIX = "weight-bridge"


class CollectiveLink:
    """One end of a sender -> receivers group. ``port=0`` on the sender picks a free port (see ``port``)."""

    def __init__(self, backend: str, host: str, port: int, rank: int, world: int, timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ConfigError(f"unknown collective backend {backend!r}; available: {', '.join(BACKENDS)}")
        if world < 2 or not 0 <= rank < world:
            raise ConfigError(f"rank {rank} of world {world}: a link needs a sender and at least one receiver")
        self.backend, self.rank, self.world, self.timeout_s = backend, rank, world, timeout_s
        self.device = "cpu"
        if backend == "nccl":  # one GPU per rank (NCCL refuses two ranks on one device)
            import torch

            self.device = f"cuda:{rank % max(torch.cuda.device_count(), 1)}"
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=timeout_s)
        try:
            self.store: Any = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, TimeoutError) as exc:
            raise TransportError(f"collective link: cannot reach the store at {host}:{port} within {timeout_s}s: {exc}") from exc
        self.host, self.port = host, int(self.store.port)
        prefixed = dist.PrefixStore(STORE_PREFIX, self.store)
        try:
            if backend == "gloo":
                self.pg: Any = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, options)
        except (RuntimeError, TimeoutError) as exc:
            raise TransportError(f"collective link ({backend}): rendezvous of {world} ranks failed within {timeout_s}s: {exc}") from exc
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
