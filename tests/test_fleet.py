"""A fleet across Ray nodes (apps/fleet.py): engines placed on three nodes of a real Ray cluster, one relay per
node, engines that start without a checkpoint and join (or rejoin after being killed) current, dead relays found.

A 3-node Ray cluster on this host whose two worker nodes are hosts of their own (network and mount namespaces,
devtools/netns_cluster.py; the session's, shared with tests/test_ray_job.py; where an actor runs is checked by its node id and address), real ``RelayActor``s and real vLLM engines (tiny Qwen2, ``InferenceActor``
started from a ``ModelSpec``: config files and tensor table only, ``load_format="dummy"``). The scenario runs
once (module fixture) and the tests check what it saw; the oracle is an engine cold-loaded from each version
the trainer published (devtools/coldload.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.engine

PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300, 7]]
# below the kernel's ephemeral ports (32768-60999), where Ray's agents on a node listen on random ones (a runtime-env
# agent once took 43901, which the second relay wanted), and above Ray's worker ports (10002-19999)
RELAY_PORT = 29900


@pytest.fixture(scope="module")
def cluster(netns_cluster: Any) -> Any:
    """Three Ray nodes on this host, the two worker nodes hosts of their own (the session's namespace cluster,
    tests/conftest.py: a network namespace each on a bridge, a private /dev/shm, a raylet started with the node's
    address). Relays bind their node's address, so the publisher in this process reaches them over the bridge,
    with the fleet's CURVE keys. This process joins as a driver whose actors import this checkout."""
    from tests.helpers import ray_connected

    c = netns_cluster
    with ray_connected(c.address, c.env(), namespace="wb-fleet-test",
                       runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}) as ray:
        by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        ips = [c.plan.head_ip, *(n.ip for n in c.plan.nodes)]
        yield {"cluster": c, "nodes": [by_ip[ip] for ip in ips], "ips": ips}


def _weights(seed: int) -> Any:
    from devtools.tiny_models import build_model

    return build_model("tiny", seed)


def _outputs(handle: Any) -> dict[str, Any]:
    import ray

    outs = ray.get(handle.generate.remote(PROMPTS, max_tokens=8, logprobs=0), timeout=300)
    return {"version": {o["version"] for o in outs}, "tokens": [o["token_ids"] for o in outs],
            "logprobs": [o["logprobs"] for o in outs]}


def _relay_status(fleet: Any, node: str) -> dict[str, Any]:
    import ray

    return dict(ray.get(fleet.relays[node].handle.status.remote(), timeout=60))


