"""The Ray job's pure pieces, without Ray: engine names, the split of a step's rollouts across engines,
and the sync summary of a publish to several engines (the worst engine decides)."""

from __future__ import annotations

from typing import Any

import pytest

from apps.ray_job import engine_names, parse, sync_passed, sync_summary
from trainer_side.publisher import EngineReport, PublishReport


@pytest.mark.parametrize(("count", "names"), [
    (1, ["eng"]),
    (3, ["eng", "eng-1", "eng-2"]),
])
def test_engine_names_keep_the_first_name(count: int, names: list[str]) -> None:
    assert engine_names("eng", count) == names


@pytest.mark.parametrize(("count", "parts", "spans"), [
    (32, 1, [(0, 32)]),
    (32, 2, [(0, 16), (16, 32)]),
    (10, 3, [(0, 4), (4, 7), (7, 10)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
    (0, 2, [(0, 0), (0, 0)]),
])
def test_rollout_shares_cover_the_batch_in_order(count: int, parts: int, spans: list[tuple[int, int]]) -> None:
    from apps.grpo_toy import shares

    got = shares(count, parts)
    assert got == spans
    assert [i for a, b in got for i in range(a, b)] == list(range(count))  # every item once, in order


def test_rollout_shares_refuse_zero_engines() -> None:
    from apps.grpo_toy import shares

    with pytest.raises(ValueError, match="parts must be >= 1"):
        shares(8, 0)


def _engine(name: str, ok: bool = True, probe: float | None = 0.01, flagged: bool = False,
            stale: tuple[str, ...] = (), audited: int = 27) -> EngineReport:
    record: dict[str, Any] = {"engine": name, "tensors_audited": audited, "stale_tensors": list(stale),
                              "identity_violations": [], "probe_mean_abs_logprob_diff": probe, "probe_kl": 1e-5,
                              "probe_flagged": flagged, "transport": "shm"}
    return EngineReport(endpoint=f"tcp://{name}", version=3, ok=ok, reason="" if ok else "AuditError: stale",
                        bytes=100, seconds={"total": 0.1}, verified=ok, engine=record)


def _publish(*engines: EngineReport) -> PublishReport:
    return PublishReport(version=3, bytes=100, seconds={"total": 0.2}, engines=engines)


def test_summary_of_healthy_engines_passes_and_lists_each() -> None:
    sync = sync_summary(_publish(_engine("a", probe=0.01), _engine("b", probe=0.03, audited=25)))
    assert sync_passed(sync)
    assert [e["engine"] for e in sync["engines"]] == ["a", "b"]
    assert sync["probe_mean_abs_logprob_diff"] == 0.03 and sync["tensors_audited"] == 25
    assert all(e["transport"] == "shm" for e in sync["engines"])


@pytest.mark.parametrize("bad", [
    _engine("b", ok=False, stale=("model.norm.weight: stale",)),
    _engine("b", flagged=True, probe=0.2),
    _engine("b", probe=None),
])
def test_one_bad_engine_fails_the_sync(bad: EngineReport) -> None:
    sync = sync_summary(_publish(_engine("a"), bad))
    assert not sync_passed(sync), sync
    assert sync["engines"][1]["engine"] == "b"
    if not bad.ok:
        assert not sync["ok"] and sync["stale_tensors"] == ["model.norm.weight: stale"]
        assert sync["reason"] == "b: AuditError: stale"


def test_summary_of_no_engine_does_not_pass() -> None:
    assert not sync_passed(sync_summary(_publish()))


def test_engines_argument_is_validated() -> None:
    assert parse(["--engines", "3"]).engines == 3
    assert parse([]).engines == 1
    with pytest.raises(SystemExit):
        parse(["--engines", "0"])


def test_summary_carries_the_delta_telemetry_as_json() -> None:
    """Each step's line is printed as JSON: the publish's delta telemetry comes through as plain values."""
    import json

    import numpy as np

    delta = {"mode": "delta", "wire_bytes": np.int64(1200), "dense_bytes": 120000, "density": np.float32(0.01),
             "dense_fallback": {}}
    sync = sync_summary(PublishReport(version=3, bytes=100, seconds={"total": 0.2}, engines=(_engine("a"),), delta=delta))
    assert json.loads(json.dumps(sync))["delta"] == {"mode": "delta", "wire_bytes": 1200, "dense_bytes": 120000,
                                                     "density": pytest.approx(0.01), "dense_fallback": {}}


def _relay(node: str, *engines: EngineReport) -> EngineReport:
    relayed = [{"endpoint": e.endpoint, "ok": e.ok, "noop": False, "verified": e.verified, "seconds": {},
                **e.engine} for e in engines]
    return EngineReport(endpoint=f"tcp://relay-{node}", version=3, ok=all(e.ok for e in engines), reason="", bytes=100,
                        seconds={"total": 0.1}, verified=True, engine={"relayed": relayed})


def test_fleet_summary_lists_each_engine_behind_its_relay_in_the_given_order() -> None:
    """One copy per node (two relays), three engines behind them; an engine that missed the version (its
    node's relay down) is a failed entry, so the sync does not pass."""
    from apps.fleet import FleetReport
    from apps.ray_job import fleet_sync_summary

    report = PublishReport(version=3, bytes=100, seconds={"total": 0.2},
                           engines=(_relay("a", _engine("e1"), _engine("e2")), _relay("b", _engine("e0"))))
    fleet = FleetReport(3, True, "all", ("e0", "e1", "e2"), (), (), {"a": {}, "b": {}}, report, {"total": 0.25})
    sync = fleet_sync_summary(fleet, ["e0", "e1", "e2"])
    assert [e["engine"] for e in sync["engines"]] == ["e0", "e1", "e2"]
    assert sync_passed(sync) and sync["fleet"]["copies_sent"] == 2 and sync["tensors_audited"] == 27
    missed = FleetReport(3, False, "all", ("e0",), ("e1", "e2"), ("relay@a",), {"a": {}, "b": {}},
                         PublishReport(version=3, bytes=100, seconds={}, engines=(_relay("b", _engine("e0")),)), {"total": 0.2})
    sync = fleet_sync_summary(missed, ["e0", "e1", "e2"])
    assert not sync_passed(sync) and sync["engines"][1]["reason"] == "not current at version 3", sync


@pytest.mark.parametrize("argv", [
    ["--trainer-ranks", "0"],
    ["--trainer-ranks", "2", "--loop", "versions"],
    ["--trainer-ranks", "2", "--lora", "8"],
    ["--trainer-ranks", "2", "--node-resource", "wb_worker"],
])
def test_job_refuses_trainer_ranks_outside_full_weight_grpo(argv: list[str], capsys: Any) -> None:
    with pytest.raises(SystemExit):
        parse(argv)
    assert "--trainer-ranks" in capsys.readouterr().err


def test_job_takes_trainer_ranks_for_grpo() -> None:
    args = parse(["--loop", "grpo", "--trainer-ranks", "2", "--cpus-per-rank", "0.5"])
    assert (args.trainer_ranks, args.cpus_per_rank) == (2, 0.5)
    assert parse([]).trainer_ranks == 1  # the driver trains, as before


@pytest.mark.parametrize(("argv", "error"), [
    (["--trainer-ranks", "2", "--lora", "8"], "--trainer-ranks"),
    (["--trainer-ranks", "0"], "--trainer-ranks"),
    (["--trainer-ranks", "4", "--prompts", "2"], "without a prompt"),
])
def test_grpo_example_refuses_bad_trainer_ranks(argv: list[str], error: str, capsys: Any) -> None:
    from apps.grpo_toy import parse as grpo_parse

    with pytest.raises(SystemExit):
        grpo_parse(argv)
    assert error in capsys.readouterr().err
