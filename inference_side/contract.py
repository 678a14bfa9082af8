"""The engine contract: every call a ``SyncReceiver`` makes on what stands behind it (an engine, a relay).

One lifecycle for every update, staged or streaming::

    info()                      # on Hello: what the engine serves and takes
    validate(manifest)          # on Begin: raise if it cannot be taken; a reason string if already served
    begin(manifest)             # the update opens (streaming: at Begin; staged: once every bucket is verified)
    load(manifest, bucket)      # each verified bucket, in index order
    finish(manifest, timings)   # every bucket was loaded: apply, audit, answer
    abort(manifest, reason)     # instead of finish, when the update is abandoned

``begin``, ``load``, ``finish`` and ``abort`` run on the receiver's single apply thread, one at a time and
in this order; ``load`` may report a failure, after which the receiver calls ``finish`` (which reports
that failure) or ``abort``. A staged update makes the same calls as a streaming one, only later: the
receiver first holds and verifies every bucket, so nothing reaches the engine unless all of it arrived
intact. No call keeps a lock held when it returns; an engine keeps its own state between calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from bridge import wire
from bridge.report import ApplyResult, LoadResult
from bridge.shm import Segment

__all__ = ["ApplyResult", "EngineGate", "LoadResult", "StagedBucket"]


@dataclass
class StagedBucket:
    """A verified bucket lying complete in ``segment`` (mapped by name in every TP worker)."""

    index: int
    segment: Segment
    specs: list[wire.TensorSpec]
    checksums: tuple[int, ...] = ()  # as the bucket's header gave them (a relay forwards them)

    def payload(self) -> dict[str, Any]:
        """The bucket as a TP worker's ``wb_load`` takes it: segment name, size and tensor layout."""
        return {"segment": self.segment.name, "size": self.segment.size,
                "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.specs]}


class EngineGate(ABC):
    """What a receiver drives. Implementations: ``InferenceServer`` (a vLLM engine), ``RelayGate`` (a host
    relay that forwards to local engines), and the tests' ``FakeEngine``."""

    @abstractmethod
    def info(self) -> wire.EngineInfo:
        """The answer to a publisher's Hello."""

    @abstractmethod
    def validate(self, manifest: wire.Manifest) -> str | None:
        """Raise a ``BridgeError`` naming the problem for a manifest this engine cannot take; return a
        reason when ``manifest.version`` is already served (the update is then a no-op), else None."""

    @abstractmethod
    def begin(self, manifest: wire.Manifest) -> None:
        """Open the update. A problem found here is reported by the next ``load`` or ``finish``."""

    @abstractmethod
    def load(self, manifest: wire.Manifest, bucket: StagedBucket) -> LoadResult:
        """Load one verified bucket. ``LoadResult.error`` non-empty: the update failed (the receiver then
        calls ``finish`` or ``abort``)."""

    @abstractmethod
    def finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        """Close the update: applied (ok) or refused with a kind and reason; the update is over either way."""

    @abstractmethod
    def abort(self, manifest: wire.Manifest, reason: str) -> None:
        """Close the update without applying it (the publisher went away, a deadline passed)."""
