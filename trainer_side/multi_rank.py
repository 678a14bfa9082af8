"""Publishing from every rank of a multi-rank trainer (torchrun, FSDP2 ``fully_shard``, tensor parallel):
no rank gathers a tensor it does not hold.

Every rank builds a ``RankedPublisher`` with the same endpoints and calls ``publish`` with its own view of
the weights (``model.state_dict()`` under FSDP2: ``Shard(0)`` DTensors; ``Shard(d)`` / ``Replicate``
DTensors; plain tensors, which count as held by every rank and are sent by rank 0). One version:

1. rank 0 connects to the engines (their dtype is the travel dtype) and tells the ranks to plan;
2. each rank plans its byte ranges from its local shards (``trainer_side.shard_view``) and sends the plan to
   rank 0, which merges them into one ``ShardManifest`` (``bridge.shards.agree``: every rank present once,
   every byte of every tensor sent by exactly one rank) and lays the full tensors out in buckets as a
   single-process publisher would (``bridge.shards.layout``);
3. ``shm``: rank 0 creates the buckets' shared-memory segments and hands their names out; each rank writes
   its ranges into them at their offsets (strided ranges of inner-dim shards are re-laid by the write) bucket
   by bucket, and reports each bucket with one checksum per range it wrote. ``zmq``: each rank packs its
   ranges of a bucket (its local shard's bytes, in manifest order) into one frame and sends it on its own
   socket to each engine (``wire.RankBucket``), at most ``transport.depth`` buckets ahead of rank 0's headers
   (rank 0 hands out the window), then reports the bucket's checksums; the receiver lands each rank's
   ranges at their place in its staging (bridge/transports/zmq_plane.py);
4. rank 0 sends the manifest (with ``shards``) and each bucket header once every rank reported that bucket,
   the header's checksums being the ranges' (the receiver verifies each range: inference_side/ranges.py);
5. rank 0 tells every rank the outcome: each returns the same ``PublishReport`` or raises the same error.

With deltas on (``sync.delta: true``, or ``auto``, the default, over zmq) steps 3 and 4 differ: every rank writes its ranges into rank 0's copy of the
model in shared memory (the buckets of ``layout``, one segment each, kept from one version to the next; the
ranks' transport is then shared memory whatever ``transport.kind`` says, as they share a host) and reports
their checksums; rank 0 checks each range there (``RankFailed`` naming its rank before any engine hears of the
version) and publishes the assembled tensors as the single-process publisher does
(trainer_side/delta_publish.py): a delta against the last version every engine applied where that pays, dense
otherwise, dense again to an engine that does not serve the base. The engines see a plain manifest (no
``shards``) over ``transport.kind``. Memory on rank 0's host: the assembled model in /dev/shm and the
publisher's base in rank 0's RAM, each one model in the travel dtype (``base_bytes``).

A rank that dies (its process is gone), fails its own part or reports nothing within ``deadlines.bucket_s``
fails the update with ``RankFailed`` naming it; once the engines saw the manifest they are told to drop the
update (staged: nothing applied), and ``publish`` raises ``UpdateFailed`` whose reasons name the rank.

The ranks talk to rank 0 over a private ZMQ ipc socket (its address is broadcast once, when the publisher is
built, through the process group), so after that no collective is needed and every wait has a deadline.
Transports: ``shm`` (every rank on the engines' host) and ``zmq`` (engines anywhere; the ranks on one host,
as their channel is a host-local socket). Memory per rank beyond its own shards: one tensor's local shard
cast to the travel dtype at a time, and with ``zmq`` its packing ring of ``depth + 1`` buffers, each as
large as its largest share of a bucket; with ``shm`` the buckets lie in /dev/shm as for a staged
single-process shm publish.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import msgpack

from bridge import checksums, wire
from bridge.config import BridgeConfig, load_config
from bridge.curve import client_curve, secure_client
from bridge.errors import BridgeError, ConfigError, RankFailed, TransportError, UpdateFailed
from bridge.report import describe, parse_kind
from bridge.sender import EngineReport, PublishReport
from bridge.shards import (
    LocalShard,
    RangeSpec,
    RankPlan,
    ShardError,
    agree,
    bucket_ranges,
    layout,
    local_plan,
    range_checksum,
)
from bridge.transports import send_plane
from bridge.transports.base import OutgoingBucket, SendPlane
from trainer_side.packing import _copy_and_sum, iter_named
from trainer_side.publisher import WeightPublisher
from trainer_side.shard_view import is_dtensor, local_shard, range_views

__all__ = ["RankedPublisher"]

POLL_S = 0.02
TRANSPORTS = ("shm", "zmq")


def _pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class _Channel:
    """Rank 0's ROUTER (``bind``) or another rank's DEALER (``connect``) for the publisher's own messages."""

    def __init__(self, address: str | None, rank: int) -> None:
        import zmq

        self._ctx: Any = zmq.Context.instance()
        self._dir = ""
        if address is None:
            self._dir = tempfile.mkdtemp(prefix="wb-ranks-")  # 0700: only this user's processes connect
            self.address = f"ipc://{self._dir}/ranks.sock"
            self.sock = self._ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.bind(self.address)
        else:
            self.address = address
            self.sock = self._ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
            self.sock.connect(address)

    def send(self, msg: dict[str, Any], to: int | None = None) -> None:
        body = msgpack.packb(msg, use_bin_type=True)
        self.sock.send_multipart([f"rank{to}".encode(), body] if to is not None else [body])

    def recv(self, timeout_s: float) -> tuple[int, dict[str, Any]] | None:
        """The next message (sender's rank, body), or None when none came within ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        frames = self.sock.recv_multipart()
        body = msgpack.unpackb(frames[-1], raw=False)
        rank = int(frames[0].decode().removeprefix("rank")) if len(frames) > 1 else 0
        return rank, body

    def close(self) -> None:
        self.sock.close(0)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


class _ControlPeer(WeightPublisher):
    """Rank 0's link to the engines: the sending half of the protocol (sharded updates), and with
    ``sync.delta`` the single-process publisher of the assembled model (its bases, deltas and dense resends)."""


class RankedPublisher:
    """Publishes weight versions from every rank of a process group (default: the world) to one or more
    engines (on this host for ``shm``). Build it on every rank (a collective: the ranks learn where rank 0
    listens, the publisher's name and rank 0's endpoints) and call ``publish`` on every rank with the same
    version. ``control_s``: seconds rank 0's own control calls around a publish (``publish``'s ``prepare`` and
    ``settle``) may take, added to the other ranks' deadlines for rank 0's manifest and outcome (rank 0's death
    is still found at once, by its pid)."""

    def __init__(self, endpoints: list[str] | str, config: BridgeConfig | str | None = None, name: str | None = None,
                 group: Any = None, transport: str | None = None, control_s: float = 0.0) -> None:
        import torch.distributed as dist

        self.config = config if isinstance(config, BridgeConfig) else load_config(config)
        self.transport = transport or self.config.transport.kind
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"a multi-rank publish travels over {' or '.join(TRANSPORTS)}, not {self.transport}: "
                              f"set transport.kind to one of them")
        self.group = group
        self.control_s = control_s
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._control: _ControlPeer | None = None
        self._pids: dict[int, int] = {}
        self._inbox: dict[Any, Any] = {}  # rank 0: (rank, kind, bucket) -> a message not yet waited for
        self._root_pid = 0
        deadlines = self.config.deadlines
        self._data: list[Any] = []  # zmq: this rank's socket to each engine
        self._pieces: SendPlane | None = None  # zmq, ranks other than 0: this rank's packing ring
        self._mapped: Any = None  # shm, ranks other than 0: rank 0's segments, mapped once (bridge.shm.AttachCache)
        # rank 0, sync.delta or adapters: the model (or an adapter, by its name) assembled in shared memory, a
        # segment per bucket
        self._assembly: dict[str, list[Any]] = {}
        if self.rank == 0:
            self._control = _ControlPeer(endpoints, self.config, name=name, transport=self.transport)
            self._channel = _Channel(None, 0)
            self.name = self._control.name
            self.endpoints = [p.endpoint for p in self._control._peers]
        box: list[Any] = [(self._channel.address, self.name, self.endpoints) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        if self.transport == "zmq":
            self._connect_data(box[0][1], box[0][2])
        if self.rank != 0:
            address, self.name, self.endpoints = box[0]
            self._channel = _Channel(address, self.rank)
            self._channel.send({"t": "hello", "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()})
            welcome = self._await({"welcome"}, 0, deadlines.connect_s, "the welcome of rank 0")
            self._root_pid = int(welcome["pid"])
            return
        end = time.monotonic() + deadlines.connect_s
        host = socket.gethostname()
        while len(self._pids) < self.world - 1:
            got = self._channel.recv(min(max(end - time.monotonic(), 0.0), 0.2))
            if got is None:
                if time.monotonic() > end:
                    missing = [r for r in range(1, self.world) if r not in self._pids]
                    raise RankFailed(f"trainer rank(s) {missing} did not join the publisher within {deadlines.connect_s}s",
                                     missing[0])
                continue
            rank, msg = got
            if msg.get("t") != "hello":
                continue
            if msg.get("host") != host:
                raise RankFailed(f"trainer rank {rank} runs on {msg.get('host')}, not on rank 0's host {host}: the ranks "
                                 f"of a multi-rank publish share one host", rank)
            self._pids[rank] = int(msg["pid"])
        for rank in self._pids:
            self._channel.send({"t": "welcome", "pid": os.getpid()}, to=rank)

    def _connect_data(self, name: str, endpoints: list[str]) -> None:
        """zmq: this rank's own DEALER to each engine, its identity the control socket's plus ``|rank<r>``."""
        import zmq

        curve = client_curve(self.config.transport)
        ctx: Any = zmq.Context.instance()
        for endpoint in endpoints:
            identity = f"{name}|{endpoint}".encode()[:255] + f"|rank{self.rank}".encode()
            if len(identity) > 255:
                raise ConfigError(f"publisher name {name!r} with endpoint {endpoint} is too long for rank {self.rank}'s "
                                  f"socket identity (255 bytes)")
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.SNDTIMEO, int(self.config.deadlines.bucket_s * 1000))  # a send never waits longer
            secure_client(sock, curve)
            sock.connect(endpoint)
            self._data.append(sock)

    # ---- lifecycle -------------------------------------------------------------------------------
    def abandon(self, version: int, reason: str) -> None:
        """Rank 0: ``UpdateSender.abandon`` (the engines stop waiting for a version whose Begin never went out);
        the other ranks: nothing (they talk to rank 0 only)."""
        if self._control is not None:
            self._control.abandon(version, reason)

    def close(self) -> None:
        """Close the engines' link (rank 0), this rank's data sockets and the ranks' channel; closing twice is
        harmless."""
        if self._control is not None:
            self._control.close()
            self._control = None
        for sock in self._data:
            sock.close(0)
        self._data = []
        if self._pieces is not None:
            self._pieces.close()
            self._pieces = None
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        for segments in self._assembly.values():
            for seg in segments:
                seg.close()
        self._assembly = {}
        if not self._channel.sock.closed:
            self._channel.close()

    def __enter__(self) -> RankedPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- publish ---------------------------------------------------------------------------------
    def publish(self, weights: Iterable[tuple[str, Any]] | Any, version: int, probe: wire.ProbeSpec | None = None, *,
                prepare: Callable[[], None] | None = None,
                settle: Callable[[PublishReport | BaseException], PublishReport] | None = None,
                adapter: wire.AdapterSpec | None = None) -> PublishReport:
        """Send this rank's share of ``version`` (its local shards of ``weights``: a state dict or named
        tensors, DTensors or plain ones); every rank of the group must call it with the same version.
        Returns the same ``PublishReport`` on every rank once every engine applied the version; raises the
        same error on every rank otherwise (``UpdateFailed``; ``ShardError`` when the ranks' shards do not
        make up the tensors exactly once; ``RankFailed`` when a rank failed before the engines were told).
        ``probe`` is taken from rank 0.

        ``prepare`` and ``settle`` (rank 0's; the other ranks ignore them) wrap the publish in a control plane
        of rank 0's own (the vLLM trainer engine: vLLM's update session): ``prepare()`` runs once the ranks
        agreed the manifest, before any engine hears of the version (a raise fails the publish); ``settle(outcome)``
        runs with the publish's outcome (its ``PublishReport``, or the exception) before the other ranks learn
        it, and what it returns or raises is the outcome on every rank. Their time counts against
        ``control_s``.

        ``adapter`` (rank 0's; every rank passes the same): ``weights`` are that LoRA adapter's tensors (local
        shards or plain tensors, named as PEFT saves them) and ``version`` is the adapter's own, as for
        ``WeightPublisher.publish``; the ranks assemble it on rank 0's host whatever ``sync.delta`` says, and
        rank 0 sends it whole."""
        named = list(iter_named(weights))
        if self.rank == 0:
            outcome: PublishReport | BaseException
            try:
                outcome = self._publish_root(named, version, probe, prepare, adapter)
            except BaseException as exc:  # noqa: BLE001 - settled, told to every rank, raised below
                outcome = exc
            if settle is not None:
                try:
                    outcome = settle(outcome)
                except BaseException as exc:  # noqa: BLE001 - the settled outcome
                    outcome = exc
            if isinstance(outcome, BaseException):
                self._broadcast(_failure(version, outcome))
                raise outcome
            self._broadcast({"t": "done", "v": version, "ok": True, "report": _report_to_wire(outcome)})
            return outcome
        return self._publish_rank(named, version)

    def _plan(self, named: list[tuple[str, Any]], dtype: str) -> tuple[RankPlan, dict[str, tuple[LocalShard, Any]]]:
        """This rank's blocks (in the travel dtype: floating tensors are cast to ``dtype``) and plan."""
        held: dict[str, tuple[LocalShard, Any]] = {}
        for name, tensor in named:
            if name in held:
                raise ShardError(f"tensor {name} is published twice by rank {self.rank}", name, (self.rank,))
            shard = local_shard(name, tensor, self.rank)
            if tensor.is_floating_point():
                shard = dataclasses.replace(shard, dtype=dtype)
            held[name] = (shard, tensor)
        return local_plan(self.rank, [s for s, _ in held.values()]), held

    def _write(self, index: int, buffer: Any, specs: dict[str, wire.TensorSpec], mine: list[RangeSpec],
               held: dict[str, tuple[LocalShard, Any]], algorithm: str, packed: bool = False) -> list[int]:
        """Write this rank's ranges of bucket ``index`` (``mine``, manifest order) into ``buffer`` and return
        their checksums over the bytes as sent (a strided range: its runs in order). ``buffer`` holds the
        bucket's bytes (each range lands at its place), or with ``packed`` just this rank's ranges, one after
        the other as they travel (zmq)."""
        import torch

        # the single-process publisher's packing (trainer_side/packing.py): each 1 MiB chunk summed right after
        # it is copied, one pass over memory, and no torch intra-op threads spinning beside the receivers
        fresh = None if algorithm == "none" else checksums.running(algorithm)
        sums: list[int] = []
        names = list(dict.fromkeys(r.name for r in mine))
        packed_at: dict[tuple[str, int], int] = {}
        at = 0
        for r in mine:  # where each range travels in a packed buffer: manifest order
            packed_at[(r.name, r.offset)] = at
            at += r.nbytes
        for name in names:
            shard, tensor = held[name]
            local = tensor.to_local() if is_dtensor(tensor) else tensor
            local = local.detach()
            target = getattr(torch, shard.dtype)
            if local.dtype != target:
                local = local.to(target)  # one local shard of one tensor at a time
            if local.device.type != "cpu":
                local = local.cpu()
            views = {(r.offset, r.nbytes): view for r, view in range_views(shard, local)}
            base = specs[name].offset
            for r in (r for r in mine if r.name == name):
                view = views.get((r.offset, r.nbytes))
                if view is None:
                    raise ShardError(f"tensor {name}: rank {self.rank} holds no {r.describe()}", name, (self.rank,))
                if packed or not r.run:  # the range lands contiguous: copied and summed chunk by chunk, in cache
                    at = packed_at[(r.name, r.offset)] if packed else base + r.offset
                    dst = buffer[at : at + r.nbytes]
                    if fresh is None:
                        dst.copy_(view)
                        sums.append(0)
                    else:
                        sums.append(_copy_and_sum(dst, torch.uint8, view, fresh()))
                    continue
                dst = torch.as_strided(buffer, (r.count, r.run), (r.stride, 1), base + r.offset)
                dst.copy_(view.view(r.count, r.run))
                sums.append(0 if fresh is None else int(checksums.function(algorithm)(memoryview(view.numpy()))))
            del views, view, local  # this tensor's cast is freed before the next one is made
        return sums

    # ---- rank 0 ----------------------------------------------------------------------------------
    def _publish_root(self, named: list[tuple[str, Any]], version: int, probe: wire.ProbeSpec | None,
                      prepare: Callable[[], None] | None, adapter: wire.AdapterSpec | None = None) -> PublishReport:
        """Rank 0's publish up to the engines' verdict (``publish`` tells the other ranks the outcome)."""
        control = self._control
        assert control is not None, "the publisher is closed"
        t_start = time.perf_counter()
        control._starting(version)
        dtype = control._agreed_dtype()
        self._broadcast({"t": "start", "v": version, "dtype": dtype})
        plan, held = self._plan(named, dtype)
        others = self._collect("plan", version, None) if self.world > 1 else {}
        plans = [plan, *(RankPlan.from_wire(msg["plan"]) for msg in others.values())]
        shards = agree(plans, self.world)
        if self.config.sync.deltas_over(self.transport) or adapter is not None:
            return self._publish_assembled(version, probe, prepare, shards, held, t_start, adapter)
        if prepare is not None:
            prepare()
        specs, sizes = layout(shards, self.config.transport.bucket_bytes)
        manifest = wire.Manifest(version=version, tensors=specs, bucket_sizes=sizes, publisher=control.name,
                                 transport=self.transport, probe=probe, checksum=control._checksum(), shards=shards)
        plane = control._plane()
        window = self.config.transport.depth  # zmq: buckets a rank may send ahead of rank 0's header
        sealed: list[OutgoingBucket] = []
        if self.transport == "shm":
            buffers = [plane.allocate(i, size) for i, size in enumerate(sizes)]
            sealed = [plane.seal(i, b) for i, b in enumerate(buffers)]
        self._broadcast({"t": "go", "v": version, "manifest": manifest.to_wire(), "segments": [s.segment for s in sealed]})
        per_bucket = bucket_ranges(shards, specs, len(sizes))
        by_name = {s.name: s for s in specs}

        def produce(index: int, size: int) -> tuple[OutgoingBucket, tuple[int, ...]]:
            mine = [r for r in per_bucket[index] if r.rank == 0]
            try:
                if self.transport == "zmq":
                    # the engines saw Begin (they granted credit): the ranks may send up to ``window`` buckets ahead
                    self._broadcast({"t": "allow", "v": version, "b": index + window - 1})
                    own = self._send_piece(version, index, plane, by_name, mine, held, manifest.checksum)
                else:
                    own = self._write(index, buffers[index], by_name, mine, held, manifest.checksum)
            except BridgeError as exc:
                raise RankFailed(f"trainer rank 0 could not write bucket {index} of version {version}: {describe(exc)}", 0) from exc
            reports = self._collect("bucket", version, index) if self.world > 1 else {}
            queues = {0: iter(own), **{r: iter(m["sums"]) for r, m in reports.items()}}
            try:
                sums = tuple(int(next(queues[r.rank])) for r in per_bucket[index])
            except StopIteration as exc:
                counts = {r: len(m["sums"]) for r, m in reports.items()}
                raise RankFailed(f"bucket {index} of version {version}: a rank reported too few checksums ({counts})",
                                 min(counts, default=0)) from exc
            return (sealed[index] if sealed else OutgoingBucket(index, None, ())), sums

        return control._stream(manifest, plane, produce, t_start)

    @property
    def base_bytes(self) -> int:
        """Host memory rank 0 keeps between versions for deltas (``sync.delta``): the bases of its publisher
        and the model assembled in shared memory; 0 on the other ranks and with deltas off."""
        if self._control is None:
            return 0
        return self._control.base_bytes + sum(seg.size for segments in self._assembly.values() for seg in segments)

    def _wait_s(self, n_buckets: int) -> float:
        """How long the other ranks wait for rank 0's outcome once their ranges are assembled: rank 0's whole
        publish of the assembled model within its own deadlines (the dense resend to refusing engines too)."""
        d = self.config.deadlines
        return 2 * (d.manifest_s + n_buckets * d.bucket_s + d.ack_s) + self.control_s

    def _publish_assembled(self, version: int, probe: wire.ProbeSpec | None, prepare: Callable[[], None] | None,
                           shards: Any, held: dict[str, tuple[LocalShard, Any]], t_start: float,
                           adapter: wire.AdapterSpec | None = None) -> PublishReport:
        """``sync.delta``, or an ``adapter``: every rank writes its ranges into rank 0's shared-memory model (the
        buckets of ``layout``, kept from one version to the next, apart for each adapter), rank 0 checks each
        range against the checksum its rank reported (``RankFailed`` naming it; no engine has heard of the
        version yet), and then publishes the assembled tensors as a single-process publisher does: a delta
        against the last version every engine applied where that pays, dense otherwise, dense again to an
        engine that refuses the base; an adapter whole."""
        import torch

        from bridge.shm import Segment

        control = self._control
        assert control is not None
        algorithm = control._checksum()
        specs, sizes = layout(shards, self.config.transport.bucket_bytes)
        key = adapter.name if adapter is not None else ""  # the base model and each adapter keep their own
        if [seg.size for seg in self._assembly.get(key, [])] != list(sizes):
            for seg in self._assembly.pop(key, []):
                seg.close()
            self._assembly[key] = [Segment.create("asm", size) for size in sizes]
        assembly = self._assembly[key]
        manifest = wire.Manifest(version=version, tensors=specs, bucket_sizes=sizes, publisher=control.name,
                                 transport="shm", checksum=algorithm, shards=shards)
        self._broadcast({"t": "go", "v": version, "manifest": manifest.to_wire(), "assemble": True,
                         "segments": [seg.name for seg in assembly], "wait_s": self._wait_s(len(sizes))})
        per_bucket = bucket_ranges(shards, specs, len(sizes))
        by_name = {s.name: s for s in specs}
        buffers = [torch.frombuffer(seg.mm, dtype=torch.uint8, count=size) for seg, size in zip(assembly, sizes, strict=True)]
        t0 = time.perf_counter()
        for index, buffer in enumerate(buffers):
            mine = [r for r in per_bucket[index] if r.rank == 0]
            try:  # rank 0's own bytes need no check here: unsummed (its publisher sums what it sends)
                self._write(index, buffer, by_name, mine, held, "none")
            except BridgeError as exc:
                raise RankFailed(f"trainer rank 0 could not write bucket {index} of version {version}: {describe(exc)}", 0) from exc
            reports = self._collect("bucket", version, index) if self.world > 1 else {}
            if algorithm == "none":
                continue
            view = memoryview(assembly[index].mm)
            for rank, msg in reports.items():
                theirs = [r for r in per_bucket[index] if r.rank == rank]
                if len(msg["sums"]) != len(theirs):
                    raise RankFailed(f"bucket {index} of version {version}: trainer rank {rank} reported "
                                     f"{len(msg['sums'])} checksums for its {len(theirs)} ranges", rank)
                for r, reported in zip(theirs, msg["sums"], strict=True):
                    got = range_checksum(view, by_name[r.name].offset, r, algorithm)
                    if got != int(reported):
                        raise RankFailed(f"tensor {r.name}: {r.describe()} from trainer rank {rank}: the bytes in shared "
                                         f"memory do not match the checksum the rank reported (got {got:#010x}, reported "
                                         f"{int(reported):#010x}); nothing was sent", rank)
            del view
        assemble_s = time.perf_counter() - t0
        named = []
        for spec in specs:  # each tensor a view of its bytes in shared memory, in the travel dtype
            raw = buffers[spec.bucket][spec.offset:spec.offset + spec.nbytes]
            named.append((spec.name, raw.view(getattr(torch, spec.dtype)).view(spec.shape)))
        del buffers
        if prepare is not None:
            prepare()
        report = control.publish(named, version, probe, adapter=adapter)
        return dataclasses.replace(report, seconds={**report.seconds, "assemble": assemble_s,
                                                    "total": time.perf_counter() - t_start})

    def _send_piece(self, version: int, index: int, plane: SendPlane, specs: dict[str, wire.TensorSpec],
                    mine: list[RangeSpec], held: dict[str, tuple[LocalShard, Any]], algorithm: str) -> list[int]:
        """zmq: pack this rank's ranges of bucket ``index`` into one buffer of ``plane``'s ring and send it to
        every engine on this rank's own socket; their checksums (nothing is sent when the rank has no range
        in the bucket). TransportError when an engine takes nothing within ``deadlines.bucket_s``."""
        import zmq

        if not mine:
            return []
        buffer = plane.allocate(index, sum(r.nbytes for r in mine))
        sums = self._write(index, buffer, specs, mine, held, algorithm, packed=True)
        header = wire.encode(wire.RankBucket(version=version, index=index, rank=self.rank))
        frame = memoryview(buffer.numpy())
        for sock, endpoint in zip(self._data, self.endpoints, strict=True):
            try:
                plane.sent(index, sock.send_multipart([header, frame], copy=False, track=True))
            except zmq.Again as exc:
                raise TransportError(f"trainer rank {self.rank}: {endpoint} took nothing of bucket {index} within "
                                     f"{self.config.deadlines.bucket_s}s") from exc
        return sums

    def _broadcast(self, msg: dict[str, Any]) -> None:
        for rank in range(1, self.world):
            self._channel.send(msg, to=rank)

    def _collect(self, what: str, version: int, index: int | None) -> dict[int, dict[str, Any]]:
        """Every other rank's ``what`` message of ``version`` (for bucket ``index``); RankFailed naming the
        first rank that failed, died or sent nothing within ``deadlines.bucket_s``."""
        deadline_s = self.config.deadlines.bucket_s if what == "bucket" else self.config.deadlines.manifest_s
        end = time.monotonic() + deadline_s
        where = f"bucket {index} of version {version}" if what == "bucket" else f"its plan of version {version}"
        inbox = self._inbox
        if inbox.get("v") != version:  # messages of an earlier version are dropped
            inbox.clear()
            inbox["v"] = version
        got: dict[int, dict[str, Any]] = {}
        while len(got) < self.world - 1:
            for rank in range(1, self.world):
                if rank not in got and (rank, what, index) in inbox:
                    got[rank] = inbox.pop((rank, what, index))
            if len(got) == self.world - 1:
                break
            received = self._channel.recv(POLL_S)
            if received is not None:
                rank, msg = received
                if msg.get("v") != version:
                    continue
                if msg.get("t") == "error":
                    raise RankFailed(f"trainer rank {rank} failed before sending {where}: {msg.get('reason')}", rank)
                inbox[(rank, msg.get("t"), msg.get("b"))] = msg  # a rank may run ahead: later buckets wait here
                continue
            dead = [r for r in range(1, self.world) if r not in got and not _pid_alive(self._pids[r])]
            if dead and self._channel.sock.poll(0):
                continue  # what a rank sent before it died is read first
            for rank in dead:
                if (rank, what, index) not in inbox:
                    raise RankFailed(f"trainer rank {rank} (pid {self._pids[rank]}) died before sending {where}", rank)
            if time.monotonic() > end:
                late = [r for r in range(1, self.world) if r not in got]
                raise RankFailed(f"trainer rank {late[0]} sent nothing of {where} within {deadline_s}s"
                                 + (f" (nor did ranks {late[1:]})" if len(late) > 1 else ""), late[0])
        return got

    # ---- the other ranks -------------------------------------------------------------------------
    def _await(self, kinds: set[str], version: int, deadline_s: float, what: str) -> dict[str, Any]:
        """Rank 0's next message of one of ``kinds`` for ``version``; its failure raised as the error it
        reports; TransportError when rank 0 died or said nothing within ``deadline_s``."""
        end = time.monotonic() + deadline_s
        while True:
            received = self._channel.recv(POLL_S * 5)
            if received is not None:
                _, msg = received
                if msg.get("t") == "failed" and msg.get("v") == version:
                    raise _failure_from_wire(msg)
                if msg.get("t") in kinds and (msg.get("t") == "welcome" or msg.get("v") == version):
                    return msg
                continue
            if self._root_pid and not _pid_alive(self._root_pid):
                raise TransportError(f"trainer rank 0 (pid {self._root_pid}) died while rank {self.rank} waited for {what}")
            if time.monotonic() > end:
                raise TransportError(f"rank {self.rank}: no word from rank 0 within {deadline_s}s while waiting for {what}")

    def _verdict(self, version: int, own: BaseException) -> NoReturn:
        """After this rank's own part failed (reported to rank 0): raise the outcome rank 0 tells every rank (the
        update's error, naming this rank), or ``own`` if rank 0 reports success."""
        d = self.config.deadlines
        try:
            self._await({"done"}, version, d.ack_s + d.bucket_s + self.control_s, f"the outcome of version {version}")
        except BridgeError as told:
            raise told from own
        raise own

    def _publish_rank(self, named: list[tuple[str, Any]], version: int) -> PublishReport:
        from bridge.shm import AttachCache, Segment

        d = self.config.deadlines
        start = self._await({"start"}, version, d.connect_s + d.manifest_s, f"the start of version {version}")
        try:
            plan, held = self._plan(named, start["dtype"])
        except BaseException as exc:  # noqa: BLE001 - this rank's own part: reported, then rank 0's verdict
            self._channel.send({"t": "error", "v": version, "reason": describe(exc)})
            self._verdict(version, exc)
        self._channel.send({"t": "plan", "v": version, "plan": plan.to_wire()})
        go = self._await({"go"}, version, d.manifest_s + d.bucket_s + self.control_s,
                         f"the agreed manifest of version {version}")
        manifest = wire.Manifest.from_wire(go["manifest"])
        assert manifest.shards is not None
        per_bucket = bucket_ranges(manifest.shards, manifest.tensors, len(manifest.bucket_sizes))
        by_name = {s.name: s for s in manifest.tensors}
        if self.transport == "zmq" and not go.get("assemble"):
            return self._stream_rank(version, manifest, per_bucket, by_name, held)
        # rank 0 reuses its segments from one version to the next: kept mapped here, the next version's writes
        # land in pages this process has mapped, without a fresh mapping's page faults on first touch; a segment
        # rank 0 unlinked (closed, or replaced after a failed update) is unmapped here
        if self._mapped is None:
            self._mapped = AttachCache()
        self._mapped.prune()
        segments: list[Segment] = []
        own: BaseException | None = None
        try:
            for index, (name, size) in enumerate(zip(go["segments"], manifest.bucket_sizes, strict=True)):
                mine = [r for r in per_bucket[index] if r.rank == self.rank]
                sums: list[int] = []
                if mine:
                    import torch

                    seg = self._mapped.attach(name, size)
                    segments.append(seg)
                    buffer = torch.frombuffer(seg.mm, dtype=torch.uint8, count=size)
                    sums = self._write(index, buffer, by_name, mine, held, manifest.checksum)
                    del buffer
                self._channel.send({"t": "bucket", "v": version, "b": index, "sums": sums})
        except BaseException as exc:  # noqa: BLE001 - this rank's own part: reported, then rank 0's verdict
            own = exc
            self._channel.send({"t": "error", "v": version, "reason": describe(exc)})
        finally:
            for seg in segments:
                seg.close()
        if own is not None:
            self._verdict(version, own)
        wait_s = float(go.get("wait_s", 0.0)) or d.ack_s + d.bucket_s + self.control_s
        done = self._await({"done"}, version, wait_s, f"the outcome of version {version}")
        return _report_from_wire(done["report"])

    def _stream_rank(self, version: int, manifest: wire.Manifest, per_bucket: list[list[RangeSpec]],
                     by_name: dict[str, wire.TensorSpec], held: dict[str, tuple[LocalShard, Any]]) -> PublishReport:
        """zmq, a rank other than 0: send each bucket's ranges to the engines once rank 0's window allows it,
        then report their checksums; the outcome rank 0 sends."""
        d = self.config.deadlines
        if self._pieces is None:
            self._pieces = send_plane("zmq", self.config)
        plane = self._pieces
        plane.configure(self.config.transport.depth)
        allowed = -1
        failed = True
        own: BaseException | None = None
        try:
            for index in range(len(manifest.bucket_sizes)):
                while allowed < index:  # rank 0's word (its failure raised as it reports it)
                    allow = self._await({"allow"}, version, d.bucket_s + d.manifest_s, f"leave to send bucket {index}")
                    allowed = max(allowed, int(allow["b"]))
                mine = [r for r in per_bucket[index] if r.rank == self.rank]
                try:
                    sums = self._send_piece(version, index, plane, by_name, mine, held, manifest.checksum)
                except BaseException as exc:  # noqa: BLE001 - this rank's own part: reported, then rank 0's verdict
                    own = exc
                    self._channel.send({"t": "error", "v": version, "reason": describe(exc)})
                    break
                self._channel.send({"t": "bucket", "v": version, "b": index, "sums": sums})
            failed = own is not None
        finally:
            plane.release(failed)
        if own is not None:
            self._verdict(version, own)
        done = self._await({"done"}, version, d.ack_s + d.bucket_s + self.control_s, f"the outcome of version {version}")
        return _report_from_wire(done["report"])


def _failure(version: int, exc: BaseException) -> dict[str, Any]:
    """Rank 0's failure as the other ranks raise it."""
    msg: dict[str, Any] = {"t": "failed", "v": version, "error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, UpdateFailed):
        msg.update(reasons=exc.reasons, kinds={k: v.value for k, v in exc.kinds.items()})
    elif isinstance(exc, ShardError):
        msg.update(tensor=exc.tensor, ranks=list(exc.ranks))
    elif isinstance(exc, RankFailed):
        msg.update(rank=exc.rank)
    return msg


def _failure_from_wire(msg: dict[str, Any]) -> BridgeError:
    error, message = msg.get("error"), str(msg.get("message", ""))
    if error == "UpdateFailed":
        kinds = {k: parse_kind(v) for k, v in dict(msg.get("kinds", {})).items()}
        return UpdateFailed(message, dict(msg.get("reasons", {})), {k: v for k, v in kinds.items() if v is not None})
    if error == "ShardError":
        return ShardError(message, str(msg.get("tensor", "")), msg.get("ranks", ()))
    if error == "RankFailed":
        return RankFailed(message, int(msg.get("rank", 0)))
    return TransportError(f"rank 0 failed: {error}: {message}")


def _report_to_wire(report: PublishReport) -> dict[str, Any]:
    out = dataclasses.asdict(report)
    for engine in out["engines"]:
        engine["kind"] = engine["kind"].value if engine["kind"] is not None else ""
    return out


def _report_from_wire(raw: dict[str, Any]) -> PublishReport:
    engines = tuple(EngineReport(**{**e, "kind": parse_kind(e["kind"])}) for e in raw["engines"])
    return PublishReport(version=raw["version"], bytes=raw["bytes"], seconds=dict(raw["seconds"]), engines=engines,
                         held_bytes=raw.get("held_bytes", 0), delta=dict(raw.get("delta") or {}))

