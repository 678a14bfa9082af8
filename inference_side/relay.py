"""A host-local relay: takes each update once over the network and hands it to every engine on its host
through shared memory.

Without it a publisher sends the same bytes once per engine (over ``tcp://``, one stream each). A
``Relay`` on the engines' host is one receiver to the publisher: it stages and verifies the update in
``/dev/shm`` like an engine does, then forwards it to its local engines over the shm transport, naming
the segments it staged: each engine maps them in place (zero copies after the network). Its answer to
the publisher is the engines' answers combined: ok only when every engine applied the version; a refusal
names the engine and its reason.

With ``sync.mode: streaming`` (the relay's own config) each bucket is forwarded as soon as it is staged and
verified, so the engines load bucket k while bucket k+1 crosses the network; otherwise the relay stores the
whole update, then forwards it. Either way it holds the update's buckets in ``/dev/shm`` until every engine
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
from bridge.errors import BridgeError, ConfigError, TransportError, UpdateFailed
from bridge.sender import PublishReport, UpdateSender
from inference_side.receiver import ApplyResult, StagedBucket, SyncReceiver
from inference_side.server import resolve_config

logger = logging.getLogger(__name__)


@dataclass
class _Forward:
    """A streaming forward in progress: staged buckets queue up for the thread that sends them on."""

    version: int
    buckets: queue.Queue[tuple[str, tuple[int, ...]] | str] = field(default_factory=queue.Queue)
    held: set[str] = field(default_factory=set)  # segments forwarded: engines may map them until they answer
    outcome: PublishReport | BridgeError | None = None
    thread: threading.Thread | None = None
    started: float = field(default_factory=time.perf_counter)


class RelayGate:
    """The relay's EngineGate: validates nothing itself (each engine validates the manifest it is sent)
    and applies an update by forwarding its staged buckets to the local engines."""

    def __init__(self, engines: list[str], config: BridgeConfig, name: str) -> None:
        self.config = config
        self._stream: _Forward | None = None
        if not engines:
            raise ConfigError("a relay needs at least one local engine endpoint")
        self.name = name
        self.endpoints = list(engines)
        self._forwarder = UpdateSender(engines, config=config, name=name, transport="shm")
        self._lock = threading.Lock()  # one forward at a time (the sender's sockets are not thread-safe)
        self._state = threading.Lock()  # guards ending self._stream
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

    def apply(self, manifest: wire.Manifest, buckets: list[StagedBucket], timings: dict[str, float]) -> ApplyResult:
        staged = [(b.segment.name, b.checksums) for b in sorted(buckets, key=lambda b: b.index)]
        t0 = time.perf_counter()
        with self._lock:
            outcome = self._forward(manifest, staged.__getitem__)
        return self._result(manifest, outcome, timings, t0)

    def _forward(self, manifest: wire.Manifest, staged: Any) -> PublishReport | BridgeError:
        try:
            return self._forwarder.forward(manifest, staged)
        except BridgeError as exc:
            return exc

    def _result(self, manifest: wire.Manifest, outcome: PublishReport | BridgeError, timings: dict[str, float],
                t0: float) -> ApplyResult:
        """The engines' answers as one: ok only when every engine applied the version."""
        if isinstance(outcome, UpdateFailed):
            logger.warning("relay %s: version %s refused by %s", self.name, manifest.version, sorted(outcome.reasons))
            return ApplyResult(False, "relayed to " + "; ".join(f"{ep}: {why}" for ep, why in outcome.reasons.items()))
        if isinstance(outcome, BridgeError):
            return ApplyResult(False, f"relay could not forward: {type(outcome).__name__}: {outcome}")
        report = outcome
        self.versions = [manifest.version if e.ok and not e.noop else v for e, v in zip(report.engines, self.versions, strict=True)]
        engines = [{"endpoint": e.endpoint, "ok": e.ok, "noop": e.noop, "verified": e.verified,
                    "seconds": e.seconds} for e in report.engines]
        stale = sorted({t for e in report.engines for t in e.engine.get("stale_tensors", [])})
        moved = sorted({t for e in report.engines for t in e.engine.get("identity_violations", [])})
        seconds = {**timings, "relay_forward": time.perf_counter() - t0,
                   "relay_engine_apply": max(e.seconds.get("apply", 0.0) for e in report.engines)}
        return ApplyResult(True, "", {"relayed": engines, "stale_tensors": stale, "identity_violations": moved,
                                      "seconds": seconds, "noop": all(e.noop for e in report.engines)})

    # ---- streaming: the receiver calls these in order on its apply thread ------------------------------
    def stream_begin(self, manifest: wire.Manifest) -> None:
        self._lock.acquire()  # released by stream_finish / stream_abort
        stream = self._stream = _Forward(manifest.version)
        wait_s = self.config.deadlines.bucket_s

        def staged(index: int) -> tuple[str, tuple[int, ...]]:
            try:
                item = stream.buckets.get(timeout=wait_s)
            except queue.Empty:
                raise TransportError(f"relay: bucket {index} was not staged within {wait_s}s") from None
            if isinstance(item, str):
                raise TransportError(f"relay: the update was abandoned upstream: {item}")
            return item

        def run() -> None:
            stream.outcome = self._forward(manifest, staged)

        stream.thread = threading.Thread(target=run, name="wb-relay-forward", daemon=True)
        stream.thread.start()

    def stream_load(self, manifest: wire.Manifest, bucket: StagedBucket) -> str:
        """Hand one verified bucket to the forwarding thread; an error once the forward has failed."""
        stream = self._stream
        if stream is None or stream.version != manifest.version:
            return f"bucket {bucket.index} of version {manifest.version} arrived outside its streaming update"
        if isinstance(stream.outcome, BridgeError):
            return self._result(manifest, stream.outcome, {}, stream.started).reason
        stream.held.add(bucket.segment.name)
        stream.buckets.put((bucket.segment.name, bucket.checksums))
        return ""

    def stream_held(self) -> frozenset[str]:
        """Segments forwarded in the open update: the receiver must not reuse them before it ends."""
        stream = self._stream
        return frozenset(stream.held) if stream is not None else frozenset()

    def stream_finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        stream = self._stream
        try:
            if stream is None or stream.version != manifest.version or stream.thread is None:
                return ApplyResult(False, f"no streaming update of version {manifest.version} is open")
            stream.thread.join()  # ends by the forwarder's own deadlines (acks, heartbeats) or close()
            outcome = stream.outcome or TransportError("relay: the forward ended without an outcome")
            return self._result(manifest, outcome, timings, stream.started)
        finally:
            self._end_stream(stream)

    def stream_abort(self, manifest: wire.Manifest, reason: str) -> None:
        stream = self._stream
        if stream is None or stream.version != manifest.version:
            return
        self._abort(stream, reason)

    def _abort(self, stream: _Forward, reason: str) -> None:
        try:
            stream.buckets.put(reason)  # the forwarder aborts the engines' update, naming the reason
            if stream.thread is not None:
                stream.thread.join()
        finally:
            self._end_stream(stream)

    def _end_stream(self, stream: _Forward | None = None) -> None:
        with self._state:  # the apply thread and close() may both end the same stream
            if self._stream is None or (stream is not None and self._stream is not stream):
                return
            self._stream = None
        self._lock.release()

    def close(self) -> None:
        # a forward in progress (staged or streaming) stops waiting for the engines' answers and tells
        # them to drop the update, instead of holding the shutdown for up to deadlines.ack_s
        self._forwarder.abort("the relay is shutting down")
        stream = self._stream
        if stream is not None:  # a forward the receiver left open (its abort may never have run)
            self._abort(stream, "the relay is shutting down")
        with self._lock:
            self._forwarder.close()


class Relay:
    """One relay: a receiver endpoint for publishers in front of ``engines`` (their ``ipc://`` or
    ``tcp://`` endpoints on this host)."""

    def __init__(self, engines: list[str], config: BridgeConfig | dict[str, Any] | str | None = None,
                 name: str | None = None) -> None:
        self.config = resolve_config(config)
        self.name = name or f"relay-{socket.gethostname()}"
        self.gate = RelayGate(engines, self.config, self.name)
        self.receiver = SyncReceiver(self.gate, self.config)
        self._closed = False
        self._endpoint = self.receiver.start()
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
