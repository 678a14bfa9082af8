"""A multi-node Ray cluster on one host, each worker node a host of its own (tests and benchmarks; root only).

Topology: a Linux bridge in the root network namespace holds the head's address; each worker node is a
network namespace joined to the bridge by a veth pair, with its own address, its own loopback and, through a
private mount namespace, its own ``/dev/shm`` (a tmpfs). A raylet runs inside each node
(``ray start --address=HEAD --node-ip-address=NODE_IP``), so every Ray worker, actor and engine placed on a
node lives in that node's namespaces: nothing crosses "hosts" through shared memory or loopback by accident,
and whatever binds a node's address is reachable from the others over the bridge only.

Contract:

- ``plan_cluster`` and the ``*_commands`` functions are pure (they build command lists; tested as such).
- ``NamespaceCluster`` is a context manager. On entry it first removes anything left by an earlier run with
  the same prefix (links, namespaces), then builds the network, starts the head (in the root namespace, on
  the bridge's address) and one raylet per worker node, and waits (``deadline_s``) until Ray lists every node
  alive. On exit, also after a failure, it kills every process in the worker namespaces and every process of
  the head (by its temp dir, with descendants), then deletes the namespaces, veths and the bridge, and the
  temp dir. Nothing it made survives it.
- Ray 2.60 turns on token authentication; every process started here gets ``env()``'s token, and a driver
  joining the cluster must use the same (``env()`` or ``os.environ.update(cluster.env())``).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RAY_BIN = Path(sys.executable).parent / "ray"


@dataclass(frozen=True)
class NodeSpec:
    """One worker node: its namespace, veth ends (root side, node side) and address."""

    name: str
    namespace: str
    veth_root: str
    veth_node: str
    ip: str
    resources: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterPlan:
    prefix: str
    bridge: str
    head_ip: str
    prefix_len: int
    port: int
    nodes: tuple[NodeSpec, ...]
    head_resources: dict[str, float] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"


def plan_cluster(workers: int, *, prefix: str = "wbn", subnet: str = "10.201.0.0/24", port: int = 45100,
                 resources: bool = True, worker_resources: dict[str, float] | None = None) -> ClusterPlan:
    """The names and addresses of a cluster with ``workers`` worker nodes on ``subnet``: the head takes the
    first host address, node *i* (from 1) the next ones. Interface names stay within Linux's 15 characters.
    With ``resources``, each node gets a custom resource named after it (``node_head``, ``node_w1``, ...),
    so a test can place an actor on a node by resource; ``worker_resources`` go to every worker node (e.g. a
    resource marking inference nodes)."""
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    net = ipaddress.ip_network(subnet)
    hosts = list(net.hosts())
    if workers + 1 > len(hosts):
        raise ValueError(f"subnet {subnet} has {len(hosts)} host addresses, {workers + 1} are needed")
    if len(prefix) > 8 or not prefix.isalnum():
        raise ValueError(f"prefix must be alphanumeric and at most 8 characters (interface names), got {prefix!r}")
    nodes = tuple(
        NodeSpec(name=f"w{i}", namespace=f"{prefix}-w{i}", veth_root=f"{prefix}v{i}", veth_node=f"{prefix}p{i}",
                 ip=str(hosts[i]), resources={**({f"node_w{i}": 1.0} if resources else {}), **(worker_resources or {})})
        for i in range(1, workers + 1))
    return ClusterPlan(prefix=prefix, bridge=f"{prefix}br0", head_ip=str(hosts[0]), prefix_len=net.prefixlen,
                       port=port, nodes=nodes, head_resources={"node_head": 1.0} if resources else {})


def network_commands(plan: ClusterPlan) -> list[list[str]]:
    """``ip`` commands that build the bridge and every node's namespace, veth pair, address and default route."""
    cmds = [["ip", "link", "add", plan.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{plan.head_ip}/{plan.prefix_len}", "dev", plan.bridge],
            ["ip", "link", "set", plan.bridge, "up"]]
    for node in plan.nodes:
        cmds += [["ip", "netns", "add", node.namespace],
                 ["ip", "link", "add", node.veth_root, "type", "veth", "peer", "name", node.veth_node],
                 ["ip", "link", "set", node.veth_node, "netns", node.namespace],
                 ["ip", "link", "set", node.veth_root, "master", plan.bridge],
                 ["ip", "link", "set", node.veth_root, "up"],
                 ["ip", "-n", node.namespace, "addr", "add", f"{node.ip}/{plan.prefix_len}", "dev", node.veth_node],
                 ["ip", "-n", node.namespace, "link", "set", node.veth_node, "up"],
                 ["ip", "-n", node.namespace, "link", "set", "lo", "up"],
                 # a default route, so a process there finds its own address as on a host (vLLM's get_ip asks
                 # the kernel which source address would reach a public one)
                 ["ip", "-n", node.namespace, "route", "add", "default", "via", plan.head_ip]]
    return cmds


def teardown_commands(plan: ClusterPlan) -> list[list[str]]:
    """``ip`` commands that remove what ``network_commands`` made (each may fail when already gone)."""
    cmds = [["ip", "link", "del", node.veth_root] for node in plan.nodes]
    cmds += [["ip", "netns", "del", node.namespace] for node in plan.nodes]
    cmds.append(["ip", "link", "del", plan.bridge])
    return cmds


def _resources_arg(resources: dict[str, float]) -> list[str]:
    import json

    return [f"--resources={json.dumps(resources)}"] if resources else []


def head_command(plan: ClusterPlan, temp_dir: str, *, num_cpus: int, object_store_bytes: int,
                 dashboard_port: int | None = None) -> list[str]:
    """The head's ``ray start``; with ``dashboard_port`` its dashboard (the jobs API ``ray job submit`` needs)
    listens on the head's address."""
    dashboard = (["--include-dashboard=true", f"--dashboard-host={plan.head_ip}", f"--dashboard-port={dashboard_port}"]
                 if dashboard_port else ["--include-dashboard=false"])
    # the head shares the root namespace with every other Ray on this host: no fixed default ports
    ports = [f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}"]
    return [str(RAY_BIN), "start", "--head", f"--node-ip-address={plan.head_ip}", f"--port={plan.port}",
            f"--num-cpus={num_cpus}", *dashboard, *ports, f"--temp-dir={temp_dir}",
            "--disable-usage-stats", f"--object-store-memory={object_store_bytes}",
            *_resources_arg(plan.head_resources)]


def worker_command(plan: ClusterPlan, node: NodeSpec, temp_dir: str, *, num_cpus: int, object_store_bytes: int,
                   shm_bytes: int) -> list[str]:
    """The raylet of ``node``: inside its network namespace, in a private mount namespace whose ``/dev/shm`` is
    a fresh tmpfs of ``shm_bytes``, ``ray start --block`` (the process lives as long as the raylet)."""
    ray = " ".join([str(RAY_BIN), "start", f"--address={plan.address}", f"--node-ip-address={node.ip}",
                    f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
                    f"--object-store-memory={object_store_bytes}", "--block"]
                   + [f"'{arg}'" for arg in _resources_arg(node.resources)])
    script = f"mount -t tmpfs -o size={shm_bytes} tmpfs /dev/shm && exec {ray}"
    return ["ip", "netns", "exec", node.namespace, "unshare", "--mount", "--propagation", "private",
            "sh", "-c", script]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespace_pids(namespace: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _kill_tree(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker``, and their descendants (found first, so
    children orphaned by the kill are not missed)."""
    import psutil

    ours: dict[int, Any] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or []):
                ours[proc.pid] = proc
                for child in proc.children(recursive=True):
                    ours[child.pid] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    ours.pop(os.getpid(), None)
    for proc in ours.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(list(ours.values()), timeout=10)


class NamespaceCluster:
    """A head (root namespace) and ``workers`` raylets in their own network and mount namespaces (see module
    docstring). ``plan`` gives names and addresses; ``address`` is the GCS address a driver passes to
    ``ray.init`` with ``env()``'s token in its environment."""

    def __init__(self, workers: int = 2, *, prefix: str = "wbn", subnet: str = "10.201.0.0/24", port: int = 45100,
                 num_cpus: int = 2, object_store_bytes: int = 256 << 20, shm_bytes: int = 4 << 30,
                 deadline_s: float = 120.0, extra_env: dict[str, str] | None = None,
                 dashboard_port: int | None = None, worker_resources: dict[str, float] | None = None,
                 token: str | None = None) -> None:
        self.plan = plan_cluster(workers, prefix=prefix, subnet=subnet, port=port, worker_resources=worker_resources)
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_bytes
        self.shm_bytes = shm_bytes
        self.deadline_s = deadline_s
        self.dashboard_port = dashboard_port
        self.token = token or uuid.uuid4().hex + uuid.uuid4().hex
        self.extra_env = dict(extra_env or {})
        self.temp_dir = ""
        self.workers: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    @property
    def address(self) -> str:
        return self.plan.address

    @property
    def dashboard(self) -> str:
        """The jobs API address (``ray job submit --address``); only with ``dashboard_port``."""
        if not self.dashboard_port:
            raise RuntimeError("this cluster was started without a dashboard (pass dashboard_port)")
        return f"http://{self.plan.head_ip}:{self.dashboard_port}"

    def env(self) -> dict[str, str]:
        """The environment of every process of this cluster (and of a driver joining it)."""
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token,
                   PATH=f"{RAY_BIN.parent}{os.pathsep}{env.get('PATH', '')}", **self.extra_env)
        return env

    def __enter__(self) -> NamespaceCluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        for cmd in teardown_commands(self.plan):  # leftovers of a run that could not clean up
            _run(cmd, check=False)
        for cmd in network_commands(self.plan):
            _run(cmd)
        self.temp_dir = tempfile.mkdtemp(prefix=f"{self.plan.prefix}-", dir="/tmp")  # short: unix socket paths
        head = subprocess.run(head_command(self.plan, self.node_dir("head"), num_cpus=self.num_cpus,
                                           object_store_bytes=self.object_store_bytes,
                                           dashboard_port=self.dashboard_port),
                              env=self.env(), capture_output=True, text=True, timeout=self.deadline_s)
        if head.returncode != 0:
            raise RuntimeError(f"ray start --head failed:\n{head.stdout[-2000:]}\n{head.stderr[-2000:]}")
        for node in self.plan.nodes:
            log = Path(self.temp_dir) / f"raylet-{node.name}.log"
            self.logs.append(log)
            with log.open("wb") as out:
                self.workers.append(subprocess.Popen(
                    worker_command(self.plan, node, self.node_dir(node.name), num_cpus=self.num_cpus,
                                   object_store_bytes=self.object_store_bytes, shm_bytes=self.shm_bytes),
                    env=self.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        self.wait_for_nodes(len(self.plan.nodes) + 1)

    def node_dir(self, name: str) -> str:
        """Node ``name``'s Ray temp dir: one per node, as each host has its own (raylets started at once in one
        temp dir race for the same socket names)."""
        path = Path(self.temp_dir) / name
        path.mkdir(exist_ok=True)
        return str(path)

    def alive_nodes(self) -> list[dict[str, Any]]:
        """Ray's view of the alive nodes (asked in a child process, so the caller's Ray state is untouched)."""
        code = ("import json, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
                "print(json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']} "
                "for n in ray.nodes() if n['Alive']]))")
        proc = subprocess.run([sys.executable, "-c", code, self.address], env=self.env(), capture_output=True,
                              text=True, timeout=60)
        if proc.returncode != 0:
            return []
        import json

        return list(json.loads(proc.stdout.strip().splitlines()[-1]))

    def wait_for_nodes(self, count: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.deadline_s
        nodes: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            for worker, log in zip(self.workers, self.logs, strict=True):
                if worker.poll() is not None:
                    raise RuntimeError(f"a raylet exited ({worker.returncode}): {log.read_text()[-2000:]}")
            nodes = self.alive_nodes()
            if len(nodes) >= count:
                return nodes
            time.sleep(1.0)
        raise TimeoutError(f"{len(nodes)} of {count} Ray nodes alive after {self.deadline_s:.0f} s: {nodes}")

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of worker node ``name`` (its raylet and everything placed there)."""
        node = next(n for n in self.plan.nodes if n.name == name)
        for pid in namespace_pids(node.namespace):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue

    def down(self) -> None:
        for node in self.plan.nodes:
            for _ in range(3):  # processes forked while killing
                pids = namespace_pids(node.namespace)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                time.sleep(0.2)
        for worker in self.workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.temp_dir:
            _kill_tree(self.temp_dir)
        for cmd in teardown_commands(self.plan):
            _run(cmd, check=False)
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
