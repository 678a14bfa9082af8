"""Streaming mode (``sync.mode: streaming``) on the engine side: the layerwise reload is opened when an
update begins, each verified bucket is loaded while the next one arrives, and the reload is finished
at the end. The receiver calls these in order on its single apply thread.

Memory: the inference side holds at most ``transport.depth`` received buckets (a bucket's credit goes
back once it is loaded) plus the layer vLLM buffers until all its tensors arrived. The price: once the
first bucket was loaded, a failure (bad checksum, dead publisher, error in a loader) leaves the engine
with a mix of versions, so it is marked degraded until a complete update arrives, exactly as a staged
update that fails after loading began.

Generation waits while a streaming update is open: the engine lock is taken in ``stream_begin`` and
released in ``stream_finish`` / ``stream_abort`` (all on the same thread).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from bridge import wire
from inference_side.receiver import ApplyResult, StagedBucket

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    version: int
    started: float
    begun: bool = False
    errors: list[str] = field(default_factory=list)
    load_s: float = 0.0
    held: frozenset[str] = frozenset()  # receive segments some rank still maps (a layer not yet complete)


def bucket_payload(bucket: StagedBucket) -> dict[str, Any]:
    return {"segment": bucket.segment.name, "size": bucket.segment.size,
            "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in bucket.specs]}


class StreamingGate:
    """Mixed into InferenceServer; uses its ``_lock``, ``llm``, ``config``, ``_version``, ``_degraded``,
    ``_record`` and ``_probe``."""

    _stream: _Stream | None = None
    # provided by InferenceServer
    _lock: Any
    llm: Any
    config: Any
    name: str
    _version: int
    _degraded: str | None
    _records: Any
    _record: Any
    _probe: Any

    def _rank_errors(self, reports: list[dict[str, Any]]) -> list[str]:
        return [f"rank {r.get('rank')}: {r['error']}" for r in reports if not r.get("ok")]

    def stream_begin(self, manifest: wire.Manifest) -> None:
        self._lock.acquire()
        stream = self._stream = _Stream(manifest.version, time.perf_counter())
        if manifest.version < self._version:
            stream.errors.append(f"VersionError: version {manifest.version} is older than the served version {self._version}")
            return
        cfg = self.config.router
        options = {"router": cfg.enabled, "audit": cfg.audit, "identity": cfg.identity_check}
        names = [s.name for s in manifest.tensors]
        reports = self.llm.collective_rpc("wb_stream_begin", args=(names, options))
        stream.begun = True
        stream.errors.extend(self._rank_errors(reports))

    def stream_load(self, manifest: wire.Manifest, bucket: StagedBucket) -> str:
        """Load one verified bucket on every rank; return an error ("" when loaded)."""
        stream = self._stream
        if stream is None or stream.version != manifest.version:
            return f"bucket {bucket.index} of version {manifest.version} arrived outside its streaming update"
        if stream.errors:
            return stream.errors[0]
        t0 = time.perf_counter()
        reports = self.llm.collective_rpc("wb_stream_load", args=(bucket_payload(bucket),))
        stream.load_s += time.perf_counter() - t0
        stream.held = frozenset(name for r in reports for name in r.get("held", []))
        stream.errors.extend(self._rank_errors(reports))
        return stream.errors[0] if stream.errors else ""

    def stream_held(self) -> frozenset[str]:
        """Names of receive segments a worker still maps; the receiver reuses only the others."""
        stream = self._stream
        return stream.held if stream is not None else frozenset()

    def stream_finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        stream = self._stream
        try:
            if stream is None or stream.version != manifest.version:
                return ApplyResult(False, f"no streaming update of version {manifest.version} is open")
            reports: list[dict[str, Any]] = []
            t0 = time.perf_counter()
            if not stream.errors:
                reports = self.llm.collective_rpc("wb_stream_finish")
                stream.errors.extend(self._rank_errors(reports))
            extra = {"apply": stream.load_s + time.perf_counter() - t0, "stream_load": stream.load_s,
                     "stream_total": time.perf_counter() - stream.started}
            if stream.errors:
                reason = " | ".join(stream.errors)
                self._close_failed(stream, reason)
                return self._record(manifest, False, reason, extra, timings, reports)
            self.llm.reset_prefix_cache()
            self._version = manifest.version
            self._degraded = None
            probe = self._probe(manifest.probe) if manifest.probe and self.config.probe.enabled else {}
            return self._record(manifest, True, "", extra, timings, reports, probe)
        finally:
            self._release_stream()

    def stream_abort(self, manifest: wire.Manifest, reason: str) -> None:
        stream = self._stream
        if stream is None or stream.version != manifest.version:
            return
        try:
            self._close_failed(stream, reason)
            from bridge.records import SyncRecord

            self._records.append(SyncRecord(version=manifest.version, engine=self.name, ok=False,
                                            reason=f"streaming update aborted: {reason}"))
        finally:
            self._release_stream()

    def _close_failed(self, stream: _Stream, reason: str) -> None:
        """End the worker-side reload (kernel tensors back in place); degraded if loading had begun."""
        if not stream.begun:
            return
        self.llm.collective_rpc("wb_stream_abort")
        self._degraded = f"streaming update to v{stream.version} failed after loading began: {reason}"
        stream.begun = False
        logger.warning("%s", self._degraded)

    def _release_stream(self) -> None:
        if self._stream is not None:
            self._stream = None
            self._lock.release()
