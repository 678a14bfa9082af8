"""The benchmark's pure report functions: the least-squares fit behind "time grows linearly with model
size", the ratios and the verdict lines (bench/run.py), the rows for the backend behind vllm serve, and the LoRA rows
(an adapter's sync against a full sync and merge-then-sync)."""

from __future__ import annotations

import pytest

from bench.report import (
    add_ratios,
    control_seconds,
    linear_fit,
    lora_ratios,
    lora_table,
    lora_verdict,
    serve_ratios,
    serve_table,
    serve_verdict,
    verdict,
)


@pytest.mark.parametrize(("points", "a", "b"), [
    ([(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)], 1.0, 2.0),
    ([(1e8, 0.2), (7e8, 0.8), (2e9, 2.1)], 0.1, 1e-9),
    ([(5.0, 4.0), (6.0, 4.0), (9.0, 4.0)], 4.0, 0.0),
])
def test_linear_fit_recovers_exact_lines(points: list[tuple[float, float]], a: float, b: float) -> None:
    got_a, got_b, r2 = linear_fit(points)
    assert got_a == pytest.approx(a, abs=1e-9) and got_b == pytest.approx(b, rel=1e-9, abs=1e-15)
    assert r2 == pytest.approx(1.0)


def test_linear_fit_r2_drops_for_a_curve() -> None:
    _, _, r2 = linear_fit([(1.0, 1.0), (2.0, 4.0), (3.0, 9.0), (4.0, 16.0), (10.0, 100.0)])
    assert 0.8 < r2 < 0.99


def _row(model: str, transport: str, mode: str, nbytes: float, bridge: float, alone: float | None = None) -> dict[str, object]:
    row: dict[str, object] = {"model": model, "transport": transport, "mode": mode, "receivers": 1, "bytes": nbytes,
                              "bridge": bridge, "baseline_a": 3 * bridge, "baseline_b": bridge / 1.1, "limit": 0.01,
                              "copy_gbps": 10.0}
    if alone is not None:
        row["transport_alone"] = alone
        row["transport_alone_raw"] = alone / 2
    return add_ratios(row)


def test_ratios_and_verdict_name_the_goals() -> None:
    rows = [_row("50m", "shm", "staged", 1e8, 0.1, alone=0.02), _row("350m", "shm", "staged", 7e8, 0.7, alone=0.1),
            _row("1b", "shm", "staged", 2e9, 2.0, alone=0.3), _row("350m", "zmq", "staged", 7e8, 1.4, alone=0.5)]
    assert rows[0]["transport_gbps"] == pytest.approx(5.0) and rows[0]["transport_over_copy"] == pytest.approx(0.5)
    lines = verdict(rows)
    assert any(line.startswith("350m: fastest shm/staged: bridge/B=1.10 (goal <= 1.25), A/bridge=3.00") for line in lines), lines
    assert any("shm alone (no engine): 50m 5.00 GB/s = 50% of copy bandwidth (raw, no checksums: 10.00 GB/s = 100%)" in line
               and "goal for shm: >= 60%" in line for line in lines), lines
    fit = [line for line in lines if line.startswith("shm/staged vs model size")]
    assert len(fit) == 1 and "r2 1.000" in fit[0], lines


def test_verdict_reports_receivers_with_and_without_engines() -> None:
    rows = [_row("50m", "shm", "staged", 1e8, 0.1, alone=0.02)]
    for count, bridge, alone in ((2, 0.25, 0.03), (4, 0.6, 0.05)):
        rows.append(add_ratios({**rows[0], "receivers": count, "bridge": bridge, "transport_alone": alone}))
    lines = verdict(rows)
    assert "50m: receivers 1: 1.00x, 2: 2.50x, 4: 6.00x (goal: 4 receivers <= 1.5x)" in lines, lines
    assert "50m: shm alone (receivers without engines) 1: 1.00x, 2: 1.50x, 4: 2.50x" in lines, lines


def test_verdict_compares_direct_tcp_fan_out_with_a_relay() -> None:
    rows = [_row("50m", "zmq", "staged", 1e8, 0.1, alone=0.02)]  # zmq fastest: its fan-out rows must stay apart
    rows.append(add_ratios({**rows[0], "receivers": 2, "bridge": 0.25}))
    rows.append(add_ratios({**rows[0], "transport": "zmq", "receivers": 2, "bridge": 0.9, "fanout": True}))
    rows.append(add_ratios({**rows[0], "transport": "relay", "receivers": 2, "bridge": 0.6, "fanout": True}))
    lines = verdict(rows)
    assert ("50m: 2 engines over tcp://: one stream each 0.900s, one stream to a host-local relay 0.600s "
            "(direct/relay 1.50)") in lines, lines
    assert "50m: receivers 1: 1.00x, 2: 2.50x (goal: 4 receivers <= 1.5x)" in lines, lines  # fan-out rows kept apart


def test_verdict_gives_the_median_of_each_syncs_own_ratio_when_b_was_paired() -> None:
    row = _row("350m", "shm", "staged", 7e8, 0.7)
    row["paired_ratios"] = [1.3, 1.1, 1.2, 1.0, 2.0]  # each sync over the baseline B run right after it
    lines = verdict([row])
    assert any(line.startswith("350m: fastest shm/staged: bridge/B=1.10 (goal <= 1.25) [each sync over the B run after it: "
                               "median 1.20], A/bridge=3.00") for line in lines), lines