@pytest.fixture(scope="module")
def run(cluster: Any, tmp_path_factory: Any) -> Any:
    """The scenario: 3 engines (one per node) start without weights and refuse to generate; v1, v2 published
    (one copy per node); an engine added at v2 on node a; an engine on node b killed and restarted by Ray while
    v3 is published, every engine then generates at v3; the relay of node a killed, v4 published."""
    import psutil
    import ray

    from apps.fleet import Fleet, FleetUpdateFailed
    from bridge.checkpoint import ModelSpec
    from bridge.errors import NotReady
    from devtools.tiny_models import save_checkpoint

    tmp: Path = tmp_path_factory.mktemp("fleet")
    head, node_a, node_b = cluster["nodes"]
    spec = ModelSpec.from_checkpoint(save_checkpoint(_weights(0), tmp / "v0"))  # headers + config only
    seen: dict[str, Any] = {"nodes": cluster["nodes"], "ips": cluster["ips"], "checkpoints": {}}
    # relays on fixed ports counting up from RELAY_PORT (a restarted relay gets a new one)
    fleet = Fleet(spec, dtype="bfloat16", nodes=[head, node_a, node_b], namespace="wb-fleet-test", name="wbf",
                  relay_port=RELAY_PORT, probe_timeout_s=8.0, start_timeout_s=600.0)
    try:
        t0 = time.monotonic()
        seen["first"] = fleet.add(3)
        seen["timings"] = {"start": time.monotonic() - t0}
        seen["placed"] = {n: fleet.members[n].node for n in seen["first"]}
        seen["actor_nodes"] = {n: ray.get(fleet.members[n].handle.status.remote(), timeout=60)["node"] for n in seen["first"]}
        seen["ready_before"] = {n: ray.get(fleet.members[n].handle.ready.remote(), timeout=60) for n in seen["first"]}
        try:
            ray.get(fleet.members[seen["first"][0]].handle.generate.remote(PROMPTS), timeout=120)
            seen["refused"] = None
        except NotReady as exc:  # Ray raises the actor's own exception type (a subclass of it)
            seen["refused"] = str(exc)

        def publish(version: int) -> Any:
            model = _weights(version)
            seen["checkpoints"][version] = str(save_checkpoint(model, tmp / f"v{version}"))
            try:
                return fleet.publish(model.named_parameters(), version=version)
            except FleetUpdateFailed as exc:
                seen.setdefault("failed", {})[version] = str(exc)
                return exc.report

        seen["v1"], seen["v2"] = publish(1), publish(2)
        seen["relays_v2"] = {node: _relay_status(fleet, node) for node in fleet.relays}
        seen["out_v2"] = {n: _outputs(fleet.members[n].handle) for n in seen["first"]}

        # an engine added at version 2 on node a: current before its first request
        t0 = time.monotonic()
        (late,) = fleet.add(1, nodes=[node_a])
        seen["timings"]["add"] = time.monotonic() - t0
        seen["late"] = late
        seen["late_status"] = ray.get(fleet.members[late].handle.status.remote(), timeout=60)
        seen["late_records"] = ray.get(fleet.members[late].handle.records.remote(), timeout=60)
        seen["late_model_files"] = sorted(p.name for p in Path(seen["late_status"].get("model_path", "/nonexistent")).glob("*"))
        seen["late_out"] = _outputs(fleet.members[late].handle)

        # kill node b's engine (Ray restarts it); v3 is published while it is down
        victim = next(n for n in seen["first"] if fleet.members[n].node == node_b)
        seen["victim"] = victim
        old_pids = ray.get(fleet.members[victim].handle.status.remote(), timeout=60)["cores"]["worker_pids"]
        t0 = time.monotonic()
        ray.kill(fleet.members[victim].handle, no_restart=False)
        # ray.kill returns before the actor dies: a probe that reaches it first sees it alive. Wait until its
        # vLLM workers (which exit with it) are gone, long before Ray's restart of it can serve again
        gone = time.monotonic() + 60
        while any(psutil.pid_exists(p) for p in old_pids) and time.monotonic() < gone:
            time.sleep(0.2)
        assert not any(psutil.pid_exists(p) for p in old_pids), f"{victim}'s workers {old_pids} outlived its kill by 60 s"
        seen["v3"] = publish(3)
        deadline = time.monotonic() + 600
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                status = ray.get(fleet.members[victim].handle.status.remote(), timeout=30)
                break
            except Exception:  # noqa: BLE001 - still restarting
                time.sleep(2)
        seen["victim_status"] = status
        seen["victim_out"] = _outputs(fleet.members[victim].handle)  # its first request since the restart
        seen["victim_records"] = ray.get(fleet.members[victim].handle.records.remote(), timeout=60)
        seen["probe_v3"] = fleet.probe()  # found up again
        seen["out_v3"] = {n: _outputs(fleet.members[n].handle) for n in fleet.members}
        seen["relay_b"] = _relay_status(fleet, node_b)
        seen["sweeps"] = list(fleet.sweeps)
        seen["timings"]["restart"] = time.monotonic() - t0

        # the relay of node a dies
        ray.kill(fleet.relays[node_a].handle, no_restart=True)
        seen["v4"] = publish(4)
        seen["status"] = fleet.status()
        seen["members"] = {n: m.to_dict() for n, m in fleet.members.items()}
        seen["history"] = list(fleet.history)

        # the next publish restarts it: a new relay on node a, seeded by a peer, its engines rejoin it
        old_relay = fleet.relays[node_a].endpoint
        seen["v5"] = publish(5)
        try:
            relay_a = _relay_status(fleet, node_a)
        except Exception as exc:  # noqa: BLE001 - not restarted: the dead actor answers nothing
            relay_a = {"error": repr(exc), "joins": []}
        seen["relay_a_v5"] = {"old": old_relay, "new": fleet.relays[node_a].endpoint,
                              "state": fleet.relays[node_a].state, "status": relay_a}
        seen["out_v5"] = {n: _outputs(fleet.members[n].handle) for n in fleet.members}
    finally:
        t0 = time.monotonic()
        fleet.close()
        seen.setdefault("timings", {})["close"] = time.monotonic() - t0
    from tests.helpers import cold_loader

    t0 = time.monotonic()
    versions = [2, 3, 5]
    cold = cold_loader(1).outputs([seen["checkpoints"][v] for v in versions], "bfloat16", PROMPTS, max_tokens=8)
    seen["cold"] = {v: cold[seen["checkpoints"][v]] for v in versions}
    seen["timings"]["oracle"] = time.monotonic() - t0
    print("fleet test timings (s):", {k: round(v, 1) for k, v in seen["timings"].items()})
    return seen


