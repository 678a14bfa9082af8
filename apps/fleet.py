"""A fleet of engines across Ray nodes, fed by one trainer: placement, one relay per node, membership, health.

```python
from apps.fleet import Fleet
from bridge.checkpoint import ModelSpec

fleet = Fleet(ModelSpec.from_checkpoint("/ckpt/v0"), dtype="bfloat16")   # config files + tensor table, no weights
fleet.add(3)                                  # spread over the cluster's nodes; one RelayActor per node with engines
for version in range(1, steps + 1):
    train_step(policy)
    report = fleet.publish(policy.named_parameters(), version=version, probe=build_probe(policy))
    report.current                            # the engines that serve this version
rollouts = ray.get([e.generate.remote(prompts) for e in fleet.handles()])
fleet.close()
```

**Placement.** ``add(count)`` puts each engine on the eligible node with the fewest of this fleet's engines
(``plan_placement``; ties: the order of ``nodes``), pinned there with ``NodeAffinitySchedulingStrategy``. Eligible
nodes: ``nodes`` (Ray node ids), or every alive node holding ``resource`` (a custom Ray resource, e.g. one
given to inference nodes), or every alive node. Each engine takes ``engine_resources`` (Ray resources).

**Engines start without a checkpoint.** Every engine gets the ``ModelSpec`` (the model's config files and tensor
table, passed through Ray, so no node needs the checkpoint) and starts with vLLM's ``load_format="dummy"``.
Before its constructor returns it joins its node's relay (``Relay.join``), which sends it the newest version
the relay holds, verified like a trainer's update; until it holds a verified version it refuses generation
(``NotReady``). A new node's relay is first seeded by a peer relay (``Relay.seed``). An engine that Ray restarts
(``max_restarts``, default 1) runs its constructor again: it rejoins the same way, at the fleet's version.

**One copy per node.** The publisher's endpoints are the relays, one per node with engines; each relay
forwards to its engines over shared memory. Relays bind their node's address (``node_addresses`` overrides
what Ray reports); off loopback with CURVE keys the fleet makes (one server key for its relays, one client
key for its publisher and for relays seeding each other), handed over as config through Ray. Engines bind
loopback and listen on ``ipc://``, behind their relay.

**Health and membership.** Before each publish every engine and relay is probed (``status``, within
``probe_timeout_s``). An engine that does not answer is marked down and leaves its relay's forwards (the
vLLM segments it left in ``/dev/shm`` are swept on its node by its relay); a relay that does not answer takes
its node's engines down with it. Every version published while an engine is not current is recorded in its
``missed``. ``publish`` returns a ``FleetReport``: which engines were current at the version, which missed
it, and whether it counts as published under the ``policy``: ``"all"`` (default: every member engine current)
or ``"quorum"`` (at least ``quorum`` engines, by default a majority). When the policy does not hold it raises
``FleetUpdateFailed`` carrying the report. Adding and removing engines happens between publishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bridge.checkpoint import ModelSpec
from bridge.config import BridgeConfig
from bridge.curve import is_loopback, new_keypair
from bridge.errors import FleetError, UpdateFailed

logger = logging.getLogger(__name__)

POLICIES = ("all", "quorum")


def plan_placement(nodes: list[str], load: dict[str, int], count: int) -> list[str]:
    """The node of each of ``count`` new engines: each on the node of ``nodes`` with the fewest engines so far
    (``load``, counting the ones just placed); ties go to the earlier node in ``nodes``."""
    if count and not nodes:
        raise FleetError("no node can host an engine (no alive node has the fleet's resource)")
    counts = {n: load.get(n, 0) for n in nodes}
    out = []
    for _ in range(count):
        node = min(nodes, key=lambda n: (counts[n], nodes.index(n)))
        counts[node] += 1
        out.append(node)
    return out


def policy_holds(policy: str, current: int, members: int, quorum: int | None = None) -> bool:
    """Does a version count as published? ``all``: every member engine is current (and there is one);
    ``quorum``: at least ``quorum`` engines are (default: a majority of the members)."""
    if policy == "all":
        return members > 0 and current == members
    if policy == "quorum":
        need = quorum if quorum is not None else members // 2 + 1
        return current >= max(need, 1)
    raise FleetError(f"unknown publish policy {policy!r}: one of {POLICIES}")


@dataclass
class Member:
    """One engine of the fleet, as the fleet last saw it."""

    name: str
    node: str
    handle: Any
    endpoint: str = ""  # where its relay reaches it (ipc://), as of its last (re)join
    state: str = "starting"  # starting | ready | down
    version: int = 0
    missed: list[int] = field(default_factory=list)  # versions published while it was not current
    down_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "node": self.node, "endpoint": self.endpoint, "state": self.state,
                "version": self.version, "missed": list(self.missed)}


@dataclass
class NodeRelay:
    node: str
    handle: Any
    endpoint: str
    state: str = "ready"  # ready | down
    missed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class FleetReport:
    """One version's publish to the fleet."""

    version: int
    published: bool  # the policy held
    policy: str
    current: tuple[str, ...]  # engines serving this version once the publish returned
    missed: tuple[str, ...]  # member engines that do not (down, refused, or on a node whose relay failed)
    down: tuple[str, ...]  # engines and relays found dead by this publish's probes or answers
    nodes: dict[str, dict[str, Any]]  # node -> relay endpoint, ok, reason
    report: Any = None  # the publisher's PublishReport (None when a node failed: see ``nodes``)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "published": self.published, "policy": self.policy,
                "current": list(self.current), "missed": list(self.missed), "down": list(self.down),
                "nodes": self.nodes, "seconds": self.seconds}


