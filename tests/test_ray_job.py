"""The Ray job (GRPO loop, two engines of a fleet fed by one publish) passes every sync and the reward rises, on a
3-node Ray cluster whose worker nodes are hosts of their own.

``devtools/netns_cluster.py`` (each worker node a network namespace on a bridge with a private /dev/shm and its
own raylet; the head in this namespace with the jobs API; the session's, shared with tests/test_fleet.py), then
``ray job submit --working-dir <repo> --no-wait -- python -m apps.ray_job --loop grpo --engines 2
--node-resource wb_worker`` with ``configs/same-host.yaml``: the fleet (apps/fleet.py) puts one engine on each
worker node behind that node's relay (bound to the node's address, CURVE keys made by the fleet), so each version
crosses to each node once; the engines start without a checkpoint and get the initial policy as version 1. Poll
until the job ends, read its logs: the job succeeded, every sync passed on both engines (applied, audited, probe
within bound, handed over by the relay over shm) and the GRPO reward rose. While the job runs, ``weight-bridge
serve --actor`` polls the job's two named inference actors, as an operator's dashboard would.

The same job with ``--lora 8`` (one engine started with LoRA enabled, on the head) trains a LoRA adapter on the
frozen base: every sync carries the adapter alone and is verified, the base stays at version 1 (the initial
policy), the reward rises.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import NETNS_WORKER_RESOURCE, ROOT, child_env, free_port

pytestmark = pytest.mark.engine

STEPS = 16
ACTOR = "engine-rayjob"
ACTORS = [ACTOR, f"{ACTOR}-1"]  # --engines 2: the job names the second engine NAME-1
BIN = Path(sys.executable).parent
WORKER_RESOURCE = NETNS_WORKER_RESOURCE  # held by the cluster's two worker nodes: the GRPO job's engines go there, one each
JOB_TIMEOUT_S = 600
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _ray_env(token: str) -> dict[str, str]:
    """Ray 2.60 turns token authentication on for `ray start` whenever ~/.ray/auth_token exists (any earlier
    ray.init creates it), and then every client needs the token: every process we start (job submit/status/logs,
    dashboard) gets the cluster's."""
    env = child_env(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0",
                    RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


def _ray(head: dict[str, Any], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "ray"), *args], env=_ray_env(head["token"]), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _job_status(head: dict[str, Any], submission_id: str) -> str:
    """The status `ray job status` prints, in JobStatus spelling (its wording differs per status)."""
    proc = _ray(head, "job", "status", "--address", head["dashboard"], "--log-style", "record", submission_id)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    job = re.escape(f"'{submission_id}'")
    for pattern, status in ((rf"Job {job} succeeded", "SUCCEEDED"), (rf"Job {job} failed", "FAILED"),
                            (rf"Job {job} was stopped", "STOPPED")):
        if re.search(pattern, out):
            return status
    found = re.search(rf"Status for job {job}: (?:JobStatus\.)?(\w+)", out)
    return found.group(1) if found else f"UNKNOWN (rc {proc.returncode}: {out[-300:]!r})"


@pytest.fixture(scope="module")
def head(netns_cluster: Any) -> Any:
    """A 3-node Ray cluster on this host whose two worker nodes are hosts of their own (the session's namespace
    cluster, tests/conftest.py: network and mount namespaces, a raylet each) and hold the ``wb_worker`` resource
    the job places its engines by; the head (this namespace) runs the dashboard and the job's driver."""
    cluster = netns_cluster
    return {"dashboard": cluster.dashboard, "gcs": cluster.address, "ips": [n.ip for n in cluster.plan.nodes],
            "token": cluster.token}


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read().decode())


