"""The inference-side endpoint: a ZMQ ROUTER that takes updates from publishers, stages and verifies
every bucket in shared memory, and hands complete updates to the engine gate.

One thread owns the socket (ZMQ sockets are not thread-safe); applying runs on a second thread so
heartbeats keep flowing while the engine loads.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from bridge import wire
from bridge.config import BridgeConfig
from bridge.errors import BridgeError, ChecksumError, NonFiniteError, WireError
from bridge.finite import all_finite
from bridge.host_verdicts import verdict_key, verify_once
from bridge.served import ServedContent, bucket_sums
from bridge.shm import AttachCache, Segment, SegmentPool, sweep_orphans
from inference_side.collective_inbox import CollectiveInbox, PendingRecv

logger = logging.getLogger(__name__)
COLLECTIVE = ("gloo", "nccl")
REFUSED_KEEP = 1024  # publishers remembered (the most recent): a refused update's late buckets, a checked no-op


@dataclass
class StagedBucket:
    index: int
    segment: Segment
    specs: list[wire.TensorSpec]
    checksums: tuple[int, ...] = ()  # as the bucket's header gave them (a relay forwards them)


@dataclass(frozen=True)
class ApplyResult:
    ok: bool
    reason: str = ""
    report: dict[str, Any] = field(default_factory=dict)


class EngineGate(Protocol):
    def info(self) -> wire.EngineInfo: ...
    def validate(self, manifest: wire.Manifest) -> str | None:
        """Raise on a manifest the engine cannot take; return a no-op reason if already served."""
    def apply(self, manifest: wire.Manifest, buckets: list[StagedBucket], timings: dict[str, float]) -> ApplyResult: ...


@dataclass
class _Session:
    identity: bytes
    manifest: wire.Manifest
    started: float
    last_seen: float
    buckets: dict[int, StagedBucket] = field(default_factory=dict)
    pending: Future[ApplyResult] | None = None
    apply_started: float = 0.0
    overdue: bool = False  # the publisher was told the apply deadline passed; no second ack
    last_ping: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    bytes_in: int = 0
    # streaming mode (sync.mode=streaming): buckets are loaded as they arrive, in order, on the apply
    # thread; a bucket's credit goes back once it is loaded, so at most ``depth`` are held here
    loads: list[tuple[int, Future[str]]] = field(default_factory=list)
    loaded: set[int] = field(default_factory=set)
    on_abort: Callable[[str], None] | None = None  # set while a streaming load is open in the engine
    lent: list[Segment] = field(default_factory=list)  # loaded receive segments a worker may still map
    spare: list[Segment] = field(default_factory=list)  # receive segments free for the next bucket
    ended: wire.End | None = None  # End arrived while collective receives were still in flight
    checksums: dict[int, tuple[int, ...]] = field(default_factory=dict)  # headers of buckets still arriving
    unreleased: dict[int, str] = field(default_factory=dict)  # loaded shm buckets -> segment, a worker may hold
    verified_by_peer: int = 0  # shm buckets another receiver on this host verified (see host_verdicts)
    sums: dict[str, int] = field(default_factory=dict)  # tensor -> checksum its bucket's header carried

    def close(self, reason: str = "update abandoned", pool: SegmentPool | None = None) -> None:
        """End the session; with ``pool``, receive segments no worker can still map go back to it."""
        idle = self.on_abort is None and all(f.done() for _, f in self.loads) and (self.pending is None or self.pending.done())
        for seg in [b.segment for b in self.buckets.values()] + self.lent:
            if pool is not None and idle and seg.owner:
                pool.give(seg)
            else:
                seg.close()
        for seg in self.spare:  # not mapped by any worker (see SyncReceiver._stream_segment)
            pool.give(seg) if pool is not None else seg.close()
        self.buckets.clear()
        self.lent.clear()
        self.spare.clear()
        abort, self.on_abort = self.on_abort, None
        if abort is not None:
            abort(reason)


def verify_bucket(view: memoryview, specs: list[wire.TensorSpec], checksums: tuple[int, ...], nonfinite: str,
                  checksum: str = "crc32") -> None:
    """Checksums (algorithm ``checksum``; ``none``: not checked) of every tensor in a bucket and, under the
    reject policy, finiteness of floats. Both read a float tensor in one pass, chunk by chunk; a checksum
    mismatch is reported before a non-finite value (corruption on the way explains both)."""
    from bridge.checksums import function, running

    crc, fresh = (None, None) if checksum == "none" else (function(checksum), running(checksum))
    if len(checksums) != len(specs):
        raise WireError(f"bucket {specs[0].bucket if specs else '?'}: {len(checksums)} checksums for {len(specs)} tensors")
    for spec, expected in zip(sorted(specs, key=lambda s: s.offset), _by_offset(specs, checksums), strict=True):
        floats = nonfinite == "reject" and spec.dtype in wire.FLOAT_DTYPES and spec.nbytes > 0
        finite = True
        if crc is None or fresh is None:
            got = expected
            finite = not floats or all_finite(view, spec.dtype, spec.offset, spec.nbytes)
        elif floats and spec.offset + spec.nbytes <= view.nbytes:  # (a truncated one fails its checksum below)
            hasher = fresh()
            finite = all_finite(view, spec.dtype, spec.offset, spec.nbytes, visit=hasher.update)
            got = hasher.intdigest()
        else:
            got = crc(view[spec.offset : spec.offset + spec.nbytes])
        if got != expected:
            raise ChecksumError(f"tensor {spec.name}: checksum mismatch (got {got:#010x}, manifest says {expected:#010x})")
        if not finite:
            raise NonFiniteError(f"tensor {spec.name}: holds NaN or Inf (policy sync.nonfinite=reject)")


def _by_offset(specs: list[wire.TensorSpec], checksums: tuple[int, ...]) -> list[int]:
    order = sorted(range(len(specs)), key=lambda i: specs[i].offset)
    return [checksums[i] for i in order]


def _remember(seen: dict[bytes, int], identity: bytes, version: int) -> None:
    """Note ``version`` for publisher ``identity``, keeping the most recent REFUSED_KEEP publishers."""
    seen.pop(identity, None)
    seen[identity] = version
    while len(seen) > REFUSED_KEEP:  # a long run meets many publishers: keep the latest
        seen.pop(next(iter(seen)))


class SyncReceiver:
    def __init__(self, gate: EngineGate, config: BridgeConfig, on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.gate = gate
        self.config = config
        self.on_event = on_event or (lambda kind, data: None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wb-apply")
        self._sessions: dict[bytes, _Session] = {}
        self._refused: dict[bytes, int] = {}  # publisher -> version refused mid-transfer (its in-flight buckets are dropped)
        self._noops: dict[bytes, int] = {}  # publisher -> version answered "already served" with its checksums
        self.endpoint = ""  # tcp://host:port
        self.ipc_endpoint = ""  # ipc://<private dir>/receiver.sock when transport.listen_ipc
        self._ipc_dir = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._pool = SegmentPool("recv")  # receive segments reused across updates (ZMQ, gloo/NCCL)
        self._attached = AttachCache()  # publishers' shm segments, mapped once (transport shm)
        self._pruned = 0.0
        self._served = ServedContent()  # checksums of what the engine serves (answers a re-sent version)
        self._inbox = CollectiveInbox(config.deadlines.connect_s, config.deadlines.bucket_s, config.transport.bind_host)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> str:
        sweep_orphans()  # segments a SIGKILLed predecessor (or any dead publisher) left in /dev/shm
        self._thread = threading.Thread(target=self._run, name="wb-receiver", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self.endpoint

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._executor.shutdown(wait=False)  # the loop cancelled its loads; an engine's abort still runs

    def cores(self) -> list[int]:
        """The cores the receiver's thread may run on."""
        thread = self._thread.native_id if self._thread is not None else None
        return sorted(os.sched_getaffinity(thread or 0))

    def summary(self) -> list[dict[str, Any]]:
        """Open update sessions: version, buckets staged so far, bytes in, whether applying."""
        return [{"version": s.manifest.version, "staged": len(s.buckets), "buckets": len(s.manifest.bucket_sizes),
                 "bytes": s.bytes_in, "applying": s.pending is not None}
                for s in list(self._sessions.values())]

    # ---- streaming mode ------------------------------------------------------------------------
    def _streaming(self) -> bool:
        return self.config.sync.mode == "streaming" and hasattr(self.gate, "stream_begin")

    def _stream_begin(self, session: _Session) -> None:
        gate: Any = self.gate
        manifest = session.manifest
        self._executor.submit(gate.stream_begin, manifest)

        def abort(reason: str) -> None:
            self._executor.submit(gate.stream_abort, manifest, reason)

        session.on_abort = abort

    def _stream_load(self, session: _Session, bucket: StagedBucket) -> None:
        gate: Any = self.gate
        session.loads.append((bucket.index, self._executor.submit(gate.stream_load, session.manifest, bucket)))

    def _stream_segment(self, session: _Session, size: int) -> Segment:
        """A receive segment for the next bucket: a spare one that no worker maps any more (its pages are
        already faulted in), or a new one."""
        held: frozenset[str] = getattr(self.gate, "stream_held", frozenset)()
        for seg in [s for s in session.lent if s.name not in held]:
            session.lent.remove(seg)
            session.spare.append(seg)
        fits = [s for s in session.spare if s.size >= size]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            session.spare.remove(seg)
            return seg
        return self._pool.take(size)

    def _stream_progress(self, sock: Any, session: _Session) -> bool:
        """Credit back every bucket loaded so far, in order, and free its staging; on a failed load,
        refuse the update. True when the session was ended."""
        while session.loads and session.loads[0][1].done():
            index, fut = session.loads.pop(0)
            try:
                error = fut.result()
            except BaseException as exc:  # noqa: BLE001 - report whatever broke the load
                error = f"{type(exc).__name__}: {exc}"
            if error:
                self._fail(sock, session.identity, session.manifest.version, error)
                return True
            bucket = session.buckets.pop(index, None)
            if bucket is not None:
                if bucket.segment.owner:
                    session.lent.append(bucket.segment)
                else:  # the publisher's segment: released to it once no worker holds it
                    session.unreleased[index] = bucket.segment.name
                    bucket.segment.close()
            session.loaded.add(index)
            if session.pending is None:
                self._send(sock, session.identity, wire.Credit(version=session.manifest.version, n=1,
                                                               released=self._released(session)))
        return False

    def _released(self, session: _Session) -> tuple[int, ...]:
        """Loaded shm buckets whose segment no worker maps any more, not yet told to the publisher."""
        held: frozenset[str] = getattr(self.gate, "stream_held", frozenset)()
        released = tuple(i for i, name in session.unreleased.items() if name not in held)
        for index in released:
            del session.unreleased[index]
        return released

    # ---- loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        ctx: Any = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        tcfg = self.config.transport
        if tcfg.curve_server_secret:
            sock.curve_server = True
            sock.curve_secretkey = tcfg.curve_server_secret.encode()
            sock.curve_publickey = tcfg.curve_server_public.encode()
        try:
            port = sock.bind_to_random_port(f"tcp://{tcfg.bind_host}")
        except zmq.ZMQError as exc:
            self._error = BridgeError(f"cannot bind receiver on {tcfg.bind_host}: {exc}")
            self._ready.set()
            return
        self.endpoint = f"tcp://{tcfg.bind_host}:{port}"
        if tcfg.listen_ipc:
            self._ipc_dir = tempfile.mkdtemp(prefix="wb-ipc-")  # 0700: only this user's processes connect
            self.ipc_endpoint = f"ipc://{self._ipc_dir}/receiver.sock"
            sock.bind(self.ipc_endpoint)
        self._ready.set()
        logger.info("receiver listening on %s %s", self.endpoint, self.ipc_endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                busy = self._inbox.busy or any(s.loads or s.pending for s in self._sessions.values())
                if poller.poll(1 if self._inbox.busy else 2 if busy else 50):
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(sock, frames)
                done = self._inbox.poll()
                for recv in done:
                    self._received(sock, recv)
                for identity in {recv.identity for recv in done}:
                    self._ended(sock, identity)
                self._tick(sock)
        finally:
            for session in self._sessions.values():
                for _, load in session.loads:
                    load.cancel()
                if session.pending is not None:
                    session.pending.cancel()
                session.close("the receiver is stopping")  # a streaming load open in the engine is aborted
            self._inbox.close()
            self._pool.close()
            self._attached.close()
            sock.close(0)
            if self._ipc_dir:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _send(self, sock: Any, identity: bytes, msg: wire.Message) -> None:
        sock.send_multipart([identity, wire.encode(msg)])

    def _fail(self, sock: Any, identity: bytes, version: int, reason: str) -> None:
        logger.warning("update v%s from %r refused: %s", version, identity, reason)
        session = self._sessions.pop(identity, None)
        if session is not None:
            session.close(reason)
            _remember(self._refused, identity, session.manifest.version)
        self._send(sock, identity, wire.Ack(version=version, ok=False, reason=reason))
        self.on_event("refused", {"version": version, "reason": reason})

    def _handle(self, sock: Any, frames: list[Any]) -> None:
        identity = bytes(frames[0].buffer)
        if len(frames) < 2:
            return
        scfg = self.config.sync
        try:
            msg = wire.decode(frames[1].buffer, max_bytes=scfg.max_header_bytes, max_tensors=scfg.max_tensors)
        except WireError as exc:
            session = self._sessions.get(identity)
            self._fail(sock, identity, session.manifest.version if session else 0, f"{type(exc).__name__}: {exc}")
            return
        session = self._sessions.get(identity)
        if session is not None:
            session.last_seen = time.monotonic()
        if isinstance(msg, wire.Hello):
            if msg.protocol != wire.PROTOCOL_VERSION:
                self._fail(sock, identity, 0, f"unknown protocol version {msg.protocol} (this receiver speaks {wire.PROTOCOL_VERSION})")
                return
            self._send(sock, identity, self.gate.info())
        elif isinstance(msg, wire.Begin):
            self._begin(sock, identity, msg.manifest)
        elif isinstance(msg, wire.LinkOffer):
            try:
                self._inbox.offer(identity, msg)
            except BridgeError as exc:
                self._fail(sock, identity, 0, f"{type(exc).__name__}: {exc}")
        elif isinstance(msg, wire.BucketHeader):
            self._bucket(sock, identity, msg, frames[2:])
        elif isinstance(msg, wire.End):
            self._end(sock, identity, msg)
        elif isinstance(msg, wire.Abort):
            if session is not None and session.pending is None:
                self._sessions.pop(identity).close()
                self.on_event("aborted", {"version": msg.version, "reason": msg.reason})
            elif session is None and self._noops.get(identity) == msg.version:
                # the publisher found that the version answered "already served" holds other weights
                del self._noops[identity]
                logger.warning("version %s from %r: %s", msg.version, identity, msg.reason)
                self.on_event("conflict", {"version": msg.version, "reason": msg.reason})
        else:
            self._fail(sock, identity, 0, f"unexpected message {msg.type!r} from a publisher")

    def _late(self, session: _Session | None, identity: bytes, version: int, what: str) -> bool:
        """A bucket or End the publisher sent before it heard this update was refused: drop it quietly,
        so the refusal it already has (the cause) is the only answer."""
        if session is None and self._refused.get(identity) == version:
            logger.debug("dropping %s of refused update v%s from %r", what, version, identity)
            return True
        return False

    def _begin(self, sock: Any, identity: bytes, manifest: wire.Manifest) -> None:
        self._refused.pop(identity, None)
        old = self._sessions.pop(identity, None)
        if old is not None:
            old.close()
        try:
            noop = self.gate.validate(manifest)
        except BridgeError as exc:
            self._fail(sock, identity, manifest.version, f"{type(exc).__name__}: {exc}")
            return
        if noop:
            report: dict[str, Any] = {"noop": True}
            served = self._served.lookup(manifest)
            if served is not None:  # the publisher checks its own sums against these (bridge/served.py)
                report["served_checksums"] = served
                _remember(self._noops, identity, manifest.version)
            self._send(sock, identity, wire.Ack(version=manifest.version, ok=True, reason=noop, report=report))
            return
        if manifest.checksum == "none" and self.config.sync.verify_checksums:
            self._fail(sock, identity, manifest.version, "WireError: the publisher sends no checksums (its sync.checksum is "
                       "none) and this engine verifies them (sync.verify_checksums: true)")
            return
        if manifest.transport in COLLECTIVE:
            if not self._inbox.has_link(identity):
                self._fail(sock, identity, manifest.version, f"TransportError: transport {manifest.transport} needs a collective "
                           "link, and this publisher offered none (or it was dropped after a failure)")
                return
        now = time.monotonic()
        # keep at most one update's worth between updates (nothing with sync.keep_receive_buffers: false)
        self._pool.trim(sum(manifest.bucket_sizes) if self.config.sync.keep_receive_buffers else 0)
        session = self._sessions[identity] = _Session(identity, manifest, started=now, last_seen=now)
        if self._streaming():
            self._stream_begin(session)
        self._send(sock, identity, wire.Credit(version=manifest.version, n=self.config.transport.depth))

    def _bucket(self, sock: Any, identity: bytes, header: wire.BucketHeader, payload: list[Any]) -> None:
        session = self._sessions.get(identity)
        if self._late(session, identity, header.version, f"bucket {header.index}"):
            return
        if session is None:
            self._fail(sock, identity, header.version, f"bucket {header.index} arrived outside an update")
            return
        m = session.manifest
        if header.version != m.version or header.index >= len(m.bucket_sizes) or header.index in session.buckets:
            self._fail(sock, identity, m.version, f"unexpected bucket {header.index} of version {header.version}")
            return
        size = m.bucket_sizes[header.index]
        t0 = time.perf_counter()
        try:
            if header.segment:
                if m.transport != "shm":
                    raise WireError("bucket names a shared-memory segment but the manifest's transport is not shm")
                segment = self._attached.attach(header.segment, size)
            elif m.transport in COLLECTIVE:
                if payload:
                    raise WireError(f"bucket {header.index}: bytes arrived as a ZMQ frame, but the transport is {m.transport}")
                segment = self._stream_segment(session, size) if session.on_abort is not None else self._pool.take(size)
                try:
                    self._inbox.post(identity, m.version, header.index, segment, size)
                except BridgeError:
                    segment.close()
                    raise
                session.timings["receive"] = session.timings.get("receive", 0.0) + time.perf_counter() - t0
                session.checksums[header.index] = header.checksums
                return
            else:
                if len(payload) != 1 or len(payload[0].buffer) != size:
                    got = len(payload[0].buffer) if payload else 0
                    raise WireError(f"bucket {header.index}: {got} bytes arrived, manifest says {size} (truncated?)")
                segment = self._stream_segment(session, size) if session.on_abort is not None else self._pool.take(size)
                segment.buffer[:size] = payload[0].buffer
        except BridgeError as exc:
            self._fail(sock, identity, m.version, f"{type(exc).__name__}: {exc}")
            return
        self._staged(sock, session, header.index, segment, header.checksums, t0, header.token if header.segment else "")

    def _staged(self, sock: Any, session: _Session, index: int, segment: Segment, checksums: tuple[int, ...], t0: float,
                token: str = "") -> None:
        """Bucket ``index`` lies complete in ``segment``: verify it (once per host for a publisher's shm
        segment sent under ``token``), then load it (streaming) or credit it back."""
        m = session.manifest
        specs = m.by_bucket()[index]
        session.buckets[index] = StagedBucket(index, segment, specs, checksums)
        session.sums.update(bucket_sums(specs, checksums))
        session.bytes_in += m.bucket_sizes[index]
        try:
            scfg = self.config.sync
            if scfg.verify_checksums or scfg.nonfinite == "reject":
                algorithm = m.checksum if scfg.verify_checksums else "none"

                def check() -> None:
                    verify_bucket(segment.buffer, specs, checksums, scfg.nonfinite, algorithm)

                if token and scfg.verify_once_per_host:
                    layout = tuple((s.name, s.dtype, s.offset, s.nbytes) for s in specs)
                    key = verdict_key(token, segment.name, m.publisher, m.version, index, layout, algorithm, checksums,
                                      scfg.nonfinite)
                    if not verify_once(segment.name, key, check, self.config.deadlines.bucket_s):
                        session.verified_by_peer += 1
                else:
                    check()
        except BridgeError as exc:
            self._fail(sock, session.identity, m.version, f"{type(exc).__name__}: {exc}")
            return
        session.timings["receive"] = session.timings.get("receive", 0.0) + time.perf_counter() - t0
        if session.on_abort is not None:
            self._stream_load(session, session.buckets[index])
            return
        self._send(sock, session.identity, wire.Credit(version=m.version, n=1))

    # ---- collective data plane -----------------------------------------------------------------
    def _received(self, sock: Any, recv: PendingRecv) -> None:
        """A collective receive finished: stage its bucket, or drop it when its update is gone."""
        session = self._sessions.get(recv.identity)
        if session is None or session.manifest.version != recv.version:
            recv.segment.close()
            return
        if recv.error:
            recv.segment.close()
            self._fail(sock, recv.identity, recv.version, f"TransportError: {recv.error}")
            return
        self._staged(sock, session, recv.index, recv.segment, session.checksums.pop(recv.index, ()), time.perf_counter())

    def _ended(self, sock: Any, identity: bytes) -> None:
        """Finish an update whose End arrived before its last collective receive landed."""
        session = self._sessions.get(identity)
        if session is not None and session.ended is not None and session.pending is None and not self._inbox.pending_for(identity):
            self._end(sock, identity, session.ended)

    def _end(self, sock: Any, identity: bytes, msg: wire.End) -> None:
        session = self._sessions.get(identity)
        if self._late(session, identity, msg.version, "end"):
            return
        if session is None or msg.version != session.manifest.version:
            self._fail(sock, identity, msg.version, "end of an update that was never begun")
            return
        if self._inbox.pending_for(identity):
            session.ended = msg  # finished once the last receive lands (see _ended)
            return
        session.ended = None
        missing = sorted(set(range(len(session.manifest.bucket_sizes))) - set(session.buckets) - session.loaded)
        if missing:
            self._fail(sock, identity, msg.version, f"update ended with buckets {missing[:10]} missing")
            return
        session.timings["transfer"] = time.monotonic() - session.started
        buckets = [session.buckets[i] for i in sorted(session.buckets)]
        session.apply_started = time.monotonic()
        if session.on_abort is not None:
            session.on_abort = None  # from here on the finish (or its failure) ends the engine's load
            session.pending = self._executor.submit(self.gate.stream_finish, session.manifest, session.timings)  # type: ignore[attr-defined]
            return
        session.pending = self._executor.submit(self.gate.apply, session.manifest, buckets, session.timings)

    def _tick(self, sock: Any) -> None:
        now = time.monotonic()
        if len(self._attached) and now - self._pruned >= 1.0:
            self._pruned = now
            self._attached.prune()
        deadlines = self.config.deadlines
        for identity, session in list(self._sessions.items()):
            version = session.manifest.version
            if session.loads and self._stream_progress(sock, session):
                continue
            if session.pending is not None:
                if session.pending.done():
                    self._sessions.pop(identity)
                    try:
                        result = session.pending.result()
                    except BaseException as exc:  # noqa: BLE001 - report whatever broke the apply
                        result = ApplyResult(False, f"{type(exc).__name__}: {exc}")
                    session.close(pool=self._pool if result.ok else None)  # a failed update frees its staging
                    if result.ok and not result.report.get("noop"):
                        m = session.manifest
                        self._served.record(m.checksum, session.sums, (t.name for t in m.tensors))
                    report = dict(result.report)
                    report.setdefault("bytes", session.bytes_in)
                    report.setdefault("buckets_verified_by_peer", session.verified_by_peer)
                    if not session.overdue:
                        self._send(sock, identity, wire.Ack(version=version, ok=result.ok, reason=result.reason, report=report))
                elif session.overdue:
                    continue
                elif now - session.apply_started > deadlines.apply_s + deadlines.verify_s:
                    # A running apply cannot be interrupted safely; the publisher is released with a clear
                    # error and the engine finishes or fails the update on its own (see its records).
                    session.overdue = True
                    reason = (f"DeadlineExceeded: apply of version {version} still running after "
                              f"{deadlines.apply_s + deadlines.verify_s:.1f}s (deadlines.apply_s + deadlines.verify_s)")
                    logger.warning("%s", reason)
                    self._send(sock, identity, wire.Ack(version=version, ok=False, reason=reason))
                    self.on_event("timeout", {"version": version, "reason": reason})
                elif now - session.last_ping >= deadlines.heartbeat_s:
                    session.last_ping = now
                    self._send(sock, identity, wire.Heartbeat(version=version, phase="apply"))
            elif now - session.last_seen > deadlines.bucket_s:
                logger.warning("update v%s from %r timed out waiting for data", version, identity)
                self._sessions.pop(identity).close()
                self.on_event("timeout", {"version": version, "reason": f"no data for {deadlines.bucket_s}s"})
