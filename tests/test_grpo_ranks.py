"""The GRPO example with a trainer of two ranks (``--trainer-ranks 2``, apps/grpo_ranks.py): the policy FSDP2-sharded
over two gloo ranks, each publishing its own shards with ``RankedPublisher``, trains with rising reward, every sync
applied and verified (probe within bound), the engine ending on the last version, under both launchers:

* torchrun: ``torchrun --nproc-per-node 2 examples/grpo_toy.py --trainer-ranks 2`` (rank 0 starts the engine as a
  Ray actor in the test's cluster), over shared memory (``configs/same-host.yaml``);
* Ray Train: ``ray job submit -- python -m apps.ray_job --loop grpo --trainer-ranks 2`` (the job's driver starts
  the engine and a ``TorchTrainer`` of two CPU workers), over ZMQ (the default config).

One Ray head with the jobs API for the module, on this test's own ports and temp dir, with its own auth token.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.engine

STEPS = 12
BIN = Path(sys.executable).parent
GCS_PORT, DASHBOARD_PORT, TORCHRUN_PORT = 26040, 26041, 26042
HEAD_PORTS = {"--ray-client-server-port": 26043, "--dashboard-agent-listen-port": 26044,
              "--dashboard-agent-grpc-port": 26045, "--node-manager-port": 26046, "--object-manager-port": 26047,
              "--metrics-export-port": 26048, "--runtime-env-agent-port": 26049,
              "--min-worker-port": 26060, "--max-worker-port": 26099}
TOKEN = uuid.uuid4().hex + uuid.uuid4().hex  # see tests/test_ray_job.py: a private token for every process we start
RUN_TIMEOUT_S = 900


def _env() -> dict[str, str]:
    env = child_env(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0",
                    RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


def _ray(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "ray"), *args], env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def head() -> Any:
    """A one-node Ray head with the jobs API on this test's ports; everything it started is killed afterwards."""
    from devtools.netns_cluster import _kill_tree

    temp = tempfile.mkdtemp(prefix="wb-grpo-ranks-", dir="/tmp")  # short: unix socket paths
    ports = [f"{flag}={port}" for flag, port in HEAD_PORTS.items()]
    start = _ray("start", "--head", f"--port={GCS_PORT}", "--num-cpus=8", "--include-dashboard=true",
                 "--dashboard-host=127.0.0.1", f"--dashboard-port={DASHBOARD_PORT}", *ports, f"--temp-dir={temp}",
                 "--disable-usage-stats", timeout=180)
    try:
        assert start.returncode == 0, f"ray start failed:\n{start.stdout[-2000:]}\n{start.stderr[-2000:]}"
        yield {"gcs": f"127.0.0.1:{GCS_PORT}", "jobs": f"http://127.0.0.1:{DASHBOARD_PORT}"}
    finally:
        _kill_tree(temp)
        _kill_tree(f"--port={HEAD_PORTS['--ray-client-server-port']}")  # the client server names no temp dir
        shutil.rmtree(temp, ignore_errors=True)


def _json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _assert_trained(lines: list[dict[str, Any]], transport: str, log: str) -> None:
    """Every step's weights were published by both ranks and verified on the engine, rollouts came from the
    version just published, the reward rose and the engine ends on the last version."""
    steps = [x for x in lines if "step" in x]
    (summary,) = [x["summary"] for x in lines if "summary" in x]
    assert [x["version"] for x in steps] == list(range(1, STEPS + 1)), log[-4000:]
    for x in steps:
        sync = x["sync"]
        assert x["trainer_ranks"] == 2 and x["rollouts_from"] == [x["version"] - 1], x
        assert sync["ok"] and sync["verified"] and not sync["probe_flagged"], sync
        assert sync["probe_mean_abs_logprob_diff"] is not None and sync["tensors_audited"] > 0, sync
        assert not sync["stale_tensors"] and not sync["identity_violations"], sync
        assert [e["transport"] for e in sync["engines"]] == [transport], sync
    assert summary["engine_versions"] == [STEPS] and summary["failed_versions"] == [], summary
    rewards = [x["reward"] for x in steps]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"trainer ranks 2 ({transport}): reward first steps {rewards[:3]} -> last steps {rewards[-3:]}")
    assert last > first + 0.1, f"reward did not rise: first steps {rewards[:3]}, last steps {rewards[-3:]}"


def test_torchrun_two_ranks_train_with_rising_reward_over_shm(head: Any) -> None:
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(TORCHRUN_PORT),
           "examples/grpo_toy.py", "--trainer-ranks", "2", "--steps", str(STEPS), "--ray-address", head["gcs"],
           "--actor-name", "wb-grpo-ranks-torchrun", "--config", "configs/same-host.yaml"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    log = f"{proc.stdout}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"torchrun failed:\n{log[-8000:]}"
    print(f"torchrun run: {time.monotonic() - t0:.0f}s")
    _assert_trained(_json_lines(proc.stdout), "shm", log)


def test_ray_job_two_ranks_train_with_rising_reward_over_zmq(head: Any) -> None:
    submission_id = f"wb-grpo-ranks-{uuid.uuid4().hex[:8]}"
    entry = ["python", "-m", "apps.ray_job", "--loop", "grpo", "--trainer-ranks", "2", "--steps", str(STEPS),
             "--actor-name", "wb-grpo-ranks-job", "--cpus-per-rank", "1"]
    t0 = time.monotonic()
    try:
        submit = _ray("job", "submit", "--address", head["jobs"], "--working-dir", str(ROOT), "--submission-id",
                      submission_id, "--", *entry, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _ray("job", "stop", "--address", head["jobs"], submission_id)
        raise
    logs = _ray("job", "logs", "--address", head["jobs"], submission_id).stdout
    out = f"{submit.stdout[-3000:]}\n{submit.stderr[-3000:]}\n{logs}"
    assert submit.returncode == 0 and f"Job '{submission_id}' succeeded" in submit.stdout + submit.stderr, out[-8000:]
    print(f"ray job run: {time.monotonic() - t0:.0f}s")
    _assert_trained(_json_lines(logs), "zmq", out)
