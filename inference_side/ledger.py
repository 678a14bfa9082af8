"""An engine's sync records: built from what the receiver and the engine's lifecycle produce, kept in a ring.

One ``SyncRecord`` per update per engine (bridge/records.py) is what metrics, the JSON API and the dashboard
read. ``InferenceServer`` (a ``vllm.LLM`` behind a receiver) and the ``weight_bridge`` vLLM backend's
``WeightBridgeEngine`` (a receiver in each worker of ``vllm serve``) build them with the same functions:

* ``sync_record``: an update that reached the engine's ``finish`` (applied, or refused with a kind), with
  seconds by phase and the audit figures of the ranks' ``RankReport``s;
* ``event_record``: what the receiver refused or dropped before the engine finished it (its ``on_event``
  events ``refused``, ``timeout``, ``aborted``, ``conflict``).

``RecordingGate`` wraps an engine gate so that every ``finish`` leaves its record in a ``Ledger`` without
the engine building one itself (the vLLM backend's gate); ``Ledger.dicts(since)`` is what a receiver answers
to an operator's ``StatusRequest``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from bridge import wire
from bridge.delta import wire_telemetry
from bridge.records import SyncRecord
from bridge.report import ApplyResult, FailureKind, LoadResult, RankReport
from inference_side.contract import EngineGate, Restore, StagedBucket

EVENTS = ("refused", "timeout", "aborted", "conflict")  # receiver events that end an update unapplied


def sync_record(engine: str, manifest: wire.Manifest, ok: bool, reason: str, timings: dict[str, float],
                ranks: list[RankReport], *, extra: dict[str, float] | None = None, kind: FailureKind | None = None,
                probe: dict[str, Any] | None = None) -> SyncRecord:
    """The record of an update the engine finished: ``timings`` (the receiver's phases), ``extra`` (the
    engine's own), each rank phase's slowest rank, and ``total`` (manifest in -> applied: what GB/s and the
    charts use); the audit figures of the ranks that answered ok."""
    seconds = dict(timings)
    seconds.update(extra or {})
    for phase in ("load", "finalize", "verify"):
        vals = [r.seconds.get(phase, 0.0) for r in ranks if r.ok and phase in r.seconds]
        if vals:
            seconds[phase] = max(vals)
    seconds.setdefault("total", seconds.get("stream_total", seconds.get("transfer", 0.0) + seconds.get("apply", 0.0)))
    return SyncRecord(
        version=manifest.version, engine=engine, ok=ok, reason=reason, kind=kind.value if kind else "",
        bytes=manifest.total_bytes, tensors=len(manifest.tensors), seconds=seconds,
        tensors_audited=sum(r.tensors for r in ranks if r.ok),
        stale_tensors=tuple(s for r in ranks for s in r.stale),
        identity_violations=tuple(v for r in ranks for v in r.identity_violations),
        routed_sinks=max((len(r.routed_sinks) for r in ranks), default=0),
        routed_bypass=max((len(r.routed_bypass) for r in ranks), default=0),
        transport=manifest.transport,
        adapter=manifest.adapter.name if manifest.adapter is not None else "",
        **wire_telemetry(manifest),
        **(probe or {}),
    )


def event_record(engine: str, event: str, data: dict[str, Any]) -> SyncRecord | None:
    """The failed record of a receiver event that ended an update unapplied; None for any other event."""
    if event not in EVENTS:
        return None
    return SyncRecord(version=int(data.get("version", 0)), engine=engine, ok=False,
                      reason=f"{event}: {data.get('reason', '')}", kind=str(data.get("kind", "")),
                      adapter=str(data.get("adapter", "")))


class Ledger:
    """The newest ``history`` records of one engine; appended from the receiver's threads, read from any."""

    def __init__(self, engine: str, history: int = 2000) -> None:
        self.engine = engine
        self._records: deque[SyncRecord] = deque(maxlen=history)
        self._lock = threading.Lock()

    def add(self, record: SyncRecord) -> None:
        with self._lock:
            self._records.append(record)

    def event(self, event: str, data: dict[str, Any]) -> None:
        record = event_record(self.engine, event, data)
        if record is not None:
            self.add(record)

    def failed(self, version: int, kind: FailureKind, reason: str, adapter: str = "") -> None:
        self.add(SyncRecord(version=version, engine=self.engine, ok=False, reason=reason, kind=kind.value, adapter=adapter))

    def records(self) -> list[SyncRecord]:
        with self._lock:
            return list(self._records)

    def dicts(self, since: float = 0.0) -> list[dict[str, Any]]:
        """Records newer than ``since`` (a timestamp; 0: all), oldest first, as dicts."""
        return [r.to_dict() for r in self.records() if r.timestamp > since]


class RecordingGate(EngineGate):
    """``gate`` with a ledger: each ``finish`` adds the update's record (ok or failed, seconds by phase, the
    audit figures of ``ApplyResult.report["ranks"]``) and answers the publisher with it, as
    ``InferenceServer`` does. Updates the receiver ends before ``finish`` are recorded from its events
    (``Ledger.event``); ``abort`` always follows one of those, so it records nothing itself."""

    def __init__(self, gate: EngineGate, ledger: Ledger, streaming: bool = False) -> None:
        self.gate = gate
        self.ledger = ledger
        self.streaming = streaming
        self._started = time.perf_counter()
        self._load_s = 0.0

    def info(self) -> wire.EngineInfo:
        return self.gate.info()

    def validate(self, manifest: wire.Manifest) -> str | None:
        return self.gate.validate(manifest)

    @property
    def restores(self) -> bool:  # type: ignore[override]
        return self.gate.restores

    def begin(self, manifest: wire.Manifest, restore: Restore | None = None) -> None:
        self._started, self._load_s = time.perf_counter(), 0.0
        self.gate.begin(manifest, restore)

    def load(self, manifest: wire.Manifest, bucket: StagedBucket) -> LoadResult:
        return self.load_many(manifest, [bucket])

    def load_many(self, manifest: wire.Manifest, buckets: list[StagedBucket]) -> LoadResult:
        t0 = time.perf_counter()
        try:
            return self.gate.load_many(manifest, buckets)
        finally:
            self._load_s += time.perf_counter() - t0

    def finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        t0 = time.perf_counter()
        result = self.gate.finish(manifest, timings)
        now = time.perf_counter()
        raw_ranks = list(result.report.get("ranks", []))
        extra = {"apply": self._load_s + now - t0}
        if self.streaming:
            extra.update(stream_load=self._load_s, stream_total=now - self._started)
        record = sync_record(self.ledger.engine, manifest, result.ok, result.reason, timings,
                             [RankReport.coerce(r) for r in raw_ranks], extra=extra, kind=result.kind)
        self.ledger.add(record)
        return ApplyResult(result.ok, result.reason, result.kind, {**result.report, **record.to_dict(), "ranks": raw_ranks})

    def abort(self, manifest: wire.Manifest, reason: str) -> None:
        self.gate.abort(manifest, reason)
