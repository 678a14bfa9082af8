"""The multi-node Ray cluster on one host (devtools/netns_cluster.py): the plan, and a real 3-node cluster
whose worker nodes are hosts of their own (network and /dev/shm). Root only. The real cluster is the session's
(``netns_cluster`` in tests/conftest.py, shared with tests/test_fleet.py and tests/test_ray_job.py); that it is
torn down without leftovers is checked when it is torn down, after the last test on it."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from devtools.netns_cluster import (
    network_commands,
    plan_cluster,
    teardown_commands,
    worker_command,
)
from tests.helpers import ROOT

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


@pytest.mark.parametrize(("workers", "subnet", "head", "ips"), [
    (0, "10.201.0.0/24", "10.201.0.1", []),
    (2, "10.201.0.0/24", "10.201.0.1", ["10.201.0.2", "10.201.0.3"]),
    (3, "10.9.8.0/29", "10.9.8.1", ["10.9.8.2", "10.9.8.3", "10.9.8.4"]),
])
def test_plan_gives_the_head_the_first_address_and_each_node_the_next(workers: int, subnet: str, head: str,
                                                                       ips: list[str]) -> None:
    plan = plan_cluster(workers, subnet=subnet, prefix="t1")
    assert plan.head_ip == head
    assert [n.ip for n in plan.nodes] == ips
    assert [n.resources for n in plan.nodes] == [{f"node_w{i}": 1.0} for i in range(1, workers + 1)]
    names = [plan.bridge] + [n.veth_root for n in plan.nodes] + [n.veth_node for n in plan.nodes]
    assert all(len(name) <= 15 for name in names), names  # Linux interface names
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(("workers", "subnet", "prefix", "problem"), [
    (-1, "10.201.0.0/24", "wbn", "workers"),
    (7, "10.9.8.0/29", "wbn", "host addresses"),
    (1, "10.201.0.0/24", "much-too-long", "prefix"),
])
def test_plan_refuses_what_cannot_be_built(workers: int, subnet: str, prefix: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        plan_cluster(workers, subnet=subnet, prefix=prefix)


def test_teardown_undoes_every_link_and_namespace_the_network_makes() -> None:
    plan = plan_cluster(2, prefix="t2")
    made = network_commands(plan)
    added_links = {c[3] for c in made if c[:3] == ["ip", "link", "add"]}
    added_ns = {c[3] for c in made if c[:3] == ["ip", "netns", "add"]}
    removed = teardown_commands(plan)
    # a veth pair goes with either end; the root ends are the ones left in the root namespace
    assert {c[3] for c in removed if c[:3] == ["ip", "link", "del"]} == added_links
    assert {c[3] for c in removed if c[:3] == ["ip", "netns", "del"]} == added_ns


def test_a_worker_node_gets_its_own_shm_inside_its_namespace() -> None:
    plan = plan_cluster(1, prefix="t3")
    cmd = worker_command(plan, plan.nodes[0], "/tmp/x", num_cpus=1, object_store_bytes=1 << 28, shm_bytes=1 << 30)
    assert cmd[:4] == ["ip", "netns", "exec", "t3-w1"]
    assert "--mount" in cmd and "private" in cmd
    script = cmd[-1]
    assert script.startswith(f"mount -t tmpfs -o size={1 << 30} tmpfs /dev/shm && exec ")
    assert f"--address={plan.head_ip}:45100" in script and f"--node-ip-address={plan.nodes[0].ip}" in script


PROBE = """
import json, os, socket, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_cpus=0)
def look(peer_ip):
    # what a task placed on this node sees: its address, its network namespace, its /dev/shm, and whether
    # it reaches a port another node listens on over the bridge
    import socket, os
    mark = "/dev/shm/wb-netns-probe-" + ray.util.get_node_ip_address()
    open(mark, "w").close()
    reach = None
    if peer_ip:
        try:
            socket.create_connection((peer_ip, 45199), timeout=3).close()
            reach = True
        except OSError:
            reach = False
    return {"ip": ray.util.get_node_ip_address(), "net": os.readlink("/proc/self/ns/net"),
            "shm": sorted(f for f in os.listdir("/dev/shm") if f.startswith("wb-netns-probe-")), "reach": reach}

@ray.remote(num_cpus=0)
class Listener:
    def __init__(self):
        self.s = socket.socket()
        self.s.bind((ray.util.get_node_ip_address(), 45199))
        self.s.listen()
        self.lo = socket.socket()
        self.lo.bind(("127.0.0.1", 45198))
        self.lo.listen()
    def ip(self):
        return ray.util.get_node_ip_address()

listener = Listener.options(resources={"node_w1": 0.01}).remote()
w1 = ray.get(listener.ip.remote())
out = {r: ray.get(look.options(resources={r: 0.01}).remote(w1 if r == "node_w2" else None))
       for r in ("node_head", "node_w1", "node_w2")}
try:
    socket.create_connection(("127.0.0.1", 45198), timeout=2).close()
    out["loopback_crosses"] = True
except OSError:
    out["loopback_crosses"] = False
print(json.dumps(out))
"""


@needs_root
def test_worker_nodes_are_hosts_of_their_own(netns_cluster: Any) -> None:
    import json

    cluster = netns_cluster
    head, w1, w2 = cluster.plan.head_ip, *(n.ip for n in cluster.plan.nodes)
    nodes = cluster.alive_nodes()
    assert sorted(n["ip"] for n in nodes) == sorted([head, w1, w2])
    env = cluster.env() | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PROBE, cluster.address], env=env, capture_output=True, text=True,
                          timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    os.unlink(f"/dev/shm/wb-netns-probe-{seen['node_head']['ip']}")
    assert [seen[r]["ip"] for r in ("node_head", "node_w1", "node_w2")] == [head, w1, w2]
    assert len({seen[r]["net"] for r in ("node_head", "node_w1", "node_w2")}) == 3, "one network namespace per node"
    for r in ("node_w1", "node_w2"):  # each worker node sees only its own file in its /dev/shm
        assert seen[r]["shm"] == [f"wb-netns-probe-{seen[r]['ip']}"], seen[r]
    assert seen["node_w2"]["reach"] is True, "a node reaches another node's address over the bridge"
    assert seen["loopback_crosses"] is False, "a node's loopback is its own"
