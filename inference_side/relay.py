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
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bridge import wire
from bridge.config import BridgeConfig
from bridge.curve import server_curve
from bridge.errors import BridgeError, ConfigError, TransportError, UpdateFailed
from bridge.report import ApplyResult, FailureKind, LoadResult, describe, kind_of
from bridge.sender import PublishReport, UpdateSender
from inference_side.contract import EngineGate, StagedBucket
from inference_side.receiver import SyncReceiver
from inference_side.server import resolve_config

logger = logging.getLogger(__name__)


@dataclass
class _Forward:
    """The forward of one update: verified buckets queue up for the thread that sends them on."""

    version: int
    buckets: queue.Queue[tuple[str, tuple[int, ...]] | str] = field(default_factory=queue.Queue)
    held: set[str] = field(default_factory=set)  # segments forwarded: engines may map them until they answer
    outcome: PublishReport | BridgeError | None = None
    thread: threading.Thread | None = None
    started: float = field(default_factory=time.perf_counter)


class RelayGate(EngineGate):
    """The relay's engine contract: validates nothing itself (each engine validates the manifest it is sent)
    and forwards each loaded bucket to the local engines as it comes (``begin`` starts the forward on a
    thread of its own, ``finish`` waits for the engines' answers)."""

    def __init__(self, engines: list[str], config: BridgeConfig, name: str) -> None:
        self.config = config
        self._open: _Forward | None = None
        if not engines:
            raise ConfigError("a relay needs at least one local engine endpoint")
        self.name = name
        self.endpoints = list(engines)
        # its engines are on this host (ipc:// or loopback): reached without CURVE, which guards the relay's own endpoint
        self._forwarder = UpdateSender(engines, config=config, name=name, transport="shm", curve_server_public="")
        self._state = threading.Lock()  # guards ending self._open (the apply thread and close() may both)
        try:
            infos = self._forwarder.engines()
            dtypes = {i.dtype for i in infos}
            if len(dtypes) != 1:
                raise ConfigError(f"the relay's engines serve different dtypes {sorted(dtypes)}: one relay per dtype")
            lacking = [ep for ep, i in zip(engines, infos, strict=True) if "shm" not in i.transports]
            if lacking:
                raise ConfigError(f"engines {lacking} do not take the shm transport: a relay serves engines on its own host")
        except BridgeError:
            self._forwarder.close()
            raise
        self.dtype = dtypes.pop()
        self.tp_size = max(i.tp_size for i in infos)
        self.versions = [i.version for i in infos]

    def info(self) -> wire.EngineInfo:
        return wire.EngineInfo(dtype=self.dtype, version=min(self.versions), tp_size=self.tp_size,
                               transports=("zmq",), host=socket.gethostname())

    def validate(self, manifest: wire.Manifest) -> str | None:
        return None

    def begin(self, manifest: wire.Manifest) -> None:
        forward = self._open = _Forward(manifest.version)
        wait_s = self.config.deadlines.bucket_s

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
        forward.held.add(bucket.segment.name)
        forward.buckets.put((bucket.segment.name, bucket.checksums))
        return LoadResult(held=frozenset(forward.held))

    def finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        forward = self._open
        try:
            if forward is None or forward.version != manifest.version or forward.thread is None:
                return ApplyResult(False, f"no update of version {manifest.version} is open", FailureKind.WIRE)
            forward.thread.join()  # ends by the forwarder's own deadlines (acks, heartbeats) or close()
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
        if isinstance(outcome, UpdateFailed):
            logger.warning("relay %s: version %s refused by %s", self.name, manifest.version, sorted(outcome.reasons))
            kind = next(iter(outcome.kinds.values()), FailureKind.OTHER)
            return ApplyResult(False, "relayed to " + "; ".join(f"{ep}: {why}" for ep, why in outcome.reasons.items()), kind)
        if isinstance(outcome, BridgeError):
            return ApplyResult(False, f"relay could not forward: {describe(outcome)}", kind_of(outcome))
        report = outcome
        self.versions = [manifest.version if e.ok and not e.noop else v for e, v in zip(report.engines, self.versions, strict=True)]
        engines = [{"endpoint": e.endpoint, "ok": e.ok, "noop": e.noop, "verified": e.verified,
                    "seconds": e.seconds} for e in report.engines]
        stale = sorted({t for e in report.engines for t in e.engine.get("stale_tensors", [])})
        moved = sorted({t for e in report.engines for t in e.engine.get("identity_violations", [])})
        seconds = {**timings, "relay_forward": time.perf_counter() - t0,
                   "relay_engine_apply": max(e.seconds.get("apply", 0.0) for e in report.engines)}
        return ApplyResult(True, "", None, {"relayed": engines, "stale_tensors": stale, "identity_violations": moved,
                                            "seconds": seconds, "noop": all(e.noop for e in report.engines)})

    def _abort(self, forward: _Forward, reason: str) -> None:
        try:
            forward.buckets.put(reason)  # the forwarder aborts the engines' update, naming the reason
            if forward.thread is not None:
                forward.thread.join()
        finally:
            self._end(forward)

    def _end(self, forward: _Forward | None) -> None:
        with self._state:
            if forward is not None and self._open is forward:
                self._open = None

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
    ``tcp://`` endpoints on this host)."""

    def __init__(self, engines: list[str], config: BridgeConfig | dict[str, Any] | str | None = None,
                 name: str | None = None, port: int = 0) -> None:
        self.config = resolve_config(config)
        server_curve(self.config.transport)  # unusable keys or an unauthenticated bind: refused before reaching the engines
        self.name = name or f"relay-{socket.gethostname()}"
        self.gate = RelayGate(engines, self.config, self.name)
        self.receiver = SyncReceiver(self.gate, self.config, port=port)
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
        return {"relay": self.name, "endpoint": self._endpoint, "engines": self.gate.endpoints,
                "versions": list(self.gate.versions), "sessions": self.receiver.summary()}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.receiver.stop()
        self.gate.close()
