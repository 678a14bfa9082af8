"""A host-local relay: takes each update once over the network and hands it to every engine on its host
through shared memory.

Without it a publisher sends the same bytes once per engine (over ``tcp://``, one stream each). A
``Relay`` on the engines' host is one receiver to the publisher: it stages and verifies the update in
``/dev/shm`` like an engine does, then forwards it to its local engines over the shm transport, naming
the segments it staged: each engine maps them in place (zero copies after the network). Its answer to
the publisher is the engines' answers combined: ok only when every engine applied the version; a refusal
names the engine and its reason.

The relay is store-and-forward (the whole update is staged before the first engine loads it) and answers
as one engine: ``EngineInfo.version`` is the oldest version its engines serve. ``RelayActor`` (in
``inference_side/__init__.py``) is this class as a Ray actor, placed on the engines' node.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from bridge import wire
from bridge.config import BridgeConfig
from bridge.errors import BridgeError, ConfigError, UpdateFailed
from inference_side.receiver import ApplyResult, StagedBucket, SyncReceiver
from inference_side.server import resolve_config

logger = logging.getLogger(__name__)


class RelayGate:
    """The relay's EngineGate: validates nothing itself (each engine validates the manifest it is sent)
    and applies an update by forwarding its staged buckets to the local engines."""

    def __init__(self, engines: list[str], config: BridgeConfig, name: str) -> None:
        from trainer_side.publisher import WeightPublisher

        if not engines:
            raise ConfigError("a relay needs at least one local engine endpoint")
        self.name = name
        self.endpoints = list(engines)
        self._forwarder = WeightPublisher(engines, config=config, name=name, transport="shm")
        self._lock = threading.Lock()  # one forward at a time (the publisher's sockets are not thread-safe)
        with self._lock:
            infos = self._forwarder.engines()
        dtypes = {i.dtype for i in infos}
        if len(dtypes) != 1:
            raise ConfigError(f"the relay's engines serve different dtypes {sorted(dtypes)}: one relay per dtype")
        lacking = [ep for ep, i in zip(engines, infos, strict=True) if "shm" not in i.transports]
        if lacking:
            raise ConfigError(f"engines {lacking} do not take the shm transport: a relay serves engines on its own host")
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
            try:
                report = self._forwarder.forward(manifest, staged)
            except UpdateFailed as exc:
                logger.warning("relay %s: version %s refused by %s", self.name, manifest.version, sorted(exc.reasons))
                return ApplyResult(False, "relayed to " + "; ".join(f"{ep}: {why}" for ep, why in exc.reasons.items()))
            except BridgeError as exc:
                return ApplyResult(False, f"relay could not forward: {type(exc).__name__}: {exc}")
        self.versions = [manifest.version if e.ok and not e.noop else v for e, v in zip(report.engines, self.versions, strict=True)]
        engines = [{"endpoint": e.endpoint, "ok": e.ok, "noop": e.noop, "verified": e.verified,
                    "seconds": e.seconds} for e in report.engines]
        stale = sorted({t for e in report.engines for t in e.engine.get("stale_tensors", [])})
        moved = sorted({t for e in report.engines for t in e.engine.get("identity_violations", [])})
        seconds = {**timings, "relay_forward": time.perf_counter() - t0,
                   "relay_engine_apply": max(e.seconds.get("apply", 0.0) for e in report.engines)}
        return ApplyResult(True, "", {"relayed": engines, "stale_tensors": stale, "identity_violations": moved,
                                      "seconds": seconds, "noop": all(e.noop for e in report.engines)})

    def close(self) -> None:
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
        self._endpoint = self.receiver.start()
        logger.info("relay %s at %s forwards to %s", self.name, self._endpoint, engines)

    def endpoint(self) -> str:
        """Where publishers connect (``tcp://``)."""
        return self._endpoint

    def status(self) -> dict[str, Any]:
        return {"relay": self.name, "endpoint": self._endpoint, "engines": self.gate.endpoints,
                "versions": list(self.gate.versions), "sessions": self.receiver.summary()}

    def shutdown(self) -> None:
        self.receiver.stop()
        self.gate.close()
