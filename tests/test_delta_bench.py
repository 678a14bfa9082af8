"""bench/delta_link.py's versions: ``rl_step_`` changes about the share of bf16 elements it is asked to (in place, a
step of 1 + 0.01 N(0, 1), of which bf16 rounding leaves about 22% bit-identical), and the verdict names the issue's
goals."""

from __future__ import annotations

import pytest

from bench.delta_link import rl_step_, verdict


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05, 0.3, 1.0])
def test_rl_step_changes_about_the_asked_share(density: float) -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(1 << 20, generator=gen) * 0.02).to(torch.bfloat16)
    before = t.clone()
    rl_step_([t], density, seed=1)
    changed = (t.view(torch.int16) != before.view(torch.int16)).float().mean().item()
    assert t.dtype == torch.bfloat16
    assert 0.6 * density <= changed <= 0.85 * density, f"{changed:.4f} changed at density {density}"


def test_rl_step_is_seeded() -> None:
    import torch

    a = (torch.arange(4096, dtype=torch.float32) / 4096).to(torch.bfloat16)
    b = a.clone()
    rl_step_([a], 0.3, seed=5)
    rl_step_([b], 0.3, seed=5)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_verdict_checks_the_goals_at_one_percent() -> None:
    rows = [{"model": "350m", "path": "loopback", "density": 0.01, "wire_over_dense": 0.006, "dense_over_delta": 0.5, "delta_over_b": 1.5},
            {"model": "350m", "path": "1gbit", "density": 0.01, "wire_over_dense": 0.006, "dense_over_delta": 12.0, "delta_over_b": 9.0},
            {"model": "350m", "path": "1gbit", "density": 0.3, "wire_over_dense": 0.1, "dense_over_delta": 2.0, "delta_over_b": 9.0}]
    lines = verdict(rows)
    assert len(lines) == 4
    assert "delta / B 1.50 (goal <= 1.2 at 350m): MISSED" in lines[1]
    assert lines[3].endswith("dense / delta 12.0x (goal >= 10x): met")


def test_verdict_gives_each_syncs_ratio_and_the_1gbit_bar_against_b() -> None:
    rows = [{"model": "350m", "path": "loopback", "density": 0.01, "wire_over_dense": 0.006, "dense_over_delta": 2.0,
             "delta_over_b": 1.1, "delta": {"seconds": 0.66, "seconds_all": [0.60, 0.66, 0.78]}, "dense": {"seconds": 1.3}},
            {"model": "350m", "path": "1gbit", "density": 0.01, "wire_over_dense": 0.006, "dense_over_delta": 9.5,
             "delta_over_b": 1.1, "dense_over_b": 10.5, "delta": {"seconds": 0.64, "seconds_all": [0.60, 0.64, 0.75]},
             "dense": {"seconds": 6.0}}]
    lines = verdict(rows)
    assert lines[1] == "350m loopback 1%: delta / B 1.10 (goal <= 1.2 at 350m; per sync 1.00-1.30): met"
    assert lines[3] == "350m 1gbit 1%: dense / delta 9.5x (goal >= 10x; per sync 8.0-10.0x): MISSED"
    assert lines[4] == "350m 1gbit 1%: the 10x bar is a delta sync of 0.600 s, 1.05x baseline B in this row"
