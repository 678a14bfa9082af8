"""`make demo` end to end: the trainer process publishes versions into a running engine, every sync
line says verified, and the final outputs equal an engine cold-loaded from the last version."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.engine


def test_demo_prints_verified_sync_lines_and_matches_cold_load(tmp_path: Any) -> None:
    proc = subprocess.run([sys.executable, "-m", "apps.cli", "demo", "--syncs", "2", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\n{out}\n{proc.stderr[-3000:]}"
    lines = [x for x in out.splitlines() if re.match(r"v\d+  ", x)]
    assert [x.split()[0] for x in lines] == ["v2", "v3"], out
    for line in lines:
        assert "  ok  " in line and "[verified: stale 0, storage moved 0, sinks routed 2," in line, line
    assert "engine serves v3; outputs changed since v1 and equal an engine cold-loaded from v3" in out, out
    assert (tmp_path / "records.jsonl").read_text().count('"ok": true') == 2
