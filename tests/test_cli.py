"""The ``weight-bridge`` command line: help of every subcommand, ``serve`` with preloaded records, ``health``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.dashboard import DashboardService
from apps.metrics import MetricsHub
from tests.dashboard_fixtures import ok_record, sample_records, status
from tests.helpers import ROOT, child_env, free_port


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(), timeout=timeout, check=False)


@pytest.mark.parametrize(("command", "mentions"), [
    ("serve", ["--port", "--host", "--records", "--config", "--actor", "--vllm-serve", "/metrics", "/api/records",
               "/api/engines"]),
    ("health", ["--url", "--timeout", "Exit status", "DEGRADED", "UNREACHABLE"]),
    ("demo", ["apps.demo", "every option", "weight-bridge demo"]),
    ("bench", ["bench/run.py", "every option", "weight-bridge bench"]),
    ("relay", ["--engine", "--config", "shared memory", "names the engine", "--port"]),
    ("keys", ["NAME.key", "NAME.key_secret", "--dir", "transport.curve_clients", "transport.curve_client_secret"]),
    ("sweep-shm", ["--min-age", "psm_", "exit status 1"]),
])
def test_subcommand_help_exits_0_and_explains_its_options(command: str, mentions: list[str]) -> None:
    proc = cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: weight-bridge {command}")
    for text in mentions:
        assert text in proc.stdout, f"`{command} --help` does not mention {text!r}:\n{proc.stdout}"


def test_top_level_help_lists_every_subcommand() -> None:
    script = Path(sys.executable).parent / "weight-bridge"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "apps.cli"]
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=60)
    assert proc.returncode == 0
    for command in ("demo", "serve", "bench", "health", "relay", "keys", "sweep-shm"):
        assert re.search(rf"^\s+{command}\s", proc.stdout, re.M), proc.stdout


def test_serve_rejects_unknown_options() -> None:
    proc = cli("serve", "--bogus")
    assert proc.returncode == 2 and "--bogus" in proc.stderr


def test_serve_preloads_records_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r.to_dict()) for r in sample_records()) + "\n\n")
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "serve", "--port", "0", "--records", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=child_env())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+)/", line)
        assert match, f"serve printed {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        with urllib.request.urlopen(f"{match.group(1)}/api/records", timeout=10) as resp:
            records = json.loads(resp.read())
        assert [(r["engine"], r["version"]) for r in records] == [(r.engine, r.version) for r in sample_records()]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_serve_reports_a_bad_records_file_by_line(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(ok_record("a", 1, 1.0).to_dict()) + "\nnot json\n")
    proc = cli("serve", "--port", "0", "--records", str(path))
    assert proc.returncode == 2 and f"{path}:2: not a sync record" in proc.stderr


@pytest.fixture
def dashboard() -> Iterator[DashboardService]:
    svc = DashboardService(MetricsHub(), port=0).start()
    yield svc
    svc.stop()


def test_health_is_0_when_every_engine_is_ok(dashboard: DashboardService) -> None:
    dashboard.hub.observe(ok_record("engine-a", 4, 1.0))
    dashboard.hub.set_engine_status(status("engine-a", 4))
    proc = cli("health", "--url", dashboard.url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.fullmatch(r"OK\s+engine-a  v4  lag 0\n", proc.stdout)


def test_health_is_nonzero_with_a_degraded_engine(dashboard: DashboardService) -> None:
    dashboard.hub.set_engine_status(status("engine-a", 4))
    dashboard.hub.set_engine_status(status("engine-b", 3, degraded="update to v4 failed after loading began: stale"))
    proc = cli("health", "--url", dashboard.url)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("OK")
    assert lines[1].startswith("DEGRADED    engine-b  v3  lag 1") and "failed after loading began" in lines[1]


def test_health_is_nonzero_with_an_unreachable_engine(dashboard: DashboardService) -> None:
    dashboard.hub.set_engine_status(status("engine-a", 4))
    dashboard.hub.set_engine_unreachable("engine-a", "ConnectionError: actor died")
    proc = cli("health", "--url", dashboard.url)
    assert proc.returncode == 1 and proc.stdout.startswith("UNREACHABLE engine-a") and "actor died" in proc.stdout


def test_health_is_nonzero_when_no_engine_is_known(dashboard: DashboardService) -> None:
    proc = cli("health", "--url", dashboard.url)
    assert proc.returncode == 1 and "knows no engine" in proc.stdout


def test_health_is_2_when_the_dashboard_is_unreachable() -> None:
    proc = cli("health", "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "2")
    assert proc.returncode == 2 and proc.stdout.startswith("UNREACHABLE dashboard")
