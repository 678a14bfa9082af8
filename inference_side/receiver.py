"""The inference-side endpoint: a ZMQ ROUTER that takes updates from publishers, lands and verifies every
bucket in shared memory, and drives the engine behind it through the lifecycle of
inference_side/contract.py.

One thread owns the socket (ZMQ sockets are not thread-safe); the engine's calls run in order on a second
thread, so heartbeats keep flowing while the engine loads. Each transport's receiving end (a
``bridge.transports`` land plane) turns what arrived into a segment; the receiver never branches on the
transport.
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
from dataclasses import replace
from typing import Any

from bridge import wire
from bridge.config import BridgeConfig
from bridge.curve import ServerCurve, release_server, secure_server, server_curve
from bridge.errors import BridgeError, WireError, WrongBase
from bridge.host_verdicts import verdict_key, verify_once
from bridge.report import ApplyResult, FailureKind, LoadResult, describe, kind_of
from bridge.served import ServedContent, bucket_sums, served_scope
from bridge.shm import Segment, SegmentPool, sweep_orphans
from bridge.transports import land_plane
from bridge.transports.base import Landed, LandPlane
from bridge.vllm_shm import sweep_vllm_segments
from inference_side.contract import LOAD_RUN_MAX, EngineGate, StagedBucket
from inference_side.delta_base import BaseStore, rebuild
from inference_side.ranges import verify_ranges
from inference_side.session import LoadRun, Session, remember
from inference_side.verify import verify_bucket

logger = logging.getLogger(__name__)


StatusProvider = Callable[[float], tuple[dict[str, Any], list[dict[str, Any]]]]


class SyncReceiver:
    def __init__(self, gate: EngineGate, config: BridgeConfig, on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 port: int = 0, status: StatusProvider | None = None, bases: BaseStore | None = None) -> None:
        """A receiver for ``gate``; ``start`` binds ``transport.bind_host`` on ``port`` (0: any free port).
        ``status(since)`` answers an operator's ``StatusRequest`` (the engine's status dict and its sync
        records newer than ``since``); without it the answer is built from ``gate.info()``. ``bases``: a
        delta base the gate keeps itself (a relay's latest version); the receiver then only reads it (checks
        and rebuilds), else it keeps its own from the updates its engine applied (``sync.delta``: every one with
        ``true``; with ``auto`` every delta and every dense update its publisher keeps as its base, ``_keeps_base_of``)."""
        self.gate = gate
        self.port = port
        self.config = config
        self.on_event = on_event or (lambda kind, data: None)
        self.status = status
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wb-apply")
        self._sessions: dict[bytes, Session] = {}
        self._refused: dict[bytes, int] = {}  # publisher -> version refused mid-transfer (its in-flight buckets are dropped)
        self._noops: dict[bytes, int] = {}  # publisher -> version answered "already served" with its checksums
        self.endpoint = ""  # tcp://host:port
        self.ipc_endpoint = ""  # ipc://<private dir>/receiver.sock when transport.listen_ipc
        self._ipc_dir = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._pool = SegmentPool("recv")  # receive segments reused across updates (ZMQ, gloo/NCCL)
        self._served = ServedContent()  # checksums of what the engine serves (answers a re-sent version)
        self._planes: dict[str, LandPlane] = {}  # each transport's receiving end, made on first use
        self._curve: ServerCurve | None = None
        # delta updates: the version last applied, to rebuild full tensors from patches
        self.bases = bases if bases is not None else (BaseStore() if config.sync.delta is not False else None)
        self._keeps_bases = bases is None
        # the engine's calls that may reload the served version from ``bases`` (a delta loaded early: its finish,
        # its abort): no other delta is patched into the store until they are done
        self._restoring: list[Future[Any]] = []

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> str:
        """Bind and serve; ConfigError for CURVE keys that cannot be used, or an address other than loopback
        without them (bridge/curve.py)."""
        self._curve = server_curve(self.config.transport)
        sweep_orphans()  # segments a SIGKILLed predecessor (or any dead publisher) left in /dev/shm
        if self.config.serve.sweep_vllm_shm:
            sweep_vllm_segments()  # vLLM's own segments of engines that were killed
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

    # ---- the engine's lifecycle (inference_side/contract.py), on the apply thread ----------------
    def _plane(self, kind: str) -> LandPlane:
        plane = self._planes.get(kind)
        if plane is None:
            plane = self._planes[kind] = land_plane(kind, self.config)
        return plane

    def _open(self, session: Session) -> None:
        """Streaming, or a delta loaded early (``_loads_early``): open the update in the engine now; until it
        finishes, closing the session aborts it."""
        gate, manifest = self.gate, session.manifest
        if session.early:
            assert self.bases is not None
            self._executor.submit(gate.begin, manifest, self.bases.restore)
        else:
            self._executor.submit(gate.begin, manifest)

        def abort(reason: str) -> None:
            done = self._executor.submit(gate.abort, manifest, reason)
            if session.early:
                self._restoring.append(done)

        session.on_abort = abort

    def _apply_staged(self, manifest: wire.Manifest, buckets: list[StagedBucket], timings: dict[str, float]) -> ApplyResult:
        """Staged: every bucket arrived and was verified; now the same calls a streaming update makes."""
        self.gate.begin(manifest)
        for i in range(0, len(buckets), LOAD_RUN_MAX):
            if self.gate.load_many(manifest, buckets[i:i + LOAD_RUN_MAX]).error:
                break  # finish reports the failure
        return self.gate.finish(manifest, timings)

    def _load(self, session: Session, bucket: StagedBucket) -> None:
        """Streaming, or a delta loaded early: ``bucket`` is verified; it joins the run of buckets the apply
        thread has not started yet, or opens the next run."""
        if session.loads and session.loads[-1][0].join(bucket, LOAD_RUN_MAX):
            return
        run = LoadRun([bucket])
        session.loads.append((run, self._executor.submit(self._load_run, session.manifest, run)))

    def _load_run(self, manifest: wire.Manifest, run: LoadRun) -> LoadResult:
        """On the apply thread: every bucket of ``run``, in one ``load_many``."""
        return self.gate.load_many(manifest, run.start())

    def _loads_early(self, session: Session) -> bool:
        """A delta this receiver patches in place in its base store goes to the engine bucket by bucket as each is
        verified, when the engine can put the served version back from that store should the update fail later
        (``EngineGate.restores``): the store, rolled back, is that version. Staged, the engine's load then
        overlaps the transfer and the patching; staged or streaming, the update stays "old or new"."""
        m = session.manifest
        return (self.config.sync.delta_early_load and m.delta is not None and m.adapter is None
                and self._keeps_bases and self.bases is not None and self.gate.restores
                and self.bases.can_patch(m, session.identity))

    def _progress(self, sock: Any, session: Session) -> bool:
        """Streaming: credit back every bucket loaded so far, in order, and free its staging; on a failed
        load, refuse the update (a delta loaded early: its buckets stay staged, their credits went back when
        they were). True when the session was ended."""
        while session.loads and session.loads[0][1].done():
            run, fut = session.loads.pop(0)
            try:
                result = fut.result()
            except BaseException as exc:  # noqa: BLE001 - report whatever broke the load
                self._fail(sock, session.identity, session.manifest.version, kind_of(exc), describe(exc))
                return True
            session.held = result.held
            if result.error:
                self._fail(sock, session.identity, session.manifest.version, result.kind or FailureKind.OTHER, result.error)
                return True
            indices = [b.index for b in run.buckets]
            session.loaded.update(indices)
            if session.early:  # the base store's buckets (or receive segments it adopts once applied)
                continue
            for index in indices:
                bucket = session.buckets.pop(index, None)
                if bucket is not None:
                    if bucket.segment.owner:
                        session.lent.append(bucket.segment)
                    else:  # the publisher's segment: released to it once no worker holds it
                        session.unreleased[index] = bucket.segment.name
                        bucket.segment.close()
            if session.pending is None:
                self._send(sock, session.identity, wire.Credit(version=session.manifest.version, n=len(indices),
                                                               released=session.released()))
        return False

    # ---- loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        ctx: Any = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        tcfg = self.config.transport
        domain = ""
        try:
            domain = secure_server(sock, ctx, self._curve)
            if self.port:
                sock.bind(f"tcp://{tcfg.bind_host}:{self.port}")
                port = self.port
            else:
                port = sock.bind_to_random_port(f"tcp://{tcfg.bind_host}")
        except (zmq.ZMQError, BridgeError) as exc:
            self._error = exc if isinstance(exc, BridgeError) else BridgeError(f"cannot bind receiver on {tcfg.bind_host}: {exc}")
            self._ready.set()
            sock.close(0)
            release_server(ctx, domain)
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
                landing = any(p.busy for p in self._planes.values())
                busy = landing or any(s.loads or s.pending for s in self._sessions.values())
                if poller.poll(1 if landing else 2 if busy else 50):
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(sock, frames)
                for plane in list(self._planes.values()):
                    done = plane.poll()
                    for landed in done:
                        self._landed(sock, landed)
                    for identity in {landed.identity for landed in done}:
                        self._ended(sock, identity)
                    plane.tick()
                self._tick(sock)
        finally:
            for session in self._sessions.values():
                for _, load in session.loads:
                    load.cancel()
                if session.pending is not None:
                    session.pending.cancel()
                session.close("the receiver is stopping")  # a streaming load open in the engine is aborted
            for plane in self._planes.values():
                plane.close()
            self._pool.close()
            if self.bases is not None and self._keeps_bases:
                self.bases.clear()  # its segments (staged mode) are closed
            sock.close(0)
            release_server(ctx, domain)
            if self._ipc_dir:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _send(self, sock: Any, identity: bytes, msg: wire.Message) -> None:
        sock.send_multipart([identity, wire.encode(msg)])

    def _fail(self, sock: Any, identity: bytes, version: int, kind: FailureKind, reason: str, adapter: str = "") -> None:
        """Refuse ``identity``'s update: its session ends (the engine's open update aborted), the publisher
        gets a failed Ack with ``kind`` and ``reason``."""
        logger.warning("update v%s from %r refused: %s", version, identity, reason)
        session = self._sessions.pop(identity, None)
        if session is not None:
            session.close(reason)
            self._plane(session.manifest.transport).drop(identity)
            remember(self._refused, identity, session.manifest.version)
            adapter = adapter or (session.manifest.adapter.name if session.manifest.adapter else "")
        elif version > 0:  # a Begin refused before its session: its late buckets get no other answer
            remember(self._refused, identity, version)
        self._send(sock, identity, wire.Ack(version=version, ok=False, reason=reason, kind=kind.value))
        self.on_event("refused", {"version": version, "reason": reason, "kind": kind.value,
                                  **({"adapter": adapter} if adapter else {})})

    def _refuse(self, sock: Any, identity: bytes, version: int, exc: BaseException, adapter: str = "") -> None:
        self._fail(sock, identity, version, kind_of(exc), describe(exc), adapter)

    def _handle(self, sock: Any, frames: list[Any]) -> None:
        identity = bytes(frames[0].buffer)
        if len(frames) < 2:
            return
        scfg = self.config.sync
        try:
            msg = wire.decode(frames[1].buffer, max_bytes=scfg.max_header_bytes, max_tensors=scfg.max_tensors)
        except WireError as exc:
            session = self._sessions.get(identity)
            version = session.manifest.version if session else wire.claimed_version(frames[1].buffer, scfg.max_header_bytes)
            self._refuse(sock, identity, version, exc)
            return
        session = self._sessions.get(identity)
        if session is not None:
            session.last_seen = time.monotonic()
        if isinstance(msg, wire.Hello):
            if msg.protocol != wire.PROTOCOL_VERSION:
                self._fail(sock, identity, 0, FailureKind.WIRE,
                           f"unknown protocol version {msg.protocol} (this receiver speaks {wire.PROTOCOL_VERSION})")
                return
            self._send(sock, identity, self.gate.info())
        elif isinstance(msg, wire.Begin):
            self._begin(sock, identity, msg.manifest)
        elif isinstance(msg, wire.LinkOffer):
            try:
                self._plane(msg.backend).offer(identity, msg)
            except BridgeError as exc:
                self._refuse(sock, identity, 0, exc)
        elif isinstance(msg, wire.BucketHeader):
            self._bucket(sock, identity, msg, frames[2:])
        elif isinstance(msg, wire.RankBucket):
            self._piece(sock, identity, msg, frames[2:])
        elif isinstance(msg, wire.End):
            self._end(sock, identity, msg)
        elif isinstance(msg, wire.StatusRequest):
            sock.send_multipart([identity, self._status_reply(msg.since)])
        elif isinstance(msg, wire.Abort):
            if session is not None and session.pending is None:
                self._sessions.pop(identity).close(msg.reason or "aborted by the publisher")
                self._plane(session.manifest.transport).drop(identity)
                self.on_event("aborted", {"version": msg.version, "reason": msg.reason, "kind": FailureKind.ABORTED.value})
            elif session is None and self._noops.get(identity) == msg.version:
                # the publisher found that the version answered "already served" holds other weights
                del self._noops[identity]
                logger.warning("version %s from %r: %s", msg.version, identity, msg.reason)
                self.on_event("conflict", {"version": msg.version, "reason": msg.reason, "kind": FailureKind.CONFLICT.value})
            elif session is None and msg.version > 0:
                # a publisher whose send failed before its Begin (UpdateSender.abandon; also a retry of a version
                # refused before): whoever waits for that version (the weight_bridge backend's update_weights) stops
                self.on_event("aborted", {"version": msg.version, "reason": msg.reason, "kind": FailureKind.ABORTED.value})
        else:
            self._fail(sock, identity, 0, FailureKind.WIRE, f"unexpected message {msg.type!r} from a publisher")

    def _status_reply(self, since: float) -> bytes:
        """What the engine behind this receiver reports to an operator, encoded (on the socket thread: no
        engine call that could wait on an update)."""
        try:
            if self.status is not None:
                status, records = self.status(since)
                return wire.encode(wire.StatusReply(status=dict(status), records=list(records)))
            info = self.gate.info()
            return wire.encode(wire.StatusReply(status={
                "engine": f"{info.host}:{self.endpoint.rsplit(':', 1)[-1]}", "endpoint": self.endpoint,
                "version": info.version, "tp_size": info.tp_size, "dtype": info.dtype, "degraded": None,
                "sessions": self.summary()}))
        except Exception as exc:  # noqa: BLE001 - the asker learns why; the receiver keeps running
            logger.warning("status request failed: %s", describe(exc))
            return wire.encode(wire.StatusReply(status={"error": describe(exc)}))

    def _late(self, session: Session | None, identity: bytes, version: int, what: str) -> bool:
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
            self._refuse(sock, identity, manifest.version, exc, manifest.adapter.name if manifest.adapter else "")
            return
        if noop:
            report: dict[str, Any] = {"noop": True}
            served = self._served.lookup(manifest)
            if served is not None:  # the publisher checks its own sums against these (bridge/served.py)
                report["served_checksums"] = served
                remember(self._noops, identity, manifest.version)
            self._send(sock, identity, wire.Ack(version=manifest.version, ok=True, reason=noop, report=report))
            return
        if manifest.checksum == "none" and self.config.sync.verify_checksums:
            self._fail(sock, identity, manifest.version, FailureKind.WIRE, "WireError: the publisher sends no checksums (its "
                       "sync.checksum is none) and this engine verifies them (sync.verify_checksums: true)")
            return
        try:
            if manifest.delta is not None:
                if self.bases is None:
                    raise WrongBase("this engine keeps no base for delta updates (sync.delta: false)")
                self._restoring = [f for f in self._restoring if not f.done()]
                if self._restoring:
                    raise WrongBase(f"this engine is applying a delta as it arrives, or putting its served version back after "
                                    f"one that failed; the delta of version {manifest.version} applies to version "
                                    f"{manifest.delta.base_version}")
                self.bases.check(manifest)
            self._plane(manifest.transport).begin(identity)
            self._plane(manifest.transport).expect(identity, manifest)
        except BridgeError as exc:
            self._refuse(sock, identity, manifest.version, exc)
            return
        now = time.monotonic()
        # keep at most one update's worth between updates (nothing with sync.keep_receive_buffers: false)
        self._pool.trim(sum(manifest.bucket_sizes) if self.config.sync.keep_receive_buffers else 0)
        session = self._sessions[identity] = Session(identity, manifest, started=now, last_seen=now,
                                                     streaming=self.config.sync.mode == "streaming")
        session.early = self._loads_early(session)
        if session.streaming or session.early:
            self._open(session)
        self._send(sock, identity, wire.Credit(version=manifest.version, n=self.config.transport.depth))

    def _bucket(self, sock: Any, identity: bytes, header: wire.BucketHeader, payload: list[Any]) -> None:
        session = self._sessions.get(identity)
        if self._late(session, identity, header.version, f"bucket {header.index}"):
            return
        if session is None:
            self._fail(sock, identity, header.version, FailureKind.WIRE, f"bucket {header.index} arrived outside an update")
            return
        m = session.manifest
        if header.version != m.version or header.index >= len(m.bucket_sizes) or header.index in session.buckets:
            self._fail(sock, identity, m.version, FailureKind.WIRE, f"unexpected bucket {header.index} of version {header.version}")
            return
        table = header.delta  # a delta update's bucket of patches: checked against the manifest before landing
        if table is not None:
            try:
                table.check(m, header.index)
            except BridgeError as exc:
                self._refuse(sock, identity, m.version, exc)
                return
        session.deltas[header.index] = table
        size = table.size if table is not None else m.bucket_sizes[header.index]
        t0 = time.perf_counter()
        try:
            segment = self._plane(m.transport).land(identity, m.version, header, payload, size,
                                                    lambda n: session.receive_segment(n, self._pool))
        except BridgeError as exc:
            self._refuse(sock, identity, m.version, exc)
            return
        if segment is None:  # landing in the background: staged from _landed
            session.timings["receive"] = session.timings.get("receive", 0.0) + time.perf_counter() - t0
            session.checksums[header.index] = header.checksums
            return
        self._staged(sock, session, header.index, segment, header.checksums, t0, header.token if header.segment else "")

    def _piece(self, sock: Any, identity: bytes, piece: wire.RankBucket, frames: list[Any]) -> None:
        """A trainer rank's ranges of a bucket (a sharded update over ZMQ), from its own data socket: its
        identity is the update's control identity followed by ``|rank<rank>``. Landed by the transport's
        plane; ranges the manifest does not give that rank fail the update naming it."""
        control, sep, tail = identity.rpartition(b"|rank")
        if not sep or tail != str(piece.rank).encode():
            logger.warning("dropping ranges from %r: they claim rank %s", identity, piece.rank)
            return
        session = self._sessions.get(control)
        if session is None or piece.version < session.manifest.version:
            # a refused, aborted or finished update's late ranges (its publisher already has the answer)
            logger.debug("dropping rank %s's bucket %s of v%s from %r: no such update in progress", piece.rank,
                         piece.index, piece.version, control)
            return
        session.last_seen = time.monotonic()
        try:
            if piece.version != session.manifest.version:
                raise WireError(f"trainer rank {piece.rank} sent bucket {piece.index} of version {piece.version} "
                                f"during version {session.manifest.version}")
            self._plane(session.manifest.transport).piece(control, session.manifest.version, piece, frames,
                                                          lambda n: session.receive_segment(n, self._pool))
        except BridgeError as exc:
            self._refuse(sock, control, session.manifest.version, exc)

    def _staged(self, sock: Any, session: Session, index: int, segment: Segment, checksums: tuple[int, ...], t0: float,
                token: str = "") -> None:
        """Bucket ``index`` lies complete in ``segment``: verify it (once per host for a publisher's shm
        segment sent under ``token``), then load it (streaming) or credit it back."""
        m = session.manifest
        table = session.deltas.get(index)
        specs = m.by_bucket()[index] if table is None else table.wire_specs(m, index)  # patches: their payloads
        session.buckets[index] = StagedBucket(index, segment, specs, checksums)
        if m.shards is None:  # (a sharded update's checksums are per range: none recorded per tensor)
            session.sums.update(bucket_sums(specs, checksums))
        session.bytes_in += m.bucket_sizes[index] if table is None else table.size
        try:
            scfg = self.config.sync
            if scfg.verify_checksums or scfg.nonfinite == "reject":
                algorithm = m.checksum if scfg.verify_checksums else "none"

                def check() -> None:
                    if m.shards is not None:  # written by many trainer ranks: one checksum per range
                        verify_ranges(segment.buffer, index, specs, session.ranges()[index], checksums, scfg.nonfinite,
                                      algorithm)
                        return
                    verify_bucket(segment.buffer, specs, checksums, scfg.nonfinite, algorithm)

                if token and scfg.verify_once_per_host:
                    layout = tuple((s.name, s.dtype, s.offset, s.nbytes) for s in specs)
                    key = verdict_key(token, segment.name, m.publisher, m.version, index, layout, algorithm, checksums,
                                      scfg.nonfinite)
                    if not verify_once(segment.name, key, check, self.config.deadlines.bucket_s):
                        session.verified_by_peer += 1
                else:
                    check()
            if table is not None and self.bases is not None:  # the full tensors, checked, into staging
                wire_bucket = session.buckets[index]
                if self._keeps_bases and (session.early or not session.streaming) and self.bases.can_patch(m, session.identity):
                    session.rollback = self.bases.rollback  # patched in the store's own buckets, undone unless applied
                    session.buckets[index] = self.bases.patch(m, table, index, wire_bucket, session.identity, scfg.nonfinite)
                    session.borrowed.add(index)
                else:
                    session.buckets[index] = rebuild(m, table, index, wire_bucket, self.bases, self._pool, scfg.nonfinite)
                session.sums.update(bucket_sums(session.buckets[index].specs, session.buckets[index].checksums))
                if wire_bucket.segment.owner:
                    self._pool.give(wire_bucket.segment)
                else:  # the publisher's shm segment
                    wire_bucket.segment.close()
        except BridgeError as exc:
            self._refuse(sock, session.identity, m.version, exc)
            return
        session.timings["receive"] = session.timings.get("receive", 0.0) + time.perf_counter() - t0
        if self.bases is not None and self._keeps_base_of(m) and session.streaming and not session.early:
            # the next delta's base, adopted once applied (not over the store while it may restore an early delta)
            restoring = any(not f.done() for f in self._restoring)
            copied = self.bases.copy(m, session.buckets[index], self._pool, in_place=not restoring)
            session.copies[index] = copied
            if not self.bases.holds(copied.segment):
                session.copied.append(copied.segment)
        if session.streaming or session.early:
            self._load(session, session.buckets[index])
            if session.streaming and not session.early:
                return
        self._send(sock, session.identity, wire.Credit(version=m.version, n=1))

    def _keeps_base_of(self, m: wire.Manifest) -> bool:
        """The update ``m`` (of the base model) becomes this receiver's next delta base, as it keeps bases of its
        own: with ``sync.delta: true`` every one; with ``auto`` (the default) a delta (its chain goes on) and a
        dense update whose publisher keeps it as its own base (``Manifest.keep_base``: it sends deltas over
        that transport), so a publisher without deltas (``auto`` over shm, ``false``, a relay) leaves none."""
        return (self.bases is not None and self._keeps_bases and m.adapter is None
                and (self.config.sync.delta is True or m.delta is not None or m.keep_base))

    def _forget_base(self) -> None:
        """A dense update that leaves no base was applied: let the store's version go (its memory back), or,
        while another update patches the store or an early delta's restore may read it, have it go when that ends."""
        assert self.bases is not None
        if self.bases.patching is not None or any(not f.done() for f in self._restoring):
            self.bases.stale = True
        else:
            self.bases.clear(self._pool)

    def _landed(self, sock: Any, landed: Landed) -> None:
        """A bucket finished landing in the background: stage it, or drop it when its update is gone."""
        session = self._sessions.get(landed.identity)
        if session is None or session.manifest.version != landed.version:
            landed.segment.close()
            return
        if landed.error:
            landed.segment.close()
            self._fail(sock, landed.identity, landed.version, FailureKind.TRANSPORT, f"TransportError: {landed.error}")
            return
        self._staged(sock, session, landed.index, landed.segment, session.checksums.pop(landed.index, ()), time.perf_counter())

    def _ended(self, sock: Any, identity: bytes) -> None:
        """Finish an update whose End arrived before its last collective receive landed."""
        session = self._sessions.get(identity)
        if session is not None and session.ended is not None and session.pending is None and not self._landing(session):
            self._end(sock, identity, session.ended)

    def _landing(self, session: Session) -> bool:
        return self._plane(session.manifest.transport).pending_for(session.identity)

    def _ranks_landing(self, session: Session) -> bool:
        """A bucket of an update from many trainer ranks waits for a rank's part: its plane times it out,
        naming the ranks it waits for (not the session's own data deadline, which names none)."""
        return session.manifest.shards is not None and self._landing(session)

    def _end(self, sock: Any, identity: bytes, msg: wire.End) -> None:
        session = self._sessions.get(identity)
        if self._late(session, identity, msg.version, "end"):
            return
        if session is None or msg.version != session.manifest.version:
            self._fail(sock, identity, msg.version, FailureKind.WIRE, "end of an update that was never begun")
            return
        if self._landing(session):
            session.ended = msg  # finished once the last receive lands (see _ended)
            return
        session.ended = None
        missing = sorted(set(range(len(session.manifest.bucket_sizes))) - set(session.buckets) - session.loaded)
        if missing:
            self._fail(sock, identity, msg.version, FailureKind.WIRE, f"update ended with buckets {missing[:10]} missing")
            return
        session.timings["transfer"] = time.monotonic() - session.started
        if session.manifest.delta is not None:  # the tables the buckets carried, for the sync's record
            m = session.manifest
            assert m.delta is not None
            session.manifest = replace(m, delta=replace(m.delta, buckets=tuple(session.deltas.get(i) for i in range(len(m.bucket_sizes)))))
        buckets = [session.buckets[i] for i in sorted(session.buckets)]
        session.apply_started = time.monotonic()
        if session.streaming or session.early:
            session.on_abort = None  # from here on the finish (or its failure) ends the engine's update
            session.pending = self._executor.submit(self.gate.finish, session.manifest, session.timings)
            if session.early:
                self._restoring.append(session.pending)
            return
        session.pending = self._executor.submit(self._apply_staged, session.manifest, buckets, session.timings)

    def _tick(self, sock: Any) -> None:
        now = time.monotonic()
        deadlines = self.config.deadlines
        for identity, session in list(self._sessions.items()):
            version = session.manifest.version
            if session.loads and self._progress(sock, session):
                continue
            if session.pending is not None:
                if session.pending.done():
                    self._sessions.pop(identity)
                    try:
                        result = session.pending.result()
                    except BaseException as exc:  # noqa: BLE001 - report whatever broke the apply
                        result = ApplyResult.refused(exc)
                    m = session.manifest
                    if result.ok and not result.report.get("noop") and self.bases is not None and self._keeps_bases:
                        if m.adapter is None and not self._keeps_base_of(m):  # the store's version is served no more
                            self._forget_base()
                        elif session.streaming and not session.early:  # the copies taken as the buckets were staged
                            self.bases.adopt(m, [session.copies[i] for i in sorted(session.copies)], identity, self._pool)
                            session.copied = [seg for seg in session.copied if not self.bases.holds(seg)]
                        else:  # the applied buckets become the next delta's base, without a copy
                            session.rollback = None
                            session.borrowed |= self.bases.adopt(m, [session.buckets[i] for i in sorted(session.buckets)],
                                                                 identity, self._pool)
                    session.close(pool=self._pool if result.ok else None)  # a failed update frees its staging
                    if result.ok and not result.report.get("noop"):
                        self._served.record(m.checksum, session.sums, (t.name for t in m.tensors), served_scope(m))
                    report = dict(result.report)
                    report.setdefault("bytes", session.bytes_in)
                    report.setdefault("buckets_verified_by_peer", session.verified_by_peer)
                    if not session.overdue:
                        self._send(sock, identity, wire.Ack(version=version, ok=result.ok, reason=result.reason, report=report,
                                                            kind=result.kind.value if result.kind else ""))
                elif session.overdue:
                    continue
                elif now - session.apply_started > deadlines.apply_s + deadlines.verify_s:
                    # A running apply cannot be interrupted safely; the publisher is released with a clear
                    # error and the engine finishes or fails the update on its own (see its records).
                    session.overdue = True
                    reason = (f"DeadlineExceeded: apply of version {version} still running after "
                              f"{deadlines.apply_s + deadlines.verify_s:.1f}s (deadlines.apply_s + deadlines.verify_s)")
                    logger.warning("%s", reason)
                    self._send(sock, identity, wire.Ack(version=version, ok=False, reason=reason, kind=FailureKind.TIMEOUT.value))
                    self.on_event("timeout", {"version": version, "reason": reason, "kind": FailureKind.TIMEOUT.value})
                elif now - session.last_ping >= deadlines.heartbeat_s:
                    session.last_ping = now
                    self._send(sock, identity, wire.Heartbeat(version=version, phase="apply"))
            elif session.ended is not None and now - session.last_ping >= deadlines.heartbeat_s:
                # End came while buckets still land (a rank's part, a collective receive): the publisher waits
                session.last_ping = now
                self._send(sock, identity, wire.Heartbeat(version=version, phase="landing"))
            elif now - session.last_seen > deadlines.bucket_s and not self._ranks_landing(session):
                logger.warning("update v%s from %r timed out waiting for data", version, identity)
                self._sessions.pop(identity).close()
                self._plane(session.manifest.transport).drop(identity)
                self.on_event("timeout", {"version": version, "reason": f"no data for {deadlines.bucket_s}s",
                                          "kind": FailureKind.TIMEOUT.value})
