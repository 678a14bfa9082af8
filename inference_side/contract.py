"""The engine contract: every call a ``SyncReceiver`` makes on what stands behind it (an engine, a relay).

One lifecycle for every update, staged or streaming::

    info()                      # on Hello: what the engine serves and takes
    validate(manifest)          # on Begin: raise if it cannot be taken; a reason string if already served
    begin(manifest, restore)    # the update opens (streaming, and a delta the receiver patches in its base store
                                #   when the gate ``restores``: at Begin; staged: once every bucket is verified)
    load_many(manifest, buckets)  # the verified buckets ready to load, in index order (several when several
                                #   are ready); by default ``load(manifest, bucket)`` for each
    finish(manifest, timings)   # every bucket was loaded: apply, audit, answer
    abort(manifest, reason)     # instead of finish, when the update is abandoned

``begin``, ``load_many``, ``finish`` and ``abort`` run on the receiver's single apply thread, one at a time and
in this order; every bucket goes through ``load_many`` exactly once, and the runs of buckets follow each other
in index order. A load may report a failure, after which the receiver calls ``finish`` (which reports
that failure) or ``abort``. A staged update makes the same calls as a streaming one, only later: the
receiver first holds and verifies every bucket, so nothing reaches the engine unless all of it arrived
intact. One exception keeps staged mode's "old or new" by another means: a delta update the receiver patches
in place in its own copy of the served version (inference_side/delta_base.py) is loaded bucket by bucket as
each is verified, but only into a gate that ``restores``: ``begin`` then gets ``restore``, which gives the
served version's full buckets back (the copy, rolled back), and a gate whose update fails or is aborted
after loading began loads those before it answers, so the engine serves the version it served before.
No call keeps a lock held when it returns; an engine keeps its own state between calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bridge import wire
from bridge.report import ApplyResult, LoadResult
from bridge.shm import Segment

__all__ = ["LOAD_RUN_MAX", "ApplyResult", "EngineGate", "LoadResult", "Restore", "StagedBucket"]


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


# the most buckets the receiver hands an engine in one ``load_many``: one call per run of ready buckets instead of
# one per bucket, each call still bounded (at 64 MB buckets, 512 MB)
LOAD_RUN_MAX = 8

Restore = Callable[[], list["StagedBucket"]]
"""The served version's full buckets, for a gate to load back after a failed update that had begun loading
(every tensor of the model, verified when they were applied; the receiver's delta base rolled back)."""


class EngineGate(ABC):
    """What a receiver drives. Implementations: ``InferenceServer`` (a vLLM engine), ``RelayGate`` (a host
    relay that forwards to local engines), and the tests' ``FakeEngine``."""

    #: True: ``begin`` honours ``restore`` (see the module's docstring); the receiver loads a delta patched in
    #: its base store before the last bucket arrived only into such a gate
    restores: bool = False

    @abstractmethod
    def info(self) -> wire.EngineInfo:
        """The answer to a publisher's Hello."""

    @abstractmethod
    def validate(self, manifest: wire.Manifest) -> str | None:
        """Raise a ``BridgeError`` naming the problem for a manifest this engine cannot take; return a
        reason when ``manifest.version`` is already served (the update is then a no-op), else None."""

    @abstractmethod
    def begin(self, manifest: wire.Manifest, restore: Restore | None = None) -> None:
        """Open the update. A problem found here is reported by the next ``load`` or ``finish``. ``restore``
        (only to a gate that ``restores``): should the update fail or be aborted once a bucket was loaded, load
        ``restore()``'s buckets (the served version) before answering, and say so in the reason."""

    @abstractmethod
    def load(self, manifest: wire.Manifest, bucket: StagedBucket) -> LoadResult:
        """Load one verified bucket. ``LoadResult.error`` non-empty: the update failed (the receiver then
        calls ``finish`` or ``abort``)."""

    def load_many(self, manifest: wire.Manifest, buckets: list[StagedBucket]) -> LoadResult:
        """Load verified buckets, in the order given (index order): what the receiver calls, with every bucket
        that is ready when the apply thread gets to it (at most ``LOAD_RUN_MAX``). The default loads each with
        ``load`` and stops at the first failure; an engine for which one call per run is cheaper than one per
        bucket (an RPC to its workers) overrides it. The result is that of the last ``load`` made."""
        result = LoadResult()
        for bucket in buckets:
            result = self.load(manifest, bucket)
            if result.error:
                break
        return result

    @abstractmethod
    def finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        """Close the update: applied (ok) or refused with a kind and reason; the update is over either way."""

    @abstractmethod
    def abort(self, manifest: wire.Manifest, reason: str) -> None:
        """Close the update without applying it (the publisher went away, a deadline passed)."""