def _equal_to_cold(out: dict[str, Any], cold: list[dict[str, Any]]) -> None:
    assert out["tokens"] == [c["token_ids"] for c in cold], (out["tokens"], cold)
    for mine, theirs in zip(out["logprobs"], (c["logprobs"] for c in cold), strict=True):
        assert max(abs(a - b) for a, b in zip(mine, theirs, strict=True)) < 1e-6, (mine, theirs)


def test_engines_are_placed_one_per_node_and_refuse_until_verified(run: Any) -> None:
    """``add(3)`` puts one engine on each node (the node Ray runs each actor on says so), and an engine
    started from the config alone refuses generation with ``NotReady`` until it holds a verified version."""
    assert sorted(run["placed"].values()) == sorted(run["nodes"]), run["placed"]
    assert run["actor_nodes"] == run["placed"]
    assert run["ready_before"] == dict.fromkeys(run["first"], False)
    assert run["refused"] and "holds no verified weights" in run["refused"] and "load_format='dummy'" in run["refused"]


def test_each_node_takes_one_copy_and_every_engine_equals_a_cold_load(run: Any) -> None:
    for key in ("v1", "v2"):
        report = run[key]
        assert report.published and sorted(report.current) == sorted(run["first"]), report
        assert len(report.report.engines) == 3  # the publisher sent 3 copies: one per node's relay
        # each relay listens on its own node's address (reached over the bridge, not loopback)
        assert sorted(e.endpoint.rsplit(":", 1)[0] for e in report.report.engines) == sorted(
            f"tcp://{ip}" for ip in run["ips"]), [e.endpoint for e in report.report.engines]
        for eng in report.report.engines:
            assert eng.ok and eng.verified and eng.bytes == report.report.bytes, eng
            assert len(eng.engine["relayed"]) == 1 and eng.engine["relayed"][0]["verified"], eng.engine
    assert sorted(s["latest"] for s in run["relays_v2"].values()) == [2, 2, 2]
    for name, out in run["out_v2"].items():
        assert out["version"] == {2}, name
        _equal_to_cold(out, run["cold"][2])


def test_an_engine_added_at_version_2_serves_it_before_its_first_request(run: Any) -> None:
    status = run["late_status"]
    assert status["ready"] and status["version"] == 2 and status["unverified"] is None, status
    assert status["sequences_generated"] == 0  # current at join, before any request
    # it never read a checkpoint: its model directory holds the config and tensor table, no weights
    assert run["late_model_files"] and not [f for f in run["late_model_files"] if f.endswith(".safetensors")]
    (first,) = run["late_records"][:1]
    # the relay's dense join, applied and audited like a trainer's update
    assert first["version"] == 2 and first["ok"] and first["transport"] == "shm" and first["delta_base"] == 0, first
    assert first["tensors_audited"] > 0 and not first["stale_tensors"] and not first["identity_violations"], first
    assert run["late_out"]["version"] == {2}
    _equal_to_cold(run["late_out"], run["cold"][2])


