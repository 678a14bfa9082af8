"""A host-local relay: takes each update once over the network and hands it to every engine on its host
through shared memory.

Without it a publisher sends the same bytes once per engine (over ``tcp://``, one stream each). A
``Relay`` on the engines' host is one receiver to the publisher: it stages and verifies the update in
``/dev/shm`` like an engine does, then forwards it to its local engines over the shm transport, naming
the segments it staged: each engine maps them in place (zero copies after the network). Its answer to
the publisher is the engines' answers combined: ok only when every engine applied the version; a refusal
names the engine and its reason.

With ``sync.mode: streaming`` (the relay's own config) each bucket is forwarded as soon as it is staged and
verified, so the engines load bucket k while bucket k+1 crosses the network; otherwise the relay stores and
verifies the whole update, then forwards it. Either way it holds the update's buckets in ``/dev/shm`` until every engine
answered, and it answers as one engine: ``EngineInfo.version`` is the oldest version its engines served at
the last update. ``RelayActor`` (in ``inference_side/__init__.py``) is this class as a Ray actor, placed on
the engines' node.

**Membership and joining** (a fleet, docs/fleet.md). The relay keeps the newest version it received and
verified (``Relay.latest``, a ``BaseStore``: every tensor in the wire dtype and its checksum, in the relay's
process: **one model of host RAM per node**; with ``sync.delta`` on it is also the relay's delta base, so
still one copy), whether or not each of its engines applied it. ``join(name, endpoint)`` adds an engine
between updates: the relay first sends it that version as a dense update over shared memory (staged into
fresh segments for the join, one more model in ``/dev/shm`` while it runs), which the engine validates,
verifies, routes and audits like a trainer's; only then does the engine take part in the relay's next
forward. ``leave(name)`` drops it; ``sweep_shm()`` removes what dead vLLM engines left in ``/dev/shm``.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from bridge import wire
from bridge.config import BridgeConfig
from bridge.curve import server_curve
from bridge.errors import BridgeError, ConfigError, DeadlineExceeded, FleetError, TransportError, UpdateFailed
from bridge.report import ApplyResult, FailureKind, LoadResult, describe, kind_of
from bridge.sender import PublishReport, UpdateSender
from inference_side.contract import EngineGate, Restore, StagedBucket
from inference_side.delta_base import BaseStore
from inference_side.receiver import SyncReceiver
from inference_side.server import resolve_config

logger = logging.getLogger(__name__)


@dataclass
class _Forward:
    """The forward of one update: verified buckets queue up for the thread that sends them on."""

    version: int
    buckets: queue.Queue[tuple[str, tuple[int, ...]] | str] = field(default_factory=queue.Queue)
    held: set[str] = field(default_factory=set)  # segments forwarded: engines may map them until they answer
    kept: dict[str, Any] = field(default_factory=dict)  # each verified tensor's copy and checksum (Relay.latest)
    outcome: PublishReport | BridgeError | None = None
    thread: threading.Thread | None = None
    started: float = field(default_factory=time.perf_counter)


_ENGINE_FIELDS = ("engine", "transport", "tensors_audited", "stale_tensors", "identity_violations", "routed_sinks",
                  "probe_mean_abs_logprob_diff", "probe_kl", "probe_flagged")


class RelayGate(EngineGate):
    """The relay's engine contract: validates nothing itself (each engine validates the manifest it is sent)
    and forwards each loaded bucket to the local engines as it comes (``begin`` starts the forward on a
    thread of its own, ``finish`` waits for the engines' answers)."""

    def __init__(self, engines: list[str], config: BridgeConfig, name: str, dtype: str | None = None) -> None:
        self.config = config
        self._open: _Forward | None = None
        if not engines and not dtype:
            raise ConfigError("a relay needs at least one local engine endpoint, or the dtype its engines will serve")
        self.name = name
        self.latest = BaseStore(f"relay {name}")  # the newest version received and verified (joins start from it)
        self.latest_manifest: wire.Manifest | None = None
        self._state = threading.Lock()  # guards ending self._open (the apply thread and close() may both)
        self._members = threading.Condition()  # no forward while the engine list changes (join, leave)
        self._changing = False
        self.endpoints: list[str] = []
        self.versions: list[int] = []
        self._forwarder = self._connect(list(engines), dtype)
        infos = self._forwarder.engines() if engines else []
        self.dtype = infos[0].dtype if infos else str(dtype)
        self.tp_size = max((i.tp_size for i in infos), default=1)
        self.endpoints = list(engines)
        self.versions = [i.version for i in infos]

    def _connect(self, engines: list[str], dtype: str | None = None) -> UpdateSender:
        """A forwarder to ``engines`` (on this host: reached over shm without CURVE, which guards the relay's own
        endpoint), after checking they serve one dtype (``dtype`` when given) and take shm."""
        forwarder = UpdateSender(engines, config=self.config, name=self.name, transport="shm", curve_server_public="")
        try:
            infos = forwarder.engines() if engines else []
            dtypes = {i.dtype for i in infos} | ({dtype} if dtype else set())
            if len(dtypes) > 1:
                raise ConfigError(f"the relay's engines serve different dtypes {sorted(dtypes)}: one relay per dtype")
            lacking = [ep for ep, i in zip(engines, infos, strict=True) if "shm" not in i.transports]
            if lacking:
                raise ConfigError(f"engines {lacking} do not take the shm transport: a relay serves engines on its own host")
        except BridgeError:
            forwarder.close()
            raise
        return forwarder

    def info(self) -> wire.EngineInfo:
        version = min(self.versions) if self.versions else self.latest.version
        return wire.EngineInfo(dtype=self.dtype, version=version, tp_size=self.tp_size,
                               transports=("zmq",), host=socket.gethostname())

    # ---- membership (between forwards) ------------------------------------------------------------
    def swap(self, endpoints: list[str], versions: list[int]) -> None:
        """Make ``endpoints`` (serving ``versions``) the engines of the next forwards; call inside ``quiet``."""
        forwarder = self._connect(endpoints, self.dtype)
        old, self._forwarder = self._forwarder, forwarder
        old.close()
        self.endpoints, self.versions = list(endpoints), list(versions)

    @contextmanager
    def quiet(self, timeout_s: float) -> Iterator[None]:
        """Hold off forwards (their ``begin`` waits) while the block runs; waits for an open one to end first."""
        with self._members:
            if not self._members.wait_for(lambda: self._open is None and not self._changing, timeout=timeout_s):
                raise DeadlineExceeded(f"relay {self.name}: an update stayed open for over {timeout_s}s")
            self._changing = True
        try:
            yield
        finally:
            with self._members:
                self._changing = False
                self._members.notify_all()

    @property
    def forwarding(self) -> int | None:
        """The version of the update being forwarded to the engines now (None: none is open)."""
        forward = self._open
        return forward.version if forward is not None else None

    def validate(self, manifest: wire.Manifest) -> str | None:
        return None

    def begin(self, manifest: wire.Manifest, restore: Restore | None = None) -> None:
        with self._members:  # an engine joining or leaving finishes first (bounded by its own deadlines)
            self._members.wait_for(lambda: not self._changing, timeout=self.config.deadlines.ack_s)
            forward = self._open = _Forward(manifest.version)
        wait_s = self.config.deadlines.bucket_s
        if not self.endpoints:  # no engine on this node now: the relay only keeps the version (Relay.latest)
            forward.outcome = PublishReport(manifest.version, 0, {}, ())
            return

        def staged(index: int) -> tuple[str, tuple[int, ...]]:
            try:
                item = forward.buckets.get(timeout=wait_s)
            except queue.Empty:
                raise TransportError(f"relay: bucket {index} was not staged within {wait_s}s") from None
            if isinstance(item, str):
                raise TransportError(f"relay: the update was abandoned upstream: {item}")
            return item

        def run() -> None:
            try:
                forward.outcome = self._forwarder.forward(manifest, staged)
            except BridgeError as exc:
                forward.outcome = exc

        forward.thread = threading.Thread(target=run, name="wb-relay-forward", daemon=True)
        forward.thread.start()

    def load(self, manifest: wire.Manifest, bucket: StagedBucket) -> LoadResult:
        """Hand one verified bucket to the forwarding thread; an error once the forward has failed."""
        forward = self._open
        if forward is None or forward.version != manifest.version:
            return LoadResult(f"bucket {bucket.index} of version {manifest.version} arrived outside its update", FailureKind.WIRE)
        if isinstance(forward.outcome, BridgeError):
            failed = self._result(manifest, forward.outcome, {}, forward.started)
            return LoadResult(failed.reason, failed.kind, frozenset(forward.held))
        if manifest.adapter is None and manifest.shards is None:  # kept as the node's latest version
            forward.kept.update(self.latest.take(bucket, in_place=False))
        if forward.thread is None:
            return LoadResult()
        forward.held.add(bucket.segment.name)
        forward.buckets.put((bucket.segment.name, bucket.checksums))
        return LoadResult(held=frozenset(forward.held))

    def finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        forward = self._open
        try:
            if forward is None or forward.version != manifest.version:
                return ApplyResult(False, f"no update of version {manifest.version} is open", FailureKind.WIRE)
            if forward.thread is not None:
                forward.thread.join()  # ends by the forwarder's own deadlines (acks, heartbeats) or close()
            # every bucket arrived and was verified here: the node's latest version, whatever its engines answered
            if manifest.adapter is None and manifest.shards is None and len(forward.kept) == len(manifest.tensors):
                self.latest.commit(manifest, forward.kept)
                self.latest_manifest = manifest if self.latest.version == manifest.version else None
            outcome = forward.outcome or TransportError("relay: the forward ended without an outcome")
            return self._result(manifest, outcome, timings, forward.started)
        finally:
            self._end(forward)

    def abort(self, manifest: wire.Manifest, reason: str) -> None:
        forward = self._open
        if forward is None or forward.version != manifest.version:
            return
        self._abort(forward, reason)

    def _result(self, manifest: wire.Manifest, outcome: PublishReport | BridgeError, timings: dict[str, float],
                t0: float) -> ApplyResult:
        """The engines' answers as one: ok only when every engine applied the version."""
        if isinstance(outcome, UpdateFailed):  # the engines that did not fail applied it
            self.versions = [v if ep in outcome.reasons else manifest.version for ep, v in zip(self.endpoints, self.versions, strict=True)]
            logger.warning("relay %s: version %s refused by %s", self.name, manifest.version, sorted(outcome.reasons))
            kind = next(iter(outcome.kinds.values()), FailureKind.OTHER)
            return ApplyResult(False, "relayed to " + "; ".join(f"{ep}: {why}" for ep, why in outcome.reasons.items()), kind)
        if isinstance(outcome, BridgeError):
            return ApplyResult(False, f"relay could not forward: {describe(outcome)}", kind_of(outcome))
        report = outcome
        self.versions = [manifest.version if e.ok and not e.noop else v for e, v in zip(report.engines, self.versions, strict=True)]
        # each engine's own answer: its name, audit and probe (a fleet reports per engine through its relays)
        engines = [{"endpoint": e.endpoint, "ok": e.ok, "noop": e.noop, "verified": e.verified, "seconds": e.seconds,
                    **{k: e.engine[k] for k in _ENGINE_FIELDS if k in e.engine}} for e in report.engines]
        stale = sorted({t for e in report.engines for t in e.engine.get("stale_tensors", [])})
        moved = sorted({t for e in report.engines for t in e.engine.get("identity_violations", [])})
        seconds = {**timings, "relay_forward": time.perf_counter() - t0,
                   "relay_engine_apply": max((e.seconds.get("apply", 0.0) for e in report.engines), default=0.0)}
        return ApplyResult(True, "", None, {"relayed": engines, "stale_tensors": stale, "identity_violations": moved,
                                            "seconds": seconds, "noop": bool(report.engines) and all(e.noop for e in report.engines)})

    def _abort(self, forward: _Forward, reason: str) -> None:
        try:
            forward.buckets.put(reason)  # the forwarder aborts the engines' update, naming the reason
            if forward.thread is not None:
                forward.thread.join()
        finally:
            self._end(forward)

    def _end(self, forward: _Forward | None) -> None:
        with self._state, self._members:
            if forward is not None and self._open is forward:
                self._open = None
                self._members.notify_all()

    def close(self) -> None:
        # a forward in progress stops waiting for the engines' answers and tells them to drop the update,
        # instead of holding the shutdown for up to deadlines.ack_s
        self._forwarder.abort("the relay is shutting down")
        forward = self._open
        if forward is not None:  # a forward the receiver left open (its abort may never have run)
            self._abort(forward, "the relay is shutting down")
        self._forwarder.close()


class Relay:
    """One relay: a receiver endpoint for publishers in front of ``engines`` (their ``ipc://`` or
    ``tcp://`` endpoints on this host; ``names`` names them for ``join`` / ``leave``, by default their endpoints)."""

    def __init__(self, engines: list[str], config: BridgeConfig | dict[str, Any] | str | None = None,
                 name: str | None = None, port: int = 0, names: list[str] | None = None, dtype: str | None = None) -> None:
        self.config = resolve_config(config)
        server_curve(self.config.transport)  # unusable keys or an unauthenticated bind: refused before reaching the engines
        self.name = name or f"relay-{socket.gethostname()}"
        self.gate = RelayGate(engines, self.config, self.name, dtype)
        self.members: dict[str, str] = dict(zip(names or engines, engines, strict=True))  # engine name -> endpoint
        self.joins: list[dict[str, Any]] = []  # every join: engine, version sent, seconds, ok
        # one copy per node: the delta base is the kept latest version, which the gate keeps (whatever its
        # engines answered); the receiver only reads it
        self.receiver = SyncReceiver(self.gate, self.config, port=port,
                                     bases=self.gate.latest if self.config.sync.delta is not False else None)
        self._closed = False
        try:
            self._endpoint = self.receiver.start()
        except BaseException:
            self.gate.close()
            raise
        logger.info("relay %s at %s forwards to %s", self.name, self._endpoint, engines)

    def endpoint(self) -> str:
        """Where publishers connect (``tcp://``)."""
        return self._endpoint

    def status(self) -> dict[str, Any]:
        names = {ep: n for n, ep in self.members.items()}
        return {"relay": self.name, "endpoint": self._endpoint, "engines": self.gate.endpoints,
                "names": [names.get(ep, ep) for ep in self.gate.endpoints],
                "versions": list(self.gate.versions), "latest": self.gate.latest.version,
                "latest_bytes": self.gate.latest.nbytes, "forwarding": self.gate.forwarding, "joins": list(self.joins),
                "sessions": self.receiver.summary()}

    def latest(self) -> int:
        """The newest version this relay received and verified (0: none yet); what a joining engine is sent."""
        return self.gate.latest.version

    def join(self, name: str, endpoint: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """Add engine ``name`` (at ``endpoint`` on this host; an engine of that name already here is replaced:
        a restarted engine) between updates: first send it the newest version this relay holds, dense over
        shared memory, and return once the engine applied and verified it (``UpdateFailed`` naming its
        reason otherwise, and it is not added). With no version held yet it is added as it is and gets the
        fleet's first one. Forwards wait meanwhile; waits at most ``timeout_s`` for one in flight to end."""
        t0 = time.perf_counter()
        gate = self.gate
        with gate.quiet(timeout_s):
            members = {n: ep for n, ep in self.members.items() if n != name and ep != endpoint}
            manifest = gate.latest_manifest
            version, report = 0, None
            if gate.latest.version and manifest is not None and manifest.version == gate.latest.version:
                report = self._send_latest(endpoint, manifest)
                version = manifest.version
            served = dict(zip(gate.endpoints, gate.versions, strict=True))
            endpoints = [*members.values(), endpoint]
            gate.swap(endpoints, [served.get(ep, 0) for ep in members.values()] + [version])
            self.members = {**members, name: endpoint}
        record = {"engine": name, "endpoint": endpoint, "version": version, "seconds": time.perf_counter() - t0,
                  "bytes": report.bytes if report is not None else 0,
                  "verified": bool(report and report.engines[0].verified), "at": time.time()}
        self.joins.append(record)
        logger.info("relay %s: engine %s joined at version %s in %.2fs", self.name, name, version, record["seconds"])
        return record

    def leave(self, name: str, endpoint: str | None = None, timeout_s: float = 60.0) -> bool:
        """Drop engine ``name`` from the next forwards (only while at ``endpoint``, when given: a restarted
        engine that joined again meanwhile stays). True if it was a member."""
        with self.gate.quiet(timeout_s):
            current = self.members.get(name)
            if current is None or (endpoint is not None and current != endpoint):
                return False
            del self.members[name]
            served = dict(zip(self.gate.endpoints, self.gate.versions, strict=True))
            self.gate.swap(list(self.members.values()), [served.get(ep, 0) for ep in self.members.values()])
        logger.info("relay %s: engine %s left", self.name, name)
        return True

    def sweep_shm(self, min_age_s: float | None = None) -> dict[str, Any]:
        """Remove the ``/dev/shm`` segments vLLM engines of this node left when they died (bridge/vllm_shm.py);
        the report lists what was removed and what could not be cleaned, with why."""
        from dataclasses import asdict

        from bridge.vllm_shm import MIN_AGE_S, sweep_vllm_segments

        return asdict(sweep_vllm_segments(min_age_s=MIN_AGE_S if min_age_s is None else min_age_s))

    def seed(self, endpoint: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """Send the newest version this relay holds to another relay at ``endpoint`` (a node that just got its
        first engine), dense over ZMQ with this relay's CURVE client keys (``transport.curve_client_secret``
        and ``curve_server_public``); returns what was sent. Forwards wait meanwhile."""
        t0 = time.perf_counter()
        with self.gate.quiet(timeout_s):
            manifest = self.gate.latest_manifest
            if not self.gate.latest.version or manifest is None or manifest.version != self.gate.latest.version:
                return {"version": 0, "bytes": 0, "seconds": 0.0}
            report = self._send_latest(endpoint, manifest, "zmq", None)
        return {"version": manifest.version, "bytes": report.bytes, "seconds": time.perf_counter() - t0}

    def _send_latest(self, endpoint: str, manifest: wire.Manifest, transport: str = "shm",
                     curve_server_public: str | None = "") -> PublishReport:
        """The kept version, dense, to the one receiver at ``endpoint`` (an engine of this host over shm, without
        CURVE; or a peer relay over ZMQ)."""
        import numpy as np

        store = self.gate.latest
        manifest = replace(manifest, probe=None, delta=None)
        buckets = manifest.by_bucket()
        for spec in manifest.tensors:
            data = store.tensors.get(spec.name)
            if data is None or data.nbytes != spec.nbytes:
                raise FleetError(f"relay {self.name}: tensor {spec.name} of version {manifest.version} is not kept")

        def fill(index: int, buffer: Any) -> tuple[int, ...]:
            view = buffer.numpy() if hasattr(buffer, "numpy") else np.frombuffer(buffer, dtype=np.uint8)
            for spec in buckets[index]:
                view[spec.offset:spec.offset + spec.nbytes] = store.tensors[spec.name]
            return tuple(store.sums[s.name] for s in buckets[index])

        sender = UpdateSender([endpoint], config=self.config, name=f"{self.name}-join", transport=transport,
                              curve_server_public=curve_server_public)
        try:
            return sender.send_filled(manifest, fill)
        finally:
            sender.close()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.receiver.stop()
        self.gate.close()
