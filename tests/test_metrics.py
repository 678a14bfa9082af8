"""MetricsHub: records in, Prometheus text out (parsed back with prometheus_client's own parser)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from apps.metrics import FAILURE_CLASSES, MetricsHub, failure_class
from bridge.records import SyncRecord
from bridge.report import FailureKind
from tests.dashboard_fixtures import GB, STALE_TENSOR, ok_record, sample_hub, stale_record, status


def families(hub: MetricsHub) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(hub.render().decode("utf-8"))}


def value(hub: MetricsHub, sample_name: str, **labels: str) -> float:
    """The value of the one sample with this name and exactly these labels."""
    fams = families(hub)
    found = [s.value for f in fams.values() for s in f.samples if s.name == sample_name and s.labels == labels]
    assert len(found) == 1, f"{sample_name}{labels}: {len(found)} samples in\n{hub.render().decode()}"
    return found[0]


def test_every_family_is_exposed_with_its_type() -> None:
    fams = families(sample_hub())
    want = {
        "weight_bridge_sync_phase_seconds": "histogram",
        "weight_bridge_engine_weight_version": "gauge",
        "weight_bridge_trainer_weight_version": "gauge",
        "weight_bridge_engine_version_lag": "gauge",
        "weight_bridge_sync_failures": "counter",
        "weight_bridge_syncs": "counter",
        "weight_bridge_sync_bytes": "counter",
        "weight_bridge_sync_wire_bytes": "counter",
        "weight_bridge_sync_wire_ratio": "gauge",
        "weight_bridge_sync_delta_density": "gauge",
        "weight_bridge_stale_tensors": "gauge",
        "weight_bridge_identity_violations": "gauge",
        "weight_bridge_probe_mean_abs_logprob_diff": "gauge",
        "weight_bridge_probe_kl": "gauge",
        "weight_bridge_engine_degraded": "gauge",
    }
    assert {name: fams[name].type for name in want if name in fams} == want
    # counters carry the _total suffix in the exposition
    assert any(s.name == "weight_bridge_sync_failures_total" for s in fams["weight_bridge_sync_failures"].samples)


def test_phase_histogram_observes_each_phase_per_engine() -> None:
    hub = MetricsHub()
    hub.observe(ok_record("e0", 1, 100.0, total=0.5))
    hub.observe(ok_record("e0", 2, 101.0, total=2.0))
    assert value(hub, "weight_bridge_sync_phase_seconds_count", engine="e0", phase="total") == 2
    assert value(hub, "weight_bridge_sync_phase_seconds_sum", engine="e0", phase="total") == pytest.approx(2.5)
    assert value(hub, "weight_bridge_sync_phase_seconds_bucket", engine="e0", phase="total", le="1.0") == 1
    assert value(hub, "weight_bridge_sync_phase_seconds_bucket", engine="e0", phase="total", le="+Inf") == 2
    assert value(hub, "weight_bridge_sync_phase_seconds_count", engine="e0", phase="load") == 2
    phases = {s.labels["phase"] for s in families(hub)["weight_bridge_sync_phase_seconds"].samples}
    assert phases == {"pack", "transfer", "load", "verify", "total"}


def test_unknown_phase_names_are_not_exported() -> None:
    hub = MetricsHub()
    hub.observe(SyncRecord(version=1, engine="e0", ok=True, seconds={"total": 1.0, "made_up": 3.0}))
    phases = {s.labels["phase"] for s in families(hub)["weight_bridge_sync_phase_seconds"].samples}
    assert phases == {"total"}


def test_versions_and_lag_follow_records_status_and_trainer() -> None:
    hub = MetricsHub()
    hub.observe(ok_record("a", 3, 1.0))
    hub.observe(ok_record("b", 2, 2.0))
    assert value(hub, "weight_bridge_trainer_weight_version") == 3
    assert value(hub, "weight_bridge_engine_weight_version", engine="a") == 3
    assert value(hub, "weight_bridge_engine_version_lag", engine="b") == 1
    hub.set_trainer_version(5)
    assert value(hub, "weight_bridge_trainer_weight_version") == 5
    assert value(hub, "weight_bridge_engine_version_lag", engine="a") == 2
    assert value(hub, "weight_bridge_engine_version_lag", engine="b") == 3
    hub.set_engine_status(status("b", 5))  # the status is authoritative for the served version
    assert value(hub, "weight_bridge_engine_weight_version", engine="b") == 5
    assert value(hub, "weight_bridge_engine_version_lag", engine="b") == 0


def test_failed_sync_does_not_advance_the_engine_version_but_the_trainer_version() -> None:
    hub = MetricsHub()
    hub.observe(ok_record("a", 1, 1.0))
    hub.observe(stale_record("a", 2, 2.0))
    assert value(hub, "weight_bridge_engine_weight_version", engine="a") == 1
    assert value(hub, "weight_bridge_trainer_weight_version") == 2
    assert value(hub, "weight_bridge_engine_version_lag", engine="a") == 1


def test_syncs_counted_by_result_and_failures_by_class() -> None:
    hub = MetricsHub()
    hub.observe(ok_record("a", 1, 1.0))
    hub.observe(SyncRecord(version=1, engine="a", ok=True, noop=True, reason="version 1 already served", timestamp=2.0))
    hub.observe(stale_record("a", 2, 3.0))
    hub.observe(SyncRecord(version=3, engine="a", ok=False, reason="timeout: no data for 60.0s", kind="timeout", timestamp=4.0))
    hub.observe(SyncRecord(version=4, engine="a", ok=False, reason="timeout: no data for 60.0s", kind="timeout", timestamp=5.0))
    assert value(hub, "weight_bridge_syncs_total", engine="a", result="ok") == 1
    assert value(hub, "weight_bridge_syncs_total", engine="a", result="noop") == 1
    assert value(hub, "weight_bridge_syncs_total", engine="a", result="failed") == 3
    assert value(hub, "weight_bridge_sync_failures_total", engine="a", reason="stale") == 1
    assert value(hub, "weight_bridge_sync_failures_total", engine="a", reason="timeout") == 2
    reasons = {s.labels["reason"] for s in families(hub)["weight_bridge_sync_failures"].samples}
    assert reasons == {"stale", "timeout"}


def test_bytes_count_only_delivered_syncs() -> None:
    hub = MetricsHub()
    hub.observe(ok_record("a", 1, 1.0, nbytes=3 * GB))
    hub.observe(ok_record("a", 2, 2.0, nbytes=1 * GB))
    hub.observe(stale_record("a", 3, 3.0))  # failed: its bytes were not delivered
    hub.observe(SyncRecord(version=3, engine="a", ok=True, noop=True, bytes=5 * GB, timestamp=4.0))
    assert value(hub, "weight_bridge_sync_bytes_total", engine="a") == 4 * GB


def test_wire_bytes_and_density_follow_delta_syncs() -> None:
    """A delta sync counts its patches' bytes on the wire; a dense one (or a record without the fields) its
    full bytes. The gauges show the latest delivered sync: its wire/dense ratio and the changed share."""
    hub = MetricsHub()
    hub.observe(ok_record("a", 1, 1.0, nbytes=2 * GB))
    assert (value(hub, "weight_bridge_sync_wire_ratio", engine="a"), value(hub, "weight_bridge_sync_delta_density", engine="a", group="all")) == (1.0, 0.0)
    hub.observe(ok_record("a", 2, 2.0, nbytes=2 * GB, delta_base=1))
    hub.observe(stale_record("a", 3, 3.0))  # failed: nothing delivered, the gauges keep the delta's figures
    assert value(hub, "weight_bridge_sync_wire_bytes_total", engine="a") == 2 * GB + 2 * GB // 100
    assert value(hub, "weight_bridge_sync_bytes_total", engine="a") == 4 * GB
    assert value(hub, "weight_bridge_sync_wire_ratio", engine="a") == 0.01
    assert value(hub, "weight_bridge_sync_delta_density", engine="a", group="all") == 0.01
    last = hub.engines()["engines"][0]["last_sync"]
    assert last["version"] == 3 and (last["delta_base"], last["wire_bytes"]) == (0, 2 * GB)


def test_density_per_tensor_group_follows_delta_syncs() -> None:
    """``weight_bridge_sync_delta_density{engine, group}``: each group the latest delta sync patched; a dense sync
    after it shows 0 for every group; a group name that is not a known one (the record came over the wire) is
    not a label."""
    hub = MetricsHub()
    record = ok_record("a", 2, 2.0, delta_base=1)
    hub.observe(replace(record, groups={**record.groups, "x" * 300: {"wire_bytes": 1, "dense_bytes": 2, "density": 0.5},
                                        "norm": {"density": "high"}}))
    assert value(hub, "weight_bridge_sync_delta_density", engine="a", group="attn") == 0.012
    assert value(hub, "weight_bridge_sync_delta_density", engine="a", group="mlp") == 0.0093
    groups = {s.labels["group"] for f in families(hub).values() for s in f.samples if s.name == "weight_bridge_sync_delta_density"}
    assert groups == {"all", "attn", "mlp"}
    assert hub.engines()["engines"][0]["last_sync"]["groups"]["attn"] == {"wire_bytes": 2 * GB // 400, "dense_bytes": 2 * GB // 4,
                                                                       "density": 0.012}
    hub.observe(ok_record("a", 3, 3.0))
    assert [value(hub, "weight_bridge_sync_delta_density", engine="a", group=g) for g in ("all", "attn", "mlp")] == [0.0, 0.0, 0.0]


def test_latest_sync_gauges_stale_identity_probe() -> None:
    hub = MetricsHub()
    hub.observe(SyncRecord(version=1, engine="a", ok=False, reason="rank 1: IdentityError: storage changed during update: w", kind="identity",
                           identity_violations=("w", "b"), timestamp=1.0))
    hub.observe(stale_record("b", 1, 2.0))
    hub.observe(ok_record("c", 1, 3.0, probe=0.125))
    assert value(hub, "weight_bridge_identity_violations", engine="a") == 2
    assert value(hub, "weight_bridge_stale_tensors", engine="a") == 0
    assert value(hub, "weight_bridge_stale_tensors", engine="b") == 1
    assert value(hub, "weight_bridge_probe_mean_abs_logprob_diff", engine="c") == pytest.approx(0.125)
    assert value(hub, "weight_bridge_probe_kl", engine="c") == pytest.approx(0.0125)
    hub.observe(ok_record("b", 2, 4.0))  # the next good sync clears the gauge
    assert value(hub, "weight_bridge_stale_tensors", engine="b") == 0


def test_degraded_comes_from_status_or_a_failure_after_loading() -> None:
    hub = MetricsHub()
    hub.observe(ok_record("a", 1, 1.0))
    hub.observe(SyncRecord(version=2, engine="a", ok=False, reason="refused: ChecksumError: tensor x: checksum mismatch", kind="checksum",
                           timestamp=2.0))
    assert value(hub, "weight_bridge_engine_degraded", engine="a") == 0  # refused before loading: still serving v1
    hub.observe(stale_record("a", 3, 3.0))
    assert value(hub, "weight_bridge_engine_degraded", engine="a") == 1
    hub.set_engine_status(status("a", 1, degraded=None))  # the engine's own word wins
    assert value(hub, "weight_bridge_engine_degraded", engine="a") == 0
    hub.set_engine_status(status("a", 1, degraded="update to v3 failed"))
    assert value(hub, "weight_bridge_engine_degraded", engine="a") == 1


def test_hubs_have_private_registries() -> None:
    one, two = MetricsHub(), MetricsHub()
    one.observe(ok_record("a", 7, 1.0))
    assert value(one, "weight_bridge_engine_weight_version", engine="a") == 7
    assert "engine=\"a\"" not in two.render().decode()


def test_ring_keeps_the_newest_records_last() -> None:
    hub = MetricsHub(history=3)
    for v in range(1, 6):
        hub.observe(ok_record("a", v, float(v)))
    assert [r["version"] for r in hub.records()] == [3, 4, 5]
    assert [r["version"] for r in hub.records(limit=2)] == [4, 5]
    assert hub.records(engine="nobody") == []


def test_engine_view_and_alerts_name_the_problem() -> None:
    view = sample_hub().engines()
    by_name = {e["engine"]: e for e in view["engines"]}
    assert by_name["engine-a"]["health"] == "ok" and by_name["engine-a"]["lag"] == 0
    assert by_name["engine-b"]["health"] == "degraded" and by_name["engine-b"]["lag"] == 1
    kinds = {(a["engine"], a["kind"]) for a in view["alerts"]}
    assert kinds == {("engine-b", "degraded"), ("engine-b", "failed"), ("engine-b", "stale")}
    stale = next(a for a in view["alerts"] if a["kind"] == "stale")
    assert STALE_TENSOR in stale["message"]


@pytest.mark.parametrize("kind", list(FailureKind))
def test_failure_class_is_the_records_kind(kind: FailureKind) -> None:
    """The class is the kind field; the reason's words play no part (here they name another failure)."""
    record = SyncRecord(version=2, engine="a", ok=False, kind=kind.value,
                        reason="rank 0: ChecksumError: tensor w: checksum mismatch; timeout; stale")
    assert failure_class(record) == kind.value
    assert kind.value in FAILURE_CLASSES


@pytest.mark.parametrize("kind", ["", "a-kind-from-a-newer-engine"])
def test_failure_class_without_a_known_kind_is_other(kind: str) -> None:
    assert failure_class(SyncRecord(version=2, engine="a", ok=False, kind=kind, reason="AuditError: stale")) == "other"