def _start_dashboard(head: dict[str, Any]) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "apps.cli", "serve", "--port", str(port), "--ray-address", head["gcs"],
           *[arg for name in ACTORS for arg in ("--actor", name)], "--poll-interval", "0.5"]
    proc = subprocess.Popen(cmd, env=_ray_env(head["token"]), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _render_dashboard(url: str) -> Any:
    """The live dashboard in headless Chromium after the job's syncs: its DOM, and a screenshot artefact."""
    from tests.helpers import ARTIFACTS
    from tests.test_dashboard import CHROMIUM, DomParser, chromium

    if not CHROMIUM.exists():
        return None
    ARTIFACTS.mkdir(exist_ok=True)
    chromium("--virtual-time-budget=5000", f"--screenshot={ARTIFACTS / 'dashboard-live.png'}", "--window-size=1280,900",
             f"{url}/", timeout=180)
    proc = chromium("--virtual-time-budget=5000", "--dump-dom", f"{url}/", timeout=180)
    (ARTIFACTS / "dashboard-live.html").write_text(proc.stdout)
    parser = DomParser()
    parser.feed(proc.stdout)
    return parser.root


@pytest.fixture(scope="module")
def job(head: Any) -> Any:
    """Submit the GRPO job, watch it (and its actor through the dashboard) until it ends."""
    submission_id = f"wb-grpo-{uuid.uuid4().hex[:8]}"
    entry = ["python", "-m", "apps.ray_job", "--loop", "grpo", "--steps", str(STEPS),
             "--actor-name", ACTOR, "--engines", str(len(ACTORS)), "--node-resource", WORKER_RESOURCE,
             "--config", "configs/same-host.yaml", "--linger", "30"]
    address = head["dashboard"]
    submit = _ray(head, "job", "submit", "--address", address, "--working-dir", str(ROOT), "--submission-id", submission_id,
                  "--no-wait", "--", *entry, timeout=300)
    assert submit.returncode == 0, f"ray job submit failed:\n{submit.stdout[-2000:]}\n{submit.stderr[-3000:]}"
    dashboard, url = _start_dashboard(head)
    views: list[dict[str, Any]] = []
    page, rendered_live = None, False
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        status = _job_status(head, submission_id)
        while status not in TERMINAL and time.monotonic() < deadline:
            try:
                views.append(_get_json(f"{url}/api/engines"))
            except OSError:
                pass  # the dashboard is still starting
            if page is None and views and _all_served(views[-1]):
                # the job's last sync landed and it lingers: the LoRA job (its engine on the head) starts meanwhile
                if "lora" not in _EARLY:
                    _EARLY["lora"] = _submit_lora(head)
                page, rendered_live = _render_dashboard(url), True  # while the job lingers: engines still up
            time.sleep(1.0)
            status = _job_status(head, submission_id)
        if status not in TERMINAL:
            _ray(head, "job", "stop", "--address", address, submission_id)
        if page is None:
            page = _render_dashboard(url)
    finally:
        dashboard.terminate()
        dashboard.wait(30)
    logs = _ray(head, "job", "logs", "--address", address, submission_id).stdout
    lines = [json.loads(x) for x in logs.splitlines() if x.startswith("{")]
    return {"status": status, "logs": logs, "steps": [x for x in lines if "step" in x],
            "summary": next((x["summary"] for x in lines if "summary" in x), None), "views": views,
            "page": page, "rendered_live": rendered_live, "ips": head["ips"]}


def _all_served(view: dict[str, Any]) -> bool:
    """Every engine of the job is up and serves the last version: the job's final sync landed."""
    engines = {e.get("engine"): e for e in view.get("engines", [])}
    return all(engines.get(a, {}).get("version") == STEPS + 1 and engines[a].get("health") == "ok" for a in ACTORS)


def test_job_succeeds_and_every_sync_passed(job: Any) -> None:
    assert job["status"] == "SUCCEEDED", f"job ended {job['status']}:\n{job['logs'][-4000:]}"
    steps = job["steps"]
    assert [s["version"] for s in steps] == list(range(2, STEPS + 2)), job["logs"][-4000:]
    # on-policy: every rollout of a step was sampled from the version published before it (1: the initial policy)
    assert [s["rollouts_from"] for s in steps] == [[v] for v in range(1, STEPS + 1)], [s["rollouts_from"] for s in steps]
    for s in steps:
        sync = s["sync"]
        assert [e["engine"] for e in sync["engines"]] == ACTORS, sync  # one publish reached both engines
        assert sync["fleet"]["copies_sent"] == 2 and sync["fleet"]["published"], sync["fleet"]  # one copy per node
        for eng in sync["engines"]:
            assert eng["ok"] and eng["verified"] and eng["transport"] == "shm", eng
            assert eng["tensors_audited"] > 0 and not eng["stale_tensors"] and not eng["identity_violations"], eng
            assert eng["probe_mean_abs_logprob_diff"] is not None and not eng["probe_flagged"], eng
    summary = job["summary"]
    assert summary and summary["syncs"] == summary["syncs_passed"] == STEPS and summary["failed_versions"] == [], summary
    assert summary["engines"] == ACTORS and sorted(summary["nodes"].values()) == [1, 1], summary  # one per worker node
    # each worker node's relay listens on that node's own address
    assert [r.split("//")[1].rsplit(":", 1)[0] for r in summary["relays"]] == sorted(job["ips"]), summary["relays"]


def test_grpo_reward_rises(job: Any) -> None:
    rewards = [s["reward"] for s in job["steps"]]
    assert len(rewards) == STEPS, job["logs"][-4000:]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    # Chance level is 64/512 = 0.125; runs reach 0.6-0.8 by step 16 (lr 3e-3, groups of 8).
    assert last > first + 0.25, f"reward did not rise: first steps {rewards[:4]}, last steps {rewards[-4:]}"


@pytest.mark.parametrize("actor", ACTORS)
def test_dashboard_polls_the_named_actors(job: Any, actor: str) -> None:
    """`weight-bridge serve --actor NAME` found each of the job's actors and followed its versions to the last one."""
    seen = [e for view in job["views"] for e in view.get("engines", []) if e.get("engine") == actor]
    assert seen, f"the dashboard never saw engine {actor}: {job['views'][-3:]}"
    assert max(e["version"] for e in seen) == STEPS + 1, seen[-1]
    assert any(e.get("health") == "ok" for e in seen), seen[-1]
    # the GRPO example's 4 prompts x 8 samples per step, split evenly: each engine served its half
    share = 4 * 8 // len(ACTORS)
    assert max(e.get("sequences_generated") or 0 for e in seen) == STEPS * share, seen[-1]


def test_live_dashboard_in_chromium_charts_every_sync(job: Any) -> None:
    """Headless Chromium on the dashboard that followed the job, while the job lingers after its last
    step: both engines listed at the last version and healthy, no alert, one latency, throughput and probe
    point per sync of each engine, and a screenshot kept as artifacts/dashboard-live.png."""
    from tests.helpers import ARTIFACTS

    page = job["page"]
    if page is None:
        pytest.skip("/usr/bin/chromium is absent: run scripts/setup_system.sh")
    for chart in ("chart-latency", "chart-throughput", "chart-probe"):
        for actor in ACTORS:
            points = [p for p in page.find(chart).find_all("chart-point") if p.attrs.get("data-engine") == actor]
            assert len(points) == STEPS + 1, (f"{chart}: {len(points)} points for {actor}, expected one per sync ({STEPS + 1}); "
                                          f"page in {ARTIFACTS / 'dashboard-live.html'}")
    assert job["rendered_live"], "the job ended before the dashboard showed every engine at its last version"
    rows = {r.attrs["data-engine"]: r for r in page.find_all("engine-row")}
    assert sorted(rows) == ACTORS, sorted(rows)
    share = 4 * 8 // len(ACTORS)  # rollouts per step each engine served
    for actor in ACTORS:  # rendered while the job lingered: both engines up, current, healthy, each its rollouts
        row = rows[actor]
        assert (row.find("engine-version").text, row.find("engine-health").text) == (f"v{STEPS + 1}", "ok")
        assert row.find("engine-rollouts").text == str(STEPS * share)
    # the fleet by node: each engine's row names its worker node's address
    assert sorted(rows[a].find("engine-node").text for a in ACTORS) == sorted(job["ips"]), [r.text for r in rows.values()]
    assert page.find_all("alert-item") == [], [i.text for i in page.find_all("alert-item")]
    shot = (ARTIFACTS / "dashboard-live.png").read_bytes()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 30_000, "the screenshot is missing or blank"


# ---- --lora: the same GRPO job training a LoRA adapter, syncing only the adapter ------------------

LORA_STEPS = 32
LORA_RANK = 8
LORA_ACTOR = "engine-rayjob-lora"


def _lora_bytes(rank: int) -> tuple[int, int]:
    """Bytes on the wire (bfloat16) of the tiny policy's rank-``rank`` adapter on every linear layer of its
    decoder blocks, and of the whole policy."""
    from devtools.tiny_models import DENSE_PRESETS

    d = DENSE_PRESETS["tiny"]
    h, i, vocab, layers = d["hidden_size"], d["intermediate_size"], d["vocab_size"], d["num_hidden_layers"]
    adapter = layers * (4 * (rank * h + h * rank) + 2 * (rank * h + i * rank) + (rank * i + h * rank))
    full = 2 * vocab * h + h + layers * (4 * h * h + 3 * h * i + 2 * h + 3 * h)  # q/k/v biases: Qwen2
    return 2 * adapter, 2 * full


_EARLY: dict[str, str] = {}  # the LoRA job's submission id, when the GRPO job's fixture submitted it early


def _submit_lora(head: dict[str, Any]) -> str:
    """Submit the GRPO job with ``--lora`` (not waiting for it); its submission id."""
    submission_id = f"wb-grpo-lora-{uuid.uuid4().hex[:8]}"
    entry = ["python", "-m", "apps.ray_job", "--loop", "grpo", "--lora", str(LORA_RANK), "--steps", str(LORA_STEPS),
             "--actor-name", LORA_ACTOR]
    submit = _ray(head, "job", "submit", "--address", head["dashboard"], "--working-dir", str(ROOT), "--submission-id",
                  submission_id, "--no-wait", "--", *entry, timeout=300)
    assert submit.returncode == 0, f"ray job submit failed:\n{submit.stdout[-2000:]}\n{submit.stderr[-3000:]}"
    return submission_id


@pytest.fixture(scope="module")
def lora_job(head: Any) -> Any:
    """The GRPO job with ``--lora 8`` on one engine (the default config: ZMQ to the node's relay), run to its end
    (submitted while the GRPO job lingered, when that one ran first)."""
    submission_id = _EARLY.pop("lora", None) or _submit_lora(head)
    address = head["dashboard"]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    status = _job_status(head, submission_id)
    while status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(2.0)
        status = _job_status(head, submission_id)
    if status not in TERMINAL:
        _ray(head, "job", "stop", "--address", address, submission_id)
    logs = _ray(head, "job", "logs", "--address", address, submission_id).stdout
    lines = [json.loads(x) for x in logs.splitlines() if x.startswith("{")]
    return {"status": status, "logs": logs, "steps": [x for x in lines if "step" in x],
            "summary": next((x["summary"] for x in lines if "summary" in x), None)}


def test_lora_job_syncs_only_the_adapter_and_every_sync_is_verified(lora_job: Any) -> None:
    """Each step publishes the adapter alone (its bytes, a fraction of the model's); the base stays at version
    0; every sync is applied and verified, and every engine output after it names the adapter version just
    published, with log-probs within the probe bound of the trainer's float32 ones."""
    assert lora_job["status"] == "SUCCEEDED", f"job ended {lora_job['status']}:\n{lora_job['logs'][-4000:]}"
    steps = lora_job["steps"]
    assert [s["version"] for s in steps] == list(range(1, LORA_STEPS + 1)), lora_job["logs"][-4000:]
    # on-policy: every step's rollouts came from the adapter version published before it (0: none yet, the base)
    assert [s["rollouts_from"] for s in steps] == [[v] for v in range(LORA_STEPS)], [s["rollouts_from"] for s in steps]
    assert all(s["base_versions"] == [1] for s in steps), [s["base_versions"] for s in steps]  # the initial policy
    adapter_bytes, full_bytes = _lora_bytes(LORA_RANK)
    assert adapter_bytes < full_bytes / 10
    for s in steps:
        sync = s["sync"]
        assert sync["adapter"] == "grpo" and sync["bytes"] == adapter_bytes, (sync["bytes"], adapter_bytes, full_bytes)
        assert sync["ok"] and sync["verified"] and not sync["stale_tensors"], sync
        assert sync["probe_by"] == "trainer" and not sync["probe_flagged"], sync
        (eng,) = sync["engines"]
        assert eng["engine"] == LORA_ACTOR and eng["transport"] == "shm", eng  # from the node's relay
        assert eng["adapter_versions_served"] == [s["version"]], eng
        assert eng["probe_mean_abs_logprob_diff"] is not None and eng["probe_mean_abs_logprob_diff"] < 0.05, eng
    summary = lora_job["summary"]
    assert summary and summary["lora"] == LORA_RANK, summary
    assert summary["syncs"] == summary["syncs_passed"] == LORA_STEPS and summary["failed_versions"] == [], summary


def test_lora_job_reward_rises(lora_job: Any) -> None:
    rewards = [s["reward"] for s in lora_job["steps"]]
    assert len(rewards) == LORA_STEPS, lora_job["logs"][-4000:]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    # Chance level is 64/512 = 0.125. A rank-8 adapter without lm_head first learns to tilt every output
    # towards the targets (0.22-0.29 by steps 24-32, a rise of 0.09-0.13 over the first 8 steps), and in some
    # runs then concentrates on a few of them (0.5-0.65). An adapter that never reaches the engine: +0.03.
    assert last > first + 0.06, f"reward did not rise: first steps {rewards[:8]}, last steps {rewards[-8:]}"
