"""Pull engines' status and sync records into a ``MetricsHub``.

A source is any callable returning ``(status_dict, list_of_record_dicts)``: a local ``InferenceServer``
(``server_source``), a Ray actor (``ray_source``, ``NamedActorSource``), any weight-bridge receiver asked
over its own endpoint (``ReceiverSource``: engines behind ``vllm serve``, on any host) or a stub in tests.
Engines return their recent history, so records are deduplicated by ``(engine, version, timestamp)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from apps.metrics import MetricsHub
from bridge.errors import BridgeError
from bridge.records import SyncRecord

logger = logging.getLogger(__name__)

Source = Callable[[], tuple[dict[str, Any], list[dict[str, Any]]]]
RecordKey = tuple[str, int, float]


def server_source(server: Any) -> Source:
    """A source over an object with ``status()`` and ``records()`` methods (an ``InferenceServer``)."""
    return lambda: (server.status(), server.records())


def ray_source(actor: Any, timeout_s: float = 5.0) -> Source:
    """A source over an ``InferenceActor`` handle; one round trip per poll."""

    def pull() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        import ray

        status, records = ray.get([actor.status.remote(), actor.records.remote()], timeout=timeout_s)
        return status, records

    return pull


class NamedActorSource:
    """A source over a named ``InferenceActor``, looked up on first use and again after any failure,
    so the dashboard may start before the engines do. Needs ``ray.init`` done by the caller."""

    def __init__(self, name: str, namespace: str | None = None, timeout_s: float = 5.0) -> None:
        self.name = name
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._handle: Any = None

    def __call__(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        import ray

        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        try:
            status, records = ray.get([self._handle.status.remote(), self._handle.records.remote()],
                                      timeout=self.timeout_s)
        except Exception:
            self._handle = None  # look the actor up again next time: it may have been restarted
            raise
        return status, records


class ReceiverSource:
    """A source over a weight-bridge receiver's own endpoint (``tcp://host:port``; ``host:port`` is taken as
    tcp): a ``StatusRequest`` answered by the receiver's socket thread with the engine's status and records,
    also while an update runs. For an engine behind ``vllm serve`` (the ``weight_bridge`` backend) that is TP
    rank 0's receiver, ``host:base_port``; no port or route beyond the one the trainer publishes to. Later
    polls ask only for records newer than the last seen (less a margin; the poller drops repeats).
    ``curve_server_public``: the receivers' CURVE key when they require it (``transport.curve_server_public``);
    ``curve_client_secret``: the key this poller presents (``transport.curve_client_secret``), which receivers
    with a client list (``transport.curve_clients``) must list. A refused handshake fails the poll at once,
    saying why."""

    OVERLAP_S = 30.0  # records are stamped when made and kept in the order they end: ask again a little earlier

    def __init__(self, endpoint: str, timeout_s: float = 5.0, curve_server_public: str = "",
                 max_reply_bytes: int = 256 << 20, curve_client_secret: str = "") -> None:
        from bridge.config import TransportConfig
        from bridge.curve import client_curve

        self.endpoint = endpoint if "://" in endpoint else f"tcp://{endpoint}"
        self.name = self.endpoint  # until the engine names itself (the poller's label for an outage)
        self.timeout_s = timeout_s
        self.curve = client_curve(TransportConfig(curve_server_public=curve_server_public,
                                                  curve_client_secret=curve_client_secret))
        self.max_reply_bytes = max_reply_bytes
        self._since = 0.0
        self._sock: Any = None
        self._monitor: Any = None

    def _socket(self) -> Any:
        import zmq

        from bridge.curve import secure_client, watch

        if self._sock is None:
            sock: Any = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, self.curve)
            self._monitor = watch(sock)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)
            self._sock = None

    def __call__(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        from bridge import wire
        from bridge.curve import handshake_failure, send_connected
        from bridge.errors import DeadlineExceeded

        def check_refused() -> None:
            refused = handshake_failure(self._monitor, self.curve, peer="receiver")
            if refused:
                self.close()  # a late answer must not be read as the next poll's
                raise BridgeError(f"{self.endpoint} refused the status request: {refused}")

        sock = self._socket()
        end = time.monotonic() + self.timeout_s
        try:  # a refused handshake leaves no connection: a plain send would wait forever
            send_connected(sock, [wire.encode(wire.StatusRequest(since=self._since))], self.timeout_s, check_refused,
                           self.endpoint)
        except DeadlineExceeded:
            self.close()
            raise TimeoutError(f"no status from {self.endpoint} within {self.timeout_s}s") from None
        while not sock.poll(50):
            check_refused()
            if time.monotonic() > end:
                self.close()
                raise TimeoutError(f"no status from {self.endpoint} within {self.timeout_s}s")
        reply = wire.decode(sock.recv(), max_bytes=self.max_reply_bytes)
        if not isinstance(reply, wire.StatusReply):
            raise BridgeError(f"{self.endpoint} answered a status request with {reply.type!r}")
        if "engine" not in reply.status:
            raise BridgeError(f"{self.endpoint} could not report its status: {reply.status.get('error', reply.status)}")
        self.name = str(reply.status["engine"])
        stamps = [float(r["timestamp"]) for r in reply.records if isinstance(r.get("timestamp"), int | float)]
        if stamps:
            self._since = max(self._since, max(stamps) - self.OVERLAP_S)
        return dict(reply.status), list(reply.records)


class Poller:
    """Calls every source each ``interval_s`` seconds (in a daemon thread) and feeds the hub."""

    def __init__(self, hub: MetricsHub, sources: Sequence[Source], interval_s: float = 1.0,
                 dedupe_capacity: int | None = None) -> None:
        self.hub = hub
        self.sources = list(sources)
        self.interval_s = interval_s
        self._capacity = dedupe_capacity or 4 * max(1, len(self.sources)) * max(1, hub.history)
        self._seen: OrderedDict[RecordKey, None] = OrderedDict()
        self._names: dict[int, str] = {}  # source index -> engine name from its last good status
        self._failing: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> int:
        """Pull every source once; return how many new records reached the hub."""
        fed = 0
        for index, source in enumerate(self.sources):
            try:
                status, records = source()
            except Exception as exc:  # noqa: BLE001 - any failure of one source must not stop the others
                name = self._names.get(index) or getattr(source, "name", None) or f"source-{index}"
                level = logging.DEBUG if index in self._failing else logging.WARNING  # warn once per outage
                logger.log(level, "status of %s unavailable: %s", name, exc)
                self._failing.add(index)
                self.hub.set_engine_unreachable(name, f"{type(exc).__name__}: {exc}")
                continue
            if index in self._failing:
                self._failing.discard(index)
                logger.info("status of %s available again", status.get("engine"))
            self._names[index] = str(status.get("engine", f"source-{index}"))
            fed += self._feed(records)
            self.hub.set_engine_status(status)
        return fed

    def _feed(self, records: list[dict[str, Any]]) -> int:
        fed = 0
        for data in records:
            try:
                record = SyncRecord.from_dict(data)
            except (TypeError, ValueError, AttributeError) as exc:
                logger.warning("skipping malformed sync record %.200r: %s", data, exc)
                continue
            key = (record.engine, record.version, record.timestamp)
            if key in self._seen:
                continue
            self._seen[key] = None
            if len(self._seen) > self._capacity:
                self._seen.popitem(last=False)
            self.hub.observe(record)
            fed += 1
        return fed

    def start(self) -> Poller:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="weight-bridge-poller", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval_s)