def test_verdict_sets_fan_out_against_every_engine_reloading_at_once() -> None:
    rows = [add_ratios({**_row("50m", "shm", "staged", 1e8, 0.1, alone=0.02), "baseline_b_concurrent": 0.08})]
    for count, bridge, floor in ((2, 0.25, 0.2), (4, 0.6, 0.4)):
        rows.append(add_ratios({**rows[0], "receivers": count, "bridge": bridge, "baseline_b_concurrent": floor}))
    lines = verdict(rows)
    assert ("50m: baseline B on every engine at once (the floor for their reloads on this machine) 1: 1.00x, 2: 2.50x, "
            "4: 5.00x; bridge over that floor 1: 1.25, 2: 1.25, 4: 1.50") in lines, lines


def test_verdict_states_the_shm_segments_the_publisher_keeps_per_mode() -> None:
    staged = {**_row("1b", "shm", "staged", 1.6e9, 1.4), "publisher_held_bytes": 1.7e9, "bucket_mb": 64.0}
    streaming = {**_row("1b", "shm", "streaming", 1.6e9, 1.5), "publisher_held_bytes": 3.2e8, "bucket_mb": 64.0}
    lines = verdict([add_ratios(staged), add_ratios(streaming)])
    assert ("1b: shm bucket segments the publisher keeps in /dev/shm: staged 1700 MB (the whole update), streaming "
            "320 MB (a ring of 64 MB buckets, each rewritten once the engines released it)") in lines, lines


def _serve(model: str, transport: str, mode: str, actor: float, publish: float, send: float, row: float | None = None,
           outside: float = 0.04) -> dict[str, object]:
    phases = {"total": publish, "outside_publish": outside, "http_pause": 0.02, "http_start_weight_update": 0.004,
              "http_update_weights": publish + 0.005, "http_finish_weight_update": 0.004, "http_reset_prefix_cache": 0.003,
              "http_resume": 0.003}
    return serve_ratios({"model": model, "transport": transport, "mode": mode, "receivers": 1, "bytes": 1.2e8, "actor": actor,
                         "publish": publish, "send_weights": send, "actor_row": row, "phases": phases,
                         "paired_publish": [publish / actor] * 3, "paired_send_weights": [send / actor] * 3})


@pytest.mark.parametrize(("actor", "publish", "send", "row", "want"), [
    (0.2, 0.22, 0.26, 0.15, {"publish_over_actor": 1.1, "send_over_actor": 1.3, "publish_over_row": 0.22 / 0.15,
                             "send_over_row": 0.26 / 0.15}),
    (0.5, 0.45, 0.5, None, {"publish_over_actor": 0.9, "send_over_actor": 1.0}),
])
def test_serve_ratios_against_the_alternating_actor_syncs_and_the_earlier_row(actor: float, publish: float, send: float,
                                                                              row: float | None, want: dict[str, float]) -> None:
    got = _serve("50m", "shm", "staged", actor, publish, send, row)
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    assert ("publish_over_row" in got) is (row is not None)
    assert control_seconds(got) == pytest.approx(0.034)  # pause, start, finish, reset, resume; not update_weights


@pytest.mark.parametrize(("rows", "summary"), [
    ([_serve("50m", "shm", "staged", 0.2, 0.22, 0.23), _serve("50m", "zmq", "streaming", 0.4, 0.41, 0.45)],
     "vllm serve within 1.2x of the InferenceActor: publish 2/2, send_weights 2/2"),
    ([_serve("50m", "shm", "staged", 0.2, 0.22, 0.26), _serve("350m", "zmq", "staged", 0.5, 0.65, 0.7, outside=0.05)],
     "vllm serve within 1.2x of the InferenceActor: publish 1/2, send_weights 0/2; over: 50m shm/staged send_weights 1.30 "
     "(outside the publish 40 ms, of which HTTP control calls 34 ms); 350m zmq/staged publish 1.30, send_weights 1.40 "
     "(outside the publish 50 ms, of which HTTP control calls 34 ms)"),
])
def test_serve_verdict_names_every_row_and_what_missed_the_goal(rows: list[dict[str, object]], summary: str) -> None:
    lines = serve_verdict(rows)
    assert lines[-1] == summary, lines
    assert lines[0].startswith("50m: vllm serve over InferenceActor, publish / send_weights (goal <= 1.2x): shm/staged 1.10 / "), lines
    assert "(rounds 1.10 / " in lines[0], lines
    table = serve_table(rows)
    assert len(table.splitlines()) == 3 + len(rows) and "pub/actor" in table and "control ms" in table


def test_serve_verdict_is_empty_without_rows() -> None:
    assert serve_verdict([]) == []


def test_lora_rows_are_ratios_over_the_adapter_sync() -> None:
    row = lora_ratios({"model": "50m", "transport": "shm", "mode": "staged", "rank": 8, "adapter": 0.02, "full": 0.2,
                       "merged": 0.5, "merge": 0.25, "adapter_bytes": 1_310_720, "full_bytes": 120_103_936,
                       "paired_full_over_adapter": [9.0, 10.0, 11.0], "paired_merged_over_adapter": [24.0, 25.0, 30.0]})
    assert row["full_over_adapter"] == pytest.approx(10.0) and row["merged_over_adapter"] == pytest.approx(25.0)
    assert row["full_bytes_over_adapter"] == pytest.approx(91.63, rel=1e-3)
    (line,) = lora_verdict([row])
    assert line == ("50m: LoRA r=8 over shm: adapter sync 0.020s for 1.31 MB; a full sync takes 10.0x as long, "
                    "merge-then-sync 25.0x (the merge alone 0.250s), carrying 92x the bytes "
                    "(per round: full/adapter median 10.0, merged/adapter 25.0)")
    table = lora_table([row]).splitlines()
    assert table[0].startswith("LoRA: adapter-only sync") and len(table) == 4
    assert table[3].split()[:6] == ["50m", "shm", "8", "1.31", "120", "0.020"]
