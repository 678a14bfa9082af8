"""UpdateSender: the sending half of the protocol, shared by the trainer's publisher and the relay.

One update: hello (engine dtype) -> manifest -> buckets in layer order, each produced while the previous
one is on the wire, never more in flight per engine than that engine granted -> end -> ack.
``trainer_side.publisher.WeightPublisher`` adds ``publish`` (packing named tensors into the buckets);
``inference_side.relay`` uses ``forward`` (buckets already staged in shared memory).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Self

from bridge import wire
from bridge.checksums import preferred as preferred_checksum
from bridge.config import BridgeConfig, load_config
from bridge.curve import client_curve, handshake_failure, secure_client, send_connected, watch
from bridge.errors import DeadlineExceeded, TransportError, UpdateFailed, WireError
from bridge.report import FailureKind, describe, kind_of, parse_kind
from bridge.served import conflict_reason, differing, published_sums
from bridge.shm import sweep_orphans
from bridge.transports import send_plane
from bridge.transports.base import OutgoingBucket, SendPlane

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineReport:
    endpoint: str
    version: int
    ok: bool
    reason: str
    bytes: int
    seconds: dict[str, float]
    verified: bool
    noop: bool = False
    engine: dict[str, Any] = field(default_factory=dict)
    kind: FailureKind | None = None  # why it failed (None when ok); ``reason`` says it for people
    # a delta update this engine refused (kind ``base``: it does not serve the base) and that was resent to it
    # dense: the refusal's reason (empty when it took the update as first sent)
    dense_fallback: str = ""


@dataclass(frozen=True)
class PublishReport:
    version: int
    bytes: int
    seconds: dict[str, float]
    engines: tuple[EngineReport, ...]
    held_bytes: int = 0  # packing buffers the publisher keeps for the next update (shm: in /dev/shm)
    # delta telemetry (trainer_side/delta_publish.py): mode, base version, wire and dense bytes, density,
    # engines resent dense; empty when deltas are off
    delta: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.engines)

    @property
    def gbps(self) -> float:
        total = self.seconds.get("total", 0.0)
        return self.bytes / total / 1e9 if total > 0 else 0.0


@dataclass
class _Peer:
    endpoint: str
    socket: Any
    info: wire.EngineInfo | None = None
    credit: int = 0
    ack: wire.Ack | None = None
    last_heard: float = 0.0
    released: set[int] = field(default_factory=set)  # buckets of this update it will not read again
    monitor: Any = None  # ZMQ monitor socket reporting failed security handshakes
    refused: str = ""  # why its security handshake failed, once it did


class UpdateSender:
    """Sends updates to one or more inference endpoints (``tcp://host:port``): connecting, the handshake,
    credits, acks and reports. ``WeightPublisher`` (trainer_side) adds ``publish``; the relay uses
    ``forward``."""

    def __init__(self, endpoints: list[str] | str, config: BridgeConfig | str | None = None,
                 name: str | None = None, transport: str | None = None, curve_server_public: str | None = None) -> None:
        import zmq

        self.config = config if isinstance(config, BridgeConfig) else load_config(config)
        sweep_orphans()  # segments a SIGKILLed trainer (or any dead receiver) left in /dev/shm
        self.transport = transport or self.config.transport.kind
        self.name = name or f"publisher-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._ctx: Any = zmq.Context.instance()
        # CURVE towards the engines: curve_server_public ("" for none) overrides transport.curve_server_public
        self._curve = client_curve(self.config.transport, curve_server_public)
        self._current = 0  # version being published
        self._begun = 0  # the version whose Begin this send sent (abandon tells only before it did)
        self._aborted = ""  # set by abort(), from any thread: every send fails from then on
        self._planes: dict[str, SendPlane] = {}  # kept across updates: their buffers are reused
        self._peers = [self._connect(ep) for ep in ([endpoints] if isinstance(endpoints, str) else endpoints)]
        self._poller = zmq.Poller()
        for peer in self._peers:
            self._poller.register(peer.socket, zmq.POLLIN)

    def _connect(self, endpoint: str) -> _Peer:
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"{self.name}|{endpoint}".encode()[:255])
        secure_client(sock, self._curve)
        monitor = watch(sock)
        sock.connect(endpoint)
        return _Peer(endpoint, sock, monitor=monitor)

    def close(self) -> None:
        """Close the sockets and send planes; closing twice is harmless."""
        for peer in self._peers:
            if peer.socket.closed:
                continue
            peer.socket.disable_monitor()
            peer.monitor.close(0)
            peer.socket.close(0)
        for plane in self._planes.values():
            plane.close()
        self._planes.clear()

    def abort(self, reason: str) -> None:
        """Make the send in progress (``publish`` or ``forward`` on another thread) fail within one poll
        (50 ms), its engines told to drop the update, and every later send fail too; the publisher is
        done. Safe to call from any thread: it only sets a flag that the sending thread reads."""
        self._aborted = reason or "aborted"

    def _starting(self, version: int) -> None:
        """A send of ``version`` begins (its Begin has not gone out yet)."""
        self._current, self._begun = version, 0

    def abandon(self, version: int, reason: str) -> None:
        """Tell every engine that ``version`` will not come (an Abort), unless its Begin went out (a send that
        failed after its Begin told the engines itself): a send that failed before (a refused handshake, the
        trainer's weights raising while they were read). An engine waiting for that version (vLLM's
        ``update_weights`` through the weight_bridge backend) stops waiting now instead of at its deadline.
        An engine whose connection does not take the message now learns nothing."""
        if version == self._begun:
            return
        for peer in self._peers:
            self._tell(peer, wire.Abort(version=version, reason=reason))

    def _checksum(self) -> str:
        choice = self.config.sync.checksum
        return preferred_checksum() if choice == "auto" else choice

    def _plane(self) -> SendPlane:
        plane = self._planes.get(self.transport)
        if plane is None:
            plane = self._planes[self.transport] = send_plane(self.transport, self.config)
        plane.configure(self.config.transport.depth)
        return plane

    def _handshake_failure(self, peer: _Peer) -> str:
        """Why the security handshake with ``peer`` failed, if it did (empty string otherwise)."""
        if not peer.refused and not peer.socket.closed:
            peer.refused = handshake_failure(peer.monitor, self._curve)
        return peer.refused

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- messaging ----------------------------------------------------------------------------
    def _send(self, peer: _Peer, msg: wire.Message, frames: tuple[Any, ...] = (), within_s: float | None = None) -> Any:
        """Send a header and its frames; with frames, return the tracker of the last one. Waits for a connection
        at most ``within_s`` (default ``deadlines.connect_s``): TransportError at once when the engine refused
        the security handshake (its connection is gone for good), DeadlineExceeded when the time ran out."""
        wait = self.config.deadlines.connect_s if within_s is None else within_s
        return send_connected(peer.socket, [wire.encode(msg), *frames], wait, lambda: self._raise_refused([peer]),
                              peer.endpoint)

    def _tell(self, peer: _Peer, msg: wire.Message) -> None:
        """Send ``msg`` (an Abort) if the engine's connection takes it now; an engine without one learns
        nothing, and the failure that made this send is what the caller reports."""
        try:
            self._send(peer, msg, within_s=0)
        except TransportError as exc:
            logger.info("%s: %s not sent: %s", peer.endpoint, msg.type, exc)

    def _pump(self, timeout_s: float) -> None:
        """Receive whatever arrived within ``timeout_s`` and update peer state (TransportError once the
        publisher was aborted)."""
        import zmq

        if self._aborted:
            raise TransportError(f"the publisher was aborted: {self._aborted}")
        for sock, _ in self._poller.poll(int(timeout_s * 1000)):
            peer = next((p for p in self._peers if p.socket is sock), None)
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if peer is None:  # an engine left out of this send (``_only``): nothing of it concerns it
                    continue
                peer.last_heard = time.monotonic()
                msg = wire.decode(frames[0])
                if isinstance(msg, wire.EngineInfo):
                    peer.info = msg
                elif isinstance(msg, wire.Credit | wire.Ack) and msg.version not in (0, self._current):
                    # late answer to an earlier, abandoned update (delivered after a reconnect): not ours
                    logger.debug("ignoring %s for version %s while publishing %s", msg.type, msg.version, self._current)
                elif isinstance(msg, wire.Credit):
                    peer.credit += msg.n
                    peer.released.update(msg.released)
                elif isinstance(msg, wire.Ack) and peer.ack is None:
                    peer.ack = msg  # the first answer is the cause; a later one only echoes its aftermath

    def _wait(self, cond: Any, deadline_s: float, what: str, peers: list[_Peer]) -> None:
        end = time.monotonic() + deadline_s
        while not all(cond(p) for p in peers):
            remaining = end - time.monotonic()
            if remaining <= 0:
                late = [p.endpoint for p in peers if not cond(p)]
                raise DeadlineExceeded(f"{what}: no answer within {deadline_s}s from {late}")
            self._pump(min(remaining, 0.05))

    def _hello(self) -> None:
        todo = [p for p in self._peers if p.info is None]
        for peer in todo:
            self._send(peer, wire.Hello(publisher=self.name))
        # a failed security handshake is final: waiting out the deadline would not change it
        settled = lambda p: p.info is not None or p.ack is not None or bool(self._handshake_failure(p))  # noqa: E731
        try:
            self._wait(settled, self.config.deadlines.connect_s, "connect", todo)
        except DeadlineExceeded as exc:
            self._raise_refused(todo, exc)
            raise
        self._raise_refused(todo)
        for peer in todo:
            if peer.ack is not None and not peer.ack.ok:
                raise TransportError(f"{peer.endpoint} refused the connection: {peer.ack.reason}")

    def _raise_refused(self, peers: list[_Peer], cause: BaseException | None = None) -> None:
        """TransportError naming every peer among ``peers`` whose security handshake failed, if any did."""
        refused = {p.endpoint: why for p in peers if p.info is None and (why := self._handshake_failure(p))}
        if refused:
            detail = "; ".join(f"{ep}: {why}" for ep, why in refused.items())
            raise TransportError(f"connection refused by {len(refused)} engine(s): {detail}") from cause

    # ---- sending ------------------------------------------------------------------------------
    def forward(self, manifest: wire.Manifest, staged: Callable[[int], tuple[str, tuple[int, ...]]]) -> PublishReport:
        """Send an update whose buckets already lie packed in shared-memory segments: ``staged(index)`` gives
        bucket ``index``'s segment name and checksums, called in index order and free to wait until the
        bucket exists (raise TransportError to abort). A host-local relay's path: nothing is copied. The
        manifest goes out as this publisher's, over shm; raise UpdateFailed as ``publish`` does."""
        if self.transport != "shm":
            raise TransportError(f"forward sends buckets that lie in shared memory: the transport must be shm, not {self.transport}")
        t_start = time.perf_counter()
        self._starting(manifest.version)
        self._agreed_dtype()
        manifest = replace(manifest, publisher=self.name, transport="shm", delta=None, keep_base=False)  # staged buckets hold full tensors

        def produce(index: int, size: int) -> tuple[OutgoingBucket, tuple[int, ...]]:
            segment, sums = staged(index)
            return OutgoingBucket(index, None, (), segment=segment), sums

        return self._stream(manifest, self._plane(), produce, t_start)

    def send_filled(self, manifest: wire.Manifest, fill: Callable[[int, Any], tuple[int, ...]]) -> PublishReport:
        """Send an update whose bytes the caller writes: ``fill(index, buffer)`` writes bucket ``index`` of
        ``manifest`` (dense) into ``buffer`` (a uint8 torch tensor of its size) and returns its checksums, in
        ``manifest.by_bucket()`` order. Over this sender's transport; raises UpdateFailed as ``publish`` does.
        A relay's path for what it holds (a joining engine, a peer relay)."""
        t_start = time.perf_counter()
        self._starting(manifest.version)
        self._agreed_dtype()
        manifest = replace(manifest, publisher=self.name, transport=self.transport, delta=None, keep_base=False)
        plane = self._plane()

        def produce(index: int, size: int) -> tuple[OutgoingBucket, tuple[int, ...]]:
            buffer = plane.allocate(index, size)
            sums = fill(index, buffer)
            return plane.seal(index, buffer), sums

        return self._stream(manifest, plane, produce, t_start)

    @contextmanager
    def _only(self, endpoints: Collection[str]) -> Iterator[None]:
        """Send to the engines at ``endpoints`` alone until the block ends (a dense resend to the engines that
        refused a delta); the others' sockets stay open, and what they send meanwhile is dropped."""
        everyone = self._peers
        self._peers = [p for p in everyone if p.endpoint in endpoints]
        try:
            yield
        finally:
            self._peers = everyone

    def _agreed_dtype(self) -> str:
        """Connect to every engine (once) and return the one dtype they serve; TransportError when they
        differ or one of them lacks this publisher's transport."""
        self._hello()
        dtypes = {p.info.dtype for p in self._peers if p.info}
        if len(dtypes) != 1:
            raise TransportError(f"engines serve different dtypes {sorted(dtypes)}; publish to each group separately")
        lacking = [p.endpoint for p in self._peers if p.info and self.transport not in p.info.transports]
        if lacking:
            raise TransportError(f"transport {self.transport!r} is not offered by {lacking} (they offer "
                                 f"{sorted({t for p in self._peers if p.info for t in p.info.transports})})")
        return dtypes.pop()

    def engines(self) -> list[wire.EngineInfo]:
        """What every engine answered on connecting (connects first if needed)."""
        self._hello()
        return [p.info for p in self._peers if p.info is not None]

    def _stream(self, manifest: wire.Manifest, plane: SendPlane,
                produce: Callable[[int, int], tuple[OutgoingBucket, tuple[int, ...]]], t_start: float) -> PublishReport:
        """Begin -> buckets in order (``produce(index, size)`` makes each one while the previous is on the
        wire; never more in flight per engine than it granted) -> End -> every engine's ack; UpdateFailed
        unless every engine applied it."""
        report = self._stream_report(manifest, plane, produce, t_start)
        self._raise_failed(report)
        return report

    def _stream_report(self, manifest: wire.Manifest, plane: SendPlane,
                       produce: Callable[[int, int], tuple[OutgoingBucket, tuple[int, ...]]], t_start: float) -> PublishReport:
        """``_stream`` without raising: the report, failed engines included. ``produce`` is given each full
        bucket's size; a delta update's producer returns its wire bucket (``OutgoingBucket.delta``: its table
        of patches, sent in the header; the checksums, of its payloads)."""
        version = manifest.version
        sizes = manifest.bucket_sizes
        offers = plane.offers([p.endpoint for p in self._peers])
        for peer, offer in zip(self._peers, offers, strict=False):
            self._send(peer, offer)
        plane.connect()
        # what the engines sent after an earlier send was abandoned (their late credits for a version that is
        # now sent again) is read and forgotten here: a credit counted for this Begin would let a sharded update's
        # ranks send before the engines know of it
        self._pump(0)
        self._begun = version
        for peer in self._peers:
            peer.credit, peer.ack, peer.released = 0, None, set()
            self._send(peer, wire.Begin(manifest))
            peer.last_heard = time.monotonic()
        seconds = {"pack": 0.0}
        deadlines = self.config.deadlines
        token = secrets.token_hex(8)  # names this send's segment bytes in the receivers' host verdicts
        packed: dict[int, tuple[int, ...]] = {}  # each bucket's checksums, to check the engines' no-ops
        try:
            self._wait(lambda p: p.credit > 0 or p.ack is not None, deadlines.manifest_s, "manifest", self._peers)
            for index, size in enumerate(sizes):
                t0 = time.perf_counter()
                plane.reusable(self._released())
                out, sums = produce(index, size)
                seconds["pack"] += time.perf_counter() - t0
                packed[index] = sums if out.delta is None else out.delta.result_sums()
                header = wire.BucketHeader(version=version, index=index, checksums=sums, segment=out.segment,
                                           token=token if out.segment else "", delta=out.delta)
                active = [p for p in self._peers if p.ack is None]
                self._wait(lambda p: p.credit > 0 or p.ack is not None, deadlines.bucket_s, f"bucket {index}", active)
                for rank, peer in enumerate(self._peers):
                    if peer in active and peer.ack is None:
                        peer.credit -= 1
                        plane.sent(index, self._send(peer, header, out.frames))
                        plane.push(version, out, rank)
            for peer in self._peers:
                if peer.ack is None:
                    self._send(peer, wire.End(version=version))
            seconds["transfer"] = time.perf_counter() - t_start - seconds["pack"]
            t_end = time.perf_counter()
            self._await_acks(deadlines.ack_s, deadlines.heartbeat_s)
            seconds["apply"] = time.perf_counter() - t_end
            self._check_noops(manifest, packed)
        except (TransportError, WireError) as exc:  # DeadlineExceeded is a TransportError
            for peer in self._peers:
                if peer.ack is None:
                    self._tell(peer, wire.Abort(version=version, reason=str(exc)))
                    peer.ack = wire.Ack(version=version, ok=False, reason=describe(exc), kind=kind_of(exc).value)
        finally:
            plane.release(failed=any(p.ack is None or not p.ack.ok for p in self._peers))
        seconds["total"] = time.perf_counter() - t_start
        return replace(self._report(manifest, seconds), held_bytes=plane.held_bytes)

    @staticmethod
    def _raise_failed(report: PublishReport) -> None:
        """UpdateFailed naming every engine of ``report`` that did not apply its version."""
        failed = {e.endpoint: e.reason for e in report.engines if not e.ok}
        if failed:
            detail = "; ".join(f"{ep}: {why}" for ep, why in failed.items())
            kinds = {e.endpoint: e.kind or FailureKind.OTHER for e in report.engines if not e.ok}
            raise UpdateFailed(f"version {report.version} was not applied by {len(failed)} of {len(report.engines)} engine(s): "
                               f"{detail}", failed, kinds)

    def _check_noops(self, manifest: wire.Manifest, packed: dict[int, tuple[int, ...]]) -> None:
        """An engine that answered "already served" sent the checksums it recorded for that version: where
        they differ from what this publisher packed, the version number was reused for other weights, and
        that engine's answer becomes a VersionConflict (it keeps serving its own; bridge/served.py)."""
        ours = published_sums(manifest, packed)
        for peer in self._peers:
            ack = peer.ack
            if ack is None or not ack.ok or "served_checksums" not in ack.report:
                continue
            report = {k: v for k, v in ack.report.items() if k != "served_checksums"}
            names = differing(manifest, ours, ack.report["served_checksums"])
            if names:
                reason = conflict_reason(manifest.version, names, len(manifest.tensors))
                logger.error("%s: %s", peer.endpoint, reason)
                self._tell(peer, wire.Abort(version=ack.version, reason=reason))  # the engine records it
                peer.ack = wire.Ack(version=ack.version, ok=False, reason=reason, kind=FailureKind.CONFLICT.value,
                                    report={**report, "noop": False, "conflicting_tensors": names})
            else:
                if names is None:
                    logger.warning("%s: its checksums of version %s cannot be compared with this publisher's; "
                                   "no-op taken on the version number", peer.endpoint, manifest.version)
                peer.ack = replace(ack, report={**report, "content_checked": names is not None})

    def _released(self) -> set[int]:
        """Buckets of this update no engine will read again: released by every engine still in it (one
        that answered ok already, a no-op, reads nothing more; one that failed may still be reading)."""
        sets = [p.released for p in self._peers if p.ack is None or not p.ack.ok]
        return set.intersection(*sets) if sets else set()

    def _await_acks(self, ack_s: float, heartbeat_s: float) -> None:
        end = time.monotonic() + ack_s
        while any(p.ack is None for p in self._peers):
            now = time.monotonic()
            if now > end:
                raise DeadlineExceeded(f"apply: no acknowledgement within {ack_s}s")
            for peer in self._peers:
                if peer.ack is None and now - peer.last_heard > max(3 * heartbeat_s, 5.0):
                    peer.ack = wire.Ack(version=0, ok=False, reason=f"engine went silent for {now - peer.last_heard:.1f}s (no heartbeat): presumed dead",
                                        kind=FailureKind.TIMEOUT.value)
            self._pump(0.05)

    def _report(self, manifest: wire.Manifest, seconds: dict[str, float]) -> PublishReport:
        engines = []
        for peer in self._peers:
            ack = peer.ack or wire.Ack(version=manifest.version, ok=False, reason="no acknowledgement", kind=FailureKind.TIMEOUT.value)
            eng = dict(ack.report)
            verified = bool(ack.ok and not eng.get("stale_tensors") and not eng.get("identity_violations"))
            engines.append(EngineReport(
                endpoint=peer.endpoint, version=manifest.version, ok=ack.ok, reason=ack.reason,
                bytes=manifest.total_bytes, seconds={**seconds, **{f"engine_{k}": v for k, v in eng.get("seconds", {}).items()}},
                verified=verified, noop=bool(eng.get("noop")), engine=eng,
                kind=None if ack.ok else (parse_kind(ack.kind) or FailureKind.OTHER),
            ))
        return PublishReport(manifest.version, manifest.total_bytes, seconds, tuple(engines))