def test_a_killed_engine_is_recorded_and_comes_back_current(run: Any) -> None:
    victim, v3 = run["victim"], run["v3"]
    assert not v3.published and victim in v3.missed and victim in v3.down, v3  # policy "all": not published
    assert sorted(v3.current) == sorted(n for n in [*run["first"], run["late"]] if n != victim)
    assert "3 of 4 engines current" in run["failed"][3]
    # Ray restarted it: it rejoined through its relay at version 3 before answering anything
    status = run["victim_status"]
    assert status["ready"] and status["version"] == 3, status
    assert run["victim_out"]["version"] == {3}
    _equal_to_cold(run["victim_out"], run["cold"][3])
    first = run["victim_records"][0]
    assert first["version"] == 3 and first["ok"] and first["tensors_audited"] > 0 and not first["stale_tensors"], first
    joins = [j for j in run["relay_b"]["joins"] if j["engine"] == victim]
    assert [j["version"] for j in joins] == [0, 3] and joins[1]["verified"], joins  # first start (nothing published yet), then the rejoin
    assert 3 in run["members"][victim]["missed"]
    assert any(s["engine"] == victim and s["node"] == run["placed"][victim] and "error" not in s for s in run["sweeps"])
    assert run["probe_v3"] == [] and run["members"][victim]["state"] == "ready"
    assert len(run["out_v3"]) == 4
    for name, out in run["out_v3"].items():  # every engine, the restarted and the late one included
        assert out["version"] == {3}, name
        _equal_to_cold(out, run["cold"][3])


def test_a_dead_relay_is_detected_and_its_versions_recorded(run: Any) -> None:
    node_a = run["nodes"][1]
    v4 = run["v4"]
    assert f"relay@{node_a}" in v4.down and not v4.published, v4
    on_a = sorted(n for n, m in run["members"].items() if m["node"] == node_a)
    assert len(on_a) == 2 and sorted(n for n in v4.missed) == on_a, v4
    assert v4.nodes[node_a] == {"relay": v4.nodes[node_a]["relay"], "ok": False, "reason": "relay down"}
    assert all(v4.nodes[n]["ok"] for n in run["nodes"] if n != node_a), v4.nodes
    node = run["status"]["nodes"][node_a]
    assert node["relay_state"] == "down" and node["relay_missed"] == [4], node
    assert all(e["state"] == "down" and 4 in e["missed"] for e in node["engines"]), node
    assert run["history"][-1]["version"] == 4 and sorted(run["history"][-1]["current"]) == sorted(
        n for n in run["members"] if n not in on_a)


def test_a_dead_relay_comes_back_at_the_next_publish_and_its_engines_rejoin(run: Any) -> None:
    """The probe of the next publish starts a new relay on the node (seeded by a peer at version 4), the node's
    engines, alive all along, rejoin it, and version 5 reaches every engine: all equal a cold load of it."""
    node_a = run["nodes"][1]
    v5, relay = run["v5"], run["relay_a_v5"]
    assert relay["state"] == "ready" and relay["new"] != relay["old"], relay
    assert relay["new"].startswith(f"tcp://{run['ips'][1]}:"), relay  # on its node's address, like the first
    assert v5.published and sorted(v5.current) == sorted(run["members"]), v5
    assert v5.nodes[node_a]["ok"], v5.nodes
    joins = relay["status"]["joins"]
    assert len(joins) == 2 and all(j["verified"] and j["version"] == 4 for j in joins), joins  # caught up first
    for name, out in run["out_v5"].items():
        assert out["version"] == {5}, name
        _equal_to_cold(out, run["cold"][5])