class FleetUpdateFailed(UpdateFailed):
    """A version did not count as published under the fleet's policy; ``report`` says which engines are current."""

    def __init__(self, message: str, report: FleetReport, reasons: dict[str, str] | None = None) -> None:
        super().__init__(message, reasons)
        self.report = report


class Fleet:
    def __init__(self, model: ModelSpec, *, dtype: str = "bfloat16", tp: int = 1,
                 config: BridgeConfig | dict[str, Any] | str | None = None, engine_options: dict[str, Any] | None = None,
                 nodes: list[str] | None = None, resource: str | None = None,
                 engine_resources: dict[str, float] | None = None, node_addresses: dict[str, str] | None = None,
                 policy: str = "all", quorum: int | None = None, namespace: str | None = None, name: str = "fleet",
                 relay_port: int = 0, probe_timeout_s: float = 10.0, start_timeout_s: float = 900.0,
                 max_restarts: int = 1) -> None:
        """A fleet of no engines yet (``add`` places them). Needs ``ray.init`` first; ``config`` is the
        weight-bridge config of engines, relays and the publisher (the fleet sets their bind addresses and keys).
        ``relay_port``: the first relay's port, the next ones count up from it (0: any free port)."""
        from inference_side.server import resolve_config

        if policy not in POLICIES:
            raise FleetError(f"unknown publish policy {policy!r}: one of {POLICIES}")
        self.spec = model
        self.dtype, self.tp = dtype, tp
        self.config = resolve_config(config)
        self.engine_options = dict(engine_options or {})
        self.node_ids = list(nodes) if nodes else None
        self.resource = resource
        self.engine_resources = dict(engine_resources or {})
        self.node_addresses = dict(node_addresses or {})
        self.policy, self.quorum = policy, quorum
        self.namespace = namespace
        self.name = name
        self.relay_port = relay_port
        self.probe_timeout_s = probe_timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_restarts = max_restarts
        self.members: dict[str, Member] = {}
        self.relays: dict[str, NodeRelay] = {}  # node id -> its relay
        self.version = 0  # the newest version published under the policy
        self.history: list[dict[str, Any]] = []  # each publish's FleetReport, as a dict
        self.sweeps: list[dict[str, Any]] = []  # each /dev/shm sweep run when an engine left its node
        self._server_keys = new_keypair()  # the relays' CURVE key (used only off loopback)
        self._client_keys = new_keypair()  # the publisher's (and seeding relays') CURVE key
        self._publisher: Any = None
        self._publisher_endpoints: list[str] = []
        self._counter = 0
        self._relay_starts = 0  # relays started (a restarted relay gets a new actor name)

    # ---- nodes and configs ---------------------------------------------------------------------
    def eligible_nodes(self) -> list[str]:
        """Alive Ray nodes that may host engines, in a stable order (the head first, then by id)."""
        import ray

        alive = [n for n in ray.nodes() if n.get("Alive")]
        if self.node_ids is not None:
            ids = {n["NodeID"] for n in alive}
            return [n for n in self.node_ids if n in ids]
        if self.resource:
            alive = [n for n in alive if n.get("Resources", {}).get(self.resource, 0) > 0]
        head = ray.get_runtime_context().get_node_id()
        return sorted((n["NodeID"] for n in alive), key=lambda n: (n != head, n))

    def address(self, node: str) -> str:
        """The address a node's relay binds (``node_addresses``, else the node's address as Ray reports it)."""
        import ray

        if node in self.node_addresses:
            return self.node_addresses[node]
        for n in ray.nodes():
            if n["NodeID"] == node:
                return str(n["NodeManagerAddress"])
        raise FleetError(f"no Ray node {node}")

    def _secure(self) -> bool:
        return any(not is_loopback(self.address(r.node)) for r in self.relays.values())

    def relay_config(self, node: str) -> BridgeConfig:
        """A node's relay config: bound to the node's address; off loopback a CURVE server accepting only the
        fleet's client key, which it also presents when seeding another relay."""
        host = self.address(node)
        transport: dict[str, Any] = {"bind_host": host}
        if not is_loopback(host):
            transport |= {"curve_server_secret": self._server_keys.secret, "curve_clients": (self._client_keys.public,),
                          "curve_client_secret": self._client_keys.secret,
                          "curve_server_public": self._server_keys.public}
        return self.config.replace(transport=transport)

    def publisher_config(self) -> BridgeConfig:
        """The trainer's side: ZMQ to each node's relay (a relay takes its update over the network, whatever
        ``transport.kind`` says; it forwards over shared memory), presenting the fleet's client key off loopback."""
        transport: dict[str, Any] = {"kind": "zmq"}
        if self._secure():
            transport |= {"curve_client_secret": self._client_keys.secret, "curve_server_public": self._server_keys.public}
        return self.config.replace(transport=transport)

    def engine_config(self) -> BridgeConfig:
        """Engines stay on loopback and ``ipc://`` behind their node's relay."""
        return self.config.replace(transport={"bind_host": "127.0.0.1", "listen_ipc": True})

    # ---- membership ------------------------------------------------------------------------------
    def _relays(self, nodes: list[str]) -> None:
        """Make sure each of ``nodes`` has a live relay: the missing ones are started at once, then each is
        seeded by a peer relay when the fleet has published (a new node starts at the fleet's version)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from inference_side import RelayActor

        missing = [n for n in dict.fromkeys(nodes) if n not in self.relays or self.relays[n].state != "ready"]
        peers = [r for r in self.relays.values() if r.state == "ready"]
        started: dict[str, Any] = {}
        for node in missing:
            port = self.relay_port + len(self.relays) + len(started) if self.relay_port else 0
            started[node] = RelayActor.options(  # type: ignore[attr-defined]
                namespace=self.namespace, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            ).remote([], config=self.relay_config(node), name=f"{self.name}-relay-{node[:8]}-{self._relay_starts}", port=port,
                     dtype=self.dtype)
            self._relay_starts += 1
        deadline = time.monotonic() + self.start_timeout_s
        for node, handle in started.items():
            try:
                endpoint = str(ray.get(handle.endpoint.remote(), timeout=max(deadline - time.monotonic(), 1.0)))
            except Exception as exc:  # noqa: BLE001 - Ray raises several unrelated types for a failed actor start
                for other in started.values():
                    ray.kill(other, no_restart=True)
                raise FleetError(f"the relay on node {node} did not start: {type(exc).__name__}: {exc}") from exc
            self.relays[node] = NodeRelay(node, handle, endpoint)
        if self.version and peers:
            for node in started:
                seeded = ray.get(peers[0].handle.seed.remote(self.relays[node].endpoint), timeout=self.start_timeout_s)
                logger.info("relay on %s seeded at version %s by %s", node, seeded["version"], peers[0].node)

    def add(self, count: int = 1, nodes: list[str] | None = None, names: list[str] | None = None) -> list[str]:
        """Start ``count`` engines (placed by ``plan_placement``, or on ``nodes``), each current at the fleet's
        version when this returns (joined through its node's relay); their names."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from inference_side import InferenceActor

        load: dict[str, int] = {}
        for m in self.members.values():
            load[m.node] = load.get(m.node, 0) + 1
        placed = list(nodes) if nodes else plan_placement(self.eligible_nodes(), load, count)
        if names is None:
            names = []
            for _ in placed:
                names.append(f"{self.name}-engine-{self._counter}")
                self._counter += 1
        if len(names) != len(placed) or any(n in self.members for n in names):
            raise FleetError(f"engine names {names} must be new and one per engine placed ({len(placed)})")
        self._relays(placed)
        started = []
        for name, node in zip(names, placed, strict=True):
            relay = self.relays[node]
            handle = InferenceActor.options(  # type: ignore[attr-defined]
                name=name, namespace=self.namespace, max_restarts=self.max_restarts,
                resources=self.engine_resources or None,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            ).remote(model=self.spec, tensor_parallel_size=self.tp, dtype=self.dtype, config=self.engine_config(),
                     name=name, join=relay.handle, join_timeout_s=self.start_timeout_s, **self.engine_options)
            self.members[name] = Member(name, node, handle)
            started.append(name)
        deadline = time.monotonic() + self.start_timeout_s
        for name in started:
            member = self.members[name]
            try:
                status = ray.get(member.handle.status.remote(), timeout=max(deadline - time.monotonic(), 1.0))
            except Exception as exc:  # noqa: BLE001 - Ray raises several unrelated types for a failed actor start
                for other in started:
                    ray.kill(self.members.pop(other).handle, no_restart=True)
                raise FleetError(f"engine {name} on node {member.node} did not start and join: "
                                 f"{type(exc).__name__}: {exc}") from exc
            self._seen(member, status)
        return started

    def remove(self, name: str) -> dict[str, Any]:
        """Stop engine ``name`` between publishes: it leaves its relay, its actor is shut down and killed, and
        its node's ``/dev/shm`` is swept of vLLM segments no live process uses (the report is returned)."""
        import ray

        member = self.members.pop(name, None)
        if member is None:
            raise FleetError(f"no engine {name!r} in the fleet (members: {sorted(self.members)})")
        relay = self.relays.get(member.node)
        if relay is not None and relay.state == "ready":
            try:
                ray.get(relay.handle.leave.remote(name), timeout=self.probe_timeout_s * 6)
            except Exception as exc:  # noqa: BLE001 - a dead relay is found by the next probe
                logger.warning("relay on %s did not drop %s: %s", member.node, name, exc)
        try:
            ray.get(member.handle.shutdown.remote(), timeout=120)
        except Exception as exc:  # noqa: BLE001 - a dead actor is killed below either way
            logger.warning("engine %s did not shut down cleanly (%s); killing it", name, exc)
        ray.kill(member.handle, no_restart=True)
        return self._sweep(member.node, name)

    def _sweep(self, node: str, engine: str) -> dict[str, Any]:
        """Run the vLLM segment sweep on ``node`` (by its relay); recorded in ``sweeps``."""
        import ray

        relay = self.relays.get(node)
        record: dict[str, Any] = {"node": node, "engine": engine, "at": time.time()}
        if relay is None or relay.state != "ready":
            record["error"] = "no live relay on the node to sweep it"
        else:
            try:
                record |= ray.get(relay.handle.sweep_shm.remote(), timeout=self.probe_timeout_s * 6)
            except Exception as exc:  # noqa: BLE001 - recorded; the next engine start sweeps too
                record["error"] = f"{type(exc).__name__}: {exc}"
        self.sweeps.append(record)
        return record

    def handles(self, ready_only: bool = True) -> list[Any]:
        """The engines' actor handles (those found ready by the last probe, by default)."""
        return [m.handle for m in self.members.values() if m.state == "ready" or not ready_only]

    def _seen(self, member: Member, status: dict[str, Any]) -> None:
        member.endpoint = str(status.get("ipc_endpoint") or status.get("endpoint") or member.endpoint)
        member.version = int(status.get("version", 0))
        member.state = "ready" if status.get("ready") else "starting"
        member.down_at = None

    # ---- health ----------------------------------------------------------------------------------
    def probe(self) -> list[str]:
        """Ask every engine and relay for its status, each within ``probe_timeout_s`` (all at once). Returns
        what was newly found down. A down engine leaves its relay's forwards and its node is swept; an engine
        found up again (restarted by Ray and rejoined) is ready again."""
        import ray

        for node in [n for n, r in self.relays.items() if r.state == "down"]:
            self._restart_relay(node)
        pending = {name: m.handle.status.remote() for name, m in self.members.items()}
        relays = {node: r.handle.status.remote() for node, r in self.relays.items() if r.state == "ready"}
        ready, _ = ray.wait([*pending.values(), *relays.values()], num_returns=len(pending) + len(relays),
                            timeout=self.probe_timeout_s)
        done = set(ready)
        down: list[str] = []
        for node, ref in relays.items():
            relay = self.relays[node]
            if not _answered(ref, done):
                relay.state = "down"
                down.append(f"relay@{node}")
                logger.warning("fleet %s: the relay on node %s is down", self.name, node)
        for name, ref in pending.items():
            member = self.members[name]
            status = _answered(ref, done)
            home = self.relays.get(member.node)
            if status and home is not None and home.state == "ready":
                self._seen(member, status)
                continue
            if member.state != "down":
                old = member.endpoint
                member.state, member.down_at = "down", time.time()
                down.append(name)
                logger.warning("fleet %s: engine %s on node %s is down", self.name, name, member.node)
                if home is not None and home.state == "ready":
                    try:  # only the endpoint it had: a restarted engine that rejoined meanwhile stays
                        ray.get(home.handle.leave.remote(name, old), timeout=self.probe_timeout_s * 6)
                    except Exception as exc:  # noqa: BLE001 - the relay's own probe tells
                        logger.warning("relay on %s did not drop %s: %s", member.node, name, exc)
                    self._sweep(member.node, name)
        return down

    def _restart_relay(self, node: str) -> None:
        """A relay found down by an earlier probe comes back: a new relay on its node, seeded by a peer relay
        at the newest version the peers hold, and each engine of the node that still answers joins it (sent
        that version, verified, unless it serves it already). Engines that do not answer stay down. A failed
        restart is logged and tried again at the next probe."""
        import ray

        old = self.relays[node]
        try:
            self._relays([node])
        except FleetError as exc:
            logger.warning("fleet %s: the relay on node %s could not be restarted: %s", self.name, node, exc)
            return
        relay = self.relays[node]
        relay.missed = list(old.missed)
        logger.info("fleet %s: relay on node %s restarted at %s", self.name, node, relay.endpoint)
        for member in [m for m in self.members.values() if m.node == node]:
            try:
                status = ray.get(member.handle.status.remote(), timeout=self.probe_timeout_s)
                endpoint = str(status.get("ipc_endpoint") or status.get("endpoint"))
                joined = ray.get(relay.handle.join.remote(member.name, endpoint), timeout=self.start_timeout_s)
                logger.info("fleet %s: engine %s rejoined the new relay of %s at version %s", self.name, member.name,
                            node, joined.get("version"))
            except Exception as exc:  # noqa: BLE001 - Ray raises several types for a dead actor; it stays down
                logger.warning("fleet %s: engine %s did not rejoin the relay of %s: %s", self.name, member.name, node, exc)

    # ---- publishing ------------------------------------------------------------------------------
    def _publisher_for(self, endpoints: list[str]) -> Any:
        from trainer_side.publisher import WeightPublisher

        if self._publisher is not None and endpoints == self._publisher_endpoints:
            return self._publisher
        if self._publisher is not None:
            self._publisher.close()
        self._publisher = WeightPublisher(endpoints, config=self.publisher_config(), name=f"{self.name}-publisher")
        self._publisher_endpoints = list(endpoints)
        return self._publisher

    def publish(self, weights: Iterable[tuple[str, Any]] | Any, version: int, probe: Any = None,
                adapter: Any = None) -> FleetReport:
        """Probe the fleet, send ``version`` once to each node's relay, then read back which engines serve it
        (with ``adapter``, a LoRA adapter's version: which engines serve that adapter version). Returns the
        ``FleetReport``; raises ``FleetUpdateFailed`` (with it) when the policy does not hold."""
        import ray

        t0 = time.perf_counter()
        down = self.probe()
        live = [r for r in self.relays.values() if r.state == "ready"]
        nodes: dict[str, dict[str, Any]] = {r.node: {"relay": r.endpoint, "ok": False, "reason": ""} for r in self.relays.values()}
        for r in self.relays.values():
            if r.state != "ready":
                nodes[r.node]["reason"] = "relay down"
        if not live:
            raise FleetError(f"fleet {self.name} has no live relay to publish version {version} to")
        endpoints = [r.endpoint for r in live]
        t1 = time.perf_counter()
        report, failures = None, {}
        try:
            report = self._publisher_for(endpoints).publish(weights, version=version, probe=probe, adapter=adapter)
        except UpdateFailed as exc:
            failures = dict(exc.reasons)
            if not failures:
                raise
        t2 = time.perf_counter()
        for r in live:
            nodes[r.node]["ok"] = r.endpoint not in failures
            nodes[r.node]["reason"] = failures.get(r.endpoint, "")
        # which engines serve it now: asked directly, each within the probe deadline
        asked = {name: (m.handle.adapter_version.remote(adapter.name) if adapter is not None else m.handle.version.remote())
                 for name, m in self.members.items() if m.state != "down"}
        answered, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=self.probe_timeout_s)
        done = set(answered)
        current = []
        for name, ref in asked.items():
            served = _answered(ref, done)
            if served is not None and adapter is None:
                self.members[name].version = int(served)
            if served == version:
                current.append(name)
                if adapter is None:  # it holds a verified version now (an engine that joined before the first)
                    self.members[name].state = "ready"
        missed = [n for n in self.members if n not in current]
        for name in missed:
            self.members[name].missed.append(version)
        for r in self.relays.values():
            if r.state != "ready" or not nodes[r.node]["ok"]:
                r.missed.append(version)
        published = policy_holds(self.policy, len(current), len(self.members), self.quorum)
        fleet_report = FleetReport(version, published, self.policy, tuple(current), tuple(missed), tuple(down), nodes,
                                   report, {"probe": t1 - t0, "publish": t2 - t1, "total": time.perf_counter() - t0})
        self.history.append(fleet_report.to_dict())
        if not published:
            raise FleetUpdateFailed(f"version {version} is not published under policy {self.policy!r}: {len(current)} of "
                                    f"{len(self.members)} engines current; missed by {missed}"
                                    + (f"; nodes failed: {failures}" if failures else ""), fleet_report, failures)
        self.version = version
        return fleet_report

    def status(self) -> dict[str, Any]:
        """Membership by node: each relay and its engines, their state, versions and missed versions."""
        by_node: dict[str, dict[str, Any]] = {}
        for node, relay in self.relays.items():
            by_node[node] = {"relay": relay.endpoint, "relay_state": relay.state, "relay_missed": list(relay.missed),
                             "engines": []}
        for m in self.members.values():
            by_node.setdefault(m.node, {"relay": "", "relay_state": "none", "relay_missed": [], "engines": []})
            by_node[m.node]["engines"].append(m.to_dict())
        return {"fleet": self.name, "version": self.version, "policy": self.policy, "nodes": by_node}

    def close(self) -> None:
        """Stop every engine and relay of the fleet and the publisher."""
        import ray

        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        for name in list(self.members):
            member = self.members.pop(name)
            try:
                ray.get(member.handle.shutdown.remote(), timeout=60)
            except Exception as exc:  # noqa: BLE001 - killed below either way
                logger.warning("engine %s did not shut down cleanly: %s", name, exc)
            ray.kill(member.handle, no_restart=True)
        for relay in self.relays.values():
            try:
                ray.get(relay.handle.shutdown.remote(), timeout=60)
            except Exception as exc:  # noqa: BLE001 - killed below either way
                logger.warning("relay on %s did not shut down cleanly: %s", relay.node, exc)
            ray.kill(relay.handle, no_restart=True)
        self.relays.clear()


def _answered(ref: Any, done: set[Any]) -> Any:
    """The value of a finished Ray call, or None when it did not finish or raised (the actor is dead or restarting)."""
    import ray

    if ref not in done:
        return None
    try:
        return ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - any failure of the call means no answer
        return None
