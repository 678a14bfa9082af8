"""Sample sync records and engine statuses for the metrics, dashboard and CLI tests (no engines needed)."""

from __future__ import annotations

import time
from typing import Any

from apps.metrics import MetricsHub
from bridge.records import SyncRecord

STALE_TENSOR = "model.layers.0.self_attn.sinks"
STALE_REASON = f"rank 0: AuditError: stale after update: {STALE_TENSOR}: live sinks differ from the sent shard (stale)"
GB = 10**9


def ok_record(engine: str, version: int, ts: float, total: float = 1.0, nbytes: int = 2 * GB,
              probe: float | None = 0.01, delta_base: int = 0) -> SyncRecord:
    """A verified sync; with ``delta_base`` a delta update: 1% of the elements of 200 tensors changed, 1% of the
    dense bytes on the wire."""
    groups = {"attn": {"wire_bytes": nbytes // 400, "dense_bytes": nbytes // 4, "density": 0.012},
              "mlp": {"wire_bytes": nbytes // 200 * 3 // 2, "dense_bytes": nbytes // 4 * 3, "density": 0.0093}}
    delta = {"delta_base": delta_base, "wire_bytes": nbytes // 100, "dense_bytes": nbytes, "delta_tensors": 200,
             "density": 0.01, "groups": groups} if delta_base else {}
    return SyncRecord(version=version, engine=engine, ok=True, bytes=nbytes, tensors=290,
                      seconds={"pack": 0.1, "transfer": total * 0.6, "load": 0.2, "verify": 0.05, "total": total},
                      tensors_audited=290, probe_mean_abs_logprob_diff=probe, probe_kl=None if probe is None else probe / 10,
                      timestamp=ts, **delta)


def stale_record(engine: str, version: int, ts: float) -> SyncRecord:
    return SyncRecord(version=version, engine=engine, ok=False, reason=STALE_REASON, kind="stale", bytes=2 * GB, tensors=290,
                      seconds={"receive": 0.4, "apply": 0.3}, stale_tensors=(STALE_TENSOR,), timestamp=ts)


def sample_records(now: float | None = None) -> list[SyncRecord]:
    """engine-a: v1..v3 ok (v3 a delta against v2). engine-b: v1, v2 ok, then v3 failed with a stale tensor."""
    t0 = (now or time.time()) - 60
    records = []
    for v in (1, 2, 3):
        records.append(ok_record("engine-a", v, t0 + 10 * v, total=0.8 + 0.1 * v, probe=0.004 * v,
                                 delta_base=2 if v == 3 else 0))
        if v < 3:
            records.append(ok_record("engine-b", v, t0 + 10 * v + 1, total=1.0 + 0.1 * v, probe=0.005 * v))
    records.append(stale_record("engine-b", 3, t0 + 31))
    return records


def status(engine: str, version: int, degraded: str | None = None, generated: int | None = None) -> dict[str, Any]:
    out = {"engine": engine, "endpoint": f"tcp://127.0.0.1:{5550 + version}", "version": version,
           "degraded": degraded, "tp_size": 2, "dtype": "bfloat16", "sinks": []}
    if generated is not None:  # an engine that predates the counter does not report it
        out["sequences_generated"] = generated
    return out


def sample_hub() -> MetricsHub:
    hub = MetricsHub(history=100)
    for record in sample_records():
        hub.observe(record)
    hub.set_engine_status(status("engine-a", 3, generated=96))
    hub.set_engine_status(status("engine-b", 2, degraded="update to v3 failed after loading began: stale"))
    return hub
