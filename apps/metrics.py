"""Prometheus metrics and the in-memory state behind the dashboard and its JSON API.

One ``MetricsHub`` owns a private ``CollectorRegistry`` (so several hubs, e.g. in tests, never clash)
and is fed two kinds of facts: ``SyncRecord``s (one per sync per engine, via ``observe``) and engine
status dicts (``InferenceServer.status()``, via ``set_engine_status``). Everything the dashboard
shows is derived here, so the page and ``/metrics`` always agree.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from bridge.config import BridgeConfig, ProbeConfig, ServeConfig
from bridge.records import PHASES, SyncRecord
from bridge.report import FailureKind, parse_kind
from bridge.tensor_groups import GROUPS

logger = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
KNOWN_PHASES = frozenset((*PHASES, "apply"))
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0,
                 60.0, 150.0, 300.0, 600.0, float("inf"))
MAX_ALERT_ITEMS = 5
MAX_ALERT_CHARS = 300

FAILURE_CLASSES = tuple(k.value for k in FailureKind)


def failure_class(record: SyncRecord) -> str:
    """A failed sync's class: its record's ``kind`` (a FailureKind value, a bounded label value); ``other``
    for a record that carries none (written before records had kinds)."""
    return (parse_kind(record.kind) or FailureKind.OTHER).value


def wire_and_dense(record: SyncRecord) -> tuple[int, int]:
    """Bytes on the wire and dense bytes of a sync; a record without them (a dense update, or one written
    before records had them) carried its full bytes."""
    return record.wire_bytes or record.bytes, record.dense_bytes or record.bytes


def group_figures(record: SyncRecord) -> dict[str, dict[str, float]]:
    """Tensor group -> {wire_bytes, dense_bytes, density} of a sync's record, keeping only the known groups
    (bounded label values: a record comes from an engine over the wire) and numeric figures."""
    out: dict[str, dict[str, float]] = {}
    for group, figures in (record.groups or {}).items():
        if group not in GROUPS or not isinstance(figures, dict):
            continue
        values = {k: figures.get(k) for k in ("wire_bytes", "dense_bytes", "density")}
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values.values()):
            out[group] = {k: float(v) for k, v in values.items()}  # type: ignore[arg-type]
    return out


def _clip(text: str, limit: int = MAX_ALERT_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _name_list(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:MAX_ALERT_ITEMS])
    more = len(names) - MAX_ALERT_ITEMS
    return shown + (f" (+{more} more)" if more > 0 else "")


@dataclass
class _Engine:
    """What the hub knows about one engine."""

    name: str
    status: dict[str, Any] | None = None
    status_at: float | None = None
    unreachable: str | None = None
    last_record: SyncRecord | None = None
    record_version: int = 0  # version of the newest successful sync seen in records
    syncs: int = 0
    failures: int = 0

    @property
    def version(self) -> int:
        if self.status is not None:
            return int(self.status.get("version", 0))
        return self.record_version

    @property
    def degraded_reason(self) -> str | None:
        """Why the engine refuses requests, or None. Its status is authoritative when known."""
        if self.status is not None:
            reason = self.status.get("degraded")
            return str(reason) if reason else None
        rec = self.last_record
        if rec is not None and not rec.ok and ("apply" in rec.seconds or rec.stale_tensors or rec.identity_violations):
            return f"update to v{rec.version} failed after loading began: {rec.reason}"
        return None


class MetricsHub:
    """Prometheus metrics on a private registry, a ring of recent records and each engine's last status."""

    def __init__(self, history: int = ServeConfig.history,
                 probe_threshold: float = ProbeConfig.max_mean_abs_logprob_diff) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.history = history
        self.probe_threshold = probe_threshold
        self._lock = threading.Lock()
        self._records: deque[SyncRecord] = deque(maxlen=history)
        self._engines: dict[str, _Engine] = {}
        self._trainer_version = 0
        self._started = time.time()
        self._define_metrics()

    @classmethod
    def from_config(cls, config: BridgeConfig) -> MetricsHub:
        return cls(history=config.serve.history, probe_threshold=config.probe.max_mean_abs_logprob_diff)

    def _define_metrics(self) -> None:
        r = self.registry
        self.phase_seconds = Histogram("weight_bridge_sync_phase_seconds", "Seconds spent in each phase of a sync.",
                                       ["engine", "phase"], buckets=PHASE_BUCKETS, registry=r)
        self.engine_version = Gauge("weight_bridge_engine_weight_version", "Weight version the engine serves.",
                                    ["engine"], registry=r)
        self.trainer_version = Gauge("weight_bridge_trainer_weight_version",
                                     "Newest weight version the trainer published (or any engine reported).", registry=r)
        self.version_lag = Gauge("weight_bridge_engine_version_lag",
                                 "Trainer weight version minus the engine's weight version.", ["engine"], registry=r)
        self.failures = Counter("weight_bridge_sync_failures", "Failed syncs, by failure class.",
                                ["engine", "reason"], registry=r)
        self.syncs = Counter("weight_bridge_syncs", "Syncs by result (ok, failed, noop).", ["engine", "result"],
                             registry=r)
        self.sync_bytes = Counter("weight_bridge_sync_bytes", "Bytes of weights delivered by successful syncs.",
                                  ["engine"], registry=r)
        self.wire_bytes = Counter("weight_bridge_sync_wire_bytes",
                                  "Bytes on the wire of successful syncs: patches for a delta update, the full tensors "
                                  "for a dense one (against weight_bridge_sync_bytes: what a dense update would carry).",
                                  ["engine"], registry=r)
        self.wire_ratio = Gauge("weight_bridge_sync_wire_ratio",
                                "Bytes on the wire over dense bytes of the latest successful sync (1: dense).",
                                ["engine"], registry=r)
        self.delta_density = Gauge("weight_bridge_sync_delta_density",
                                   "Share of elements that changed in the tensors the latest successful sync sent as "
                                   "patches (0: a dense update), over all of them (group \"all\") and per tensor group "
                                   "(embed, attn, mlp, experts, router, norm, sinks, lm_head, other).",
                                   ["engine", "group"], registry=r)
        self._groups: dict[str, set[str]] = {}  # engine -> tensor groups its density gauge has shown
        self.stale = Gauge("weight_bridge_stale_tensors", "Stale tensors found by the audit of the latest sync.",
                           ["engine"], registry=r)
        self.identity = Gauge("weight_bridge_identity_violations",
                              "Storage-identity violations found in the latest sync.", ["engine"], registry=r)
        self.probe_diff = Gauge("weight_bridge_probe_mean_abs_logprob_diff",
                                "Mean |logprob(trainer) - logprob(engine)| on the probe of the latest checked sync.",
                                ["engine"], registry=r)
        self.probe_kl = Gauge("weight_bridge_probe_kl", "KL estimate on the probe of the latest checked sync.",
                              ["engine"], registry=r)
        self.degraded = Gauge("weight_bridge_engine_degraded", "1 if the engine refuses requests until a complete update.",
                              ["engine"], registry=r)
        self.up = Gauge("weight_bridge_engine_up", "1 if the engine answered the last status poll.", ["engine"],
                        registry=r)

    # ---- feeding --------------------------------------------------------------------------------
    def observe(self, record: SyncRecord) -> None:
        """Account one sync record: counters, histograms and the engine's latest-sync gauges."""
        name = record.engine
        result = "noop" if record.noop else ("ok" if record.ok else "failed")
        with self._lock:
            self.syncs.labels(name, result).inc()
            for phase, seconds in record.seconds.items():
                if phase in KNOWN_PHASES and seconds >= 0:
                    self.phase_seconds.labels(name, phase).observe(seconds)
                else:
                    logger.debug("ignoring phase %r=%s of %s v%s", phase, seconds, name, record.version)
            if not record.ok:
                self.failures.labels(name, failure_class(record)).inc()
            elif not record.noop:
                self.sync_bytes.labels(name).inc(record.bytes)
                wire, dense = wire_and_dense(record)
                self.wire_bytes.labels(name).inc(wire)
                self.wire_ratio.labels(name).set(wire / dense if dense else 1.0)
                self.delta_density.labels(name, "all").set(record.density if record.delta_base else 0.0)
                densities = {g: f["density"] for g, f in group_figures(record).items()} if record.delta_base else {}
                shown = self._groups.setdefault(name, set())
                shown.update(densities)
                for group in shown:  # a group the latest sync did not patch shows 0
                    self.delta_density.labels(name, group).set(densities.get(group, 0.0))
            self.stale.labels(name).set(len(record.stale_tensors))
            self.identity.labels(name).set(len(record.identity_violations))
            if record.probe_mean_abs_logprob_diff is not None:
                self.probe_diff.labels(name).set(record.probe_mean_abs_logprob_diff)
            if record.probe_kl is not None:
                self.probe_kl.labels(name).set(record.probe_kl)
            self._records.append(record)
            engine = self._engine(name)
            engine.syncs += 1
            engine.failures += 0 if record.ok else 1
            engine.last_record = record
            if record.ok:
                engine.record_version = max(engine.record_version, record.version)
            self._trainer_version = max(self._trainer_version, record.version)
            self._refresh_gauges()

    def set_engine_status(self, status: dict[str, Any]) -> None:
        """Take an engine's ``status()`` dict: version, degraded reason, endpoint, TP size, dtype."""
        name = str(status["engine"])
        with self._lock:
            engine = self._engine(name)
            engine.status = dict(status)
            engine.status_at = time.time()
            engine.unreachable = None
            self._trainer_version = max(self._trainer_version, engine.version)
            self._refresh_gauges()

    def set_engine_unreachable(self, name: str, error: str) -> None:
        """Mark an engine whose status could not be fetched; it keeps its last known version."""
        with self._lock:
            self._engine(name).unreachable = error
            self._refresh_gauges()

    def set_trainer_version(self, version: int) -> None:
        with self._lock:
            self._trainer_version = max(int(version), *(e.version for e in self._engines.values()), 0)
            self._refresh_gauges()

    def _engine(self, name: str) -> _Engine:
        if name not in self._engines:
            self._engines[name] = _Engine(name)
        return self._engines[name]

    def _refresh_gauges(self) -> None:
        self.trainer_version.set(self._trainer_version)
        for name, engine in self._engines.items():
            self.engine_version.labels(name).set(engine.version)
            self.version_lag.labels(name).set(self._trainer_version - engine.version)
            self.degraded.labels(name).set(1 if engine.degraded_reason else 0)
            self.up.labels(name).set(0 if engine.unreachable else 1)

    # ---- reading --------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of this hub's registry."""
        return generate_latest(self.registry)

    def records(self, limit: int | None = None, engine: str | None = None) -> list[dict[str, Any]]:
        """Recent records as dicts, oldest first (newest last)."""
        with self._lock:
            chosen = [r for r in self._records if engine is None or r.engine == engine]
        if limit is not None:
            chosen = chosen[-limit:] if limit > 0 else []
        return [r.to_dict() for r in chosen]

    def engines(self) -> dict[str, Any]:
        """Every known engine with version, lag and health, the trainer version and the active alerts."""
        with self._lock:
            now = time.time()
            # the fleet by node: engines of one node next to each other (by node address, then name)
            engines = sorted((self._engine_view(e, now) for e in self._engines.values()),
                             key=lambda v: (v["node"] or "", v["engine"]))
            return {"trainer_version": self._trainer_version, "probe_threshold": self.probe_threshold,
                    "uptime_s": now - self._started, "engines": engines, "alerts": self._alerts()}

    def _engine_view(self, engine: _Engine, now: float) -> dict[str, Any]:
        status = engine.status or {}
        degraded = engine.degraded_reason
        health = "unreachable" if engine.unreachable else ("degraded" if degraded else "ok")
        rec = engine.last_record
        wire, dense = wire_and_dense(rec) if rec is not None else (0, 0)
        last = None if rec is None else {
            "version": rec.version, "ok": rec.ok, "noop": rec.noop, "reason": rec.reason,
            "failure_class": None if rec.ok else failure_class(rec), "timestamp": rec.timestamp,
            "total_s": rec.seconds.get("total"), "gbps": rec.gbps, "stale_tensors": len(rec.stale_tensors),
            "identity_violations": len(rec.identity_violations),
            "probe_mean_abs_logprob_diff": rec.probe_mean_abs_logprob_diff, "probe_flagged": rec.probe_flagged,
            "delta_base": rec.delta_base, "wire_bytes": wire, "dense_bytes": dense,
            "density": rec.density, "groups": group_figures(rec) if rec.delta_base else {},
        }
        return {
            "engine": engine.name, "version": engine.version, "lag": self._trainer_version - engine.version,
            "health": health, "degraded": degraded is not None, "degraded_reason": degraded,
            "reachable": engine.unreachable is None, "unreachable_reason": engine.unreachable,
            "endpoint": status.get("endpoint"), "tp_size": status.get("tp_size"), "dtype": status.get("dtype"),
            "node": status.get("node_ip"),
            "status_age_s": None if engine.status_at is None else now - engine.status_at,
            "syncs": engine.syncs, "failures": engine.failures, "last_sync": last,
            "sequences_generated": status.get("sequences_generated"),
        }

    def alerts(self) -> list[dict[str, Any]]:
        """Problems shown in the red banner: from each engine's latest record and status."""
        with self._lock:
            return self._alerts()

    def _alerts(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []

        def add(engine: str, kind: str, version: int | None, message: str) -> None:
            out.append({"engine": engine, "kind": kind, "version": version, "message": _clip(message)})

        for name, engine in sorted(self._engines.items()):
            if engine.unreachable:
                add(name, "unreachable", None, f"engine unreachable: {engine.unreachable}")
            degraded = engine.degraded_reason
            if degraded:
                add(name, "degraded", engine.version, f"engine degraded (refuses requests): {degraded}")
            rec = engine.last_record
            if rec is None:
                continue
            if not rec.ok:
                add(name, "failed", rec.version, f"sync v{rec.version} failed [{failure_class(rec)}]: {rec.reason}")
            if rec.stale_tensors:
                add(name, "stale", rec.version,
                    f"{len(rec.stale_tensors)} stale tensor(s) after v{rec.version}: {_name_list(rec.stale_tensors)}")
            if rec.identity_violations:
                add(name, "identity", rec.version,
                    f"{len(rec.identity_violations)} identity violation(s) in v{rec.version}: "
                    f"{_name_list(rec.identity_violations)}")
            if rec.probe_flagged:
                diff = rec.probe_mean_abs_logprob_diff
                shown = "?" if diff is None else f"{diff:.4g}"
                add(name, "probe", rec.version,
                    f"probe mismatch on v{rec.version}: mean |Δlogprob| {shown} > {self.probe_threshold:.4g}")
        return out
