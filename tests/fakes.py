"""The engine stand-in of the tests: one configurable ``FakeEngine`` behind a real ``SyncReceiver`` (or a
relay), where no model is involved. It implements the engine contract (inference_side/contract.py), checks
that the receiver keeps it, and records what it was given.

Each test states what it needs in one line, for example::

    FakeEngine()                                   # takes anything, records versions and tensor names
    FakeEngine(transports=("zmq",), finish_delay_s=3.0)
    FakeEngine(keep="bytes", noop_same_version=True, transports=("zmq", "shm", "gloo"))
    FakeEngine(keep="crc32")                       # reports each tensor's crc32 in the ack (report["crc32"])
    FakeEngine(refuse={4})                         # validate raises VersionError for version 4

What it records (read after the update's ack arrived):

* ``validated``: every version whose manifest reached ``validate``
* ``applied``: versions it applied, in order (``finish`` answered ok)
* ``received[version]``: tensor name -> what ``keep`` says (None, the bytes, or their crc32), in load order,
  for every applied version; ``tensors(version)`` gives them back as torch tensors (``keep="bytes"``)
* ``segments``: the name of every segment a bucket was loaded from
* ``aborted``: (version, reason) of every update closed by ``abort``
* ``restored``: with ``restores=True``, (version, {name: bytes}) for every update that failed or was aborted after
  a bucket was loaded: what ``begin``'s ``restore`` gave back (the served version, as the receiver keeps it)
* ``violations``: calls that broke the contract (load outside an update, buckets out of order, finish with
  buckets missing, begin while another update is open); the ``start_receiver`` fixture asserts none

Bytes are copied (or summed) inside ``load``: in streaming mode the receiver may reuse a bucket's segment as
soon as ``load`` returned.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from bridge import wire
from bridge.errors import VersionError
from bridge.report import ApplyResult, FailureKind, LoadResult
from inference_side.contract import EngineGate, StagedBucket

KEEP = ("names", "bytes", "crc32")


@dataclass
class _Update:
    """The update open in the fake between ``begin`` and ``finish`` / ``abort``."""

    manifest: wire.Manifest
    got: dict[str, Any] = field(default_factory=dict)
    loaded: list[int] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # tensors whose bytes differ from ``expected``
    error: tuple[FailureKind, str] | None = None  # a failed load: reported by every later call
    restore: Any = None  # begin's restore (a gate that ``restores``)


class FakeEngine(EngineGate):
    """An engine without a model.

    info: ``dtype``, ``tp_size``, ``transports``, ``host`` as given; ``version`` starts as given and
    follows every applied update (as an engine's served version does).

    validate: raises ``VersionError`` for a version in ``refuse``; with ``noop_same_version`` answers
    "version N already served" for the version it serves (the engine's no-op); then ``validate`` (a callable
    that may raise or return a no-op reason) decides, if given.

    load: sleeps ``load_delay_s``, records per ``keep`` and compares with ``expected`` (see ``expect``);
    ``on_load(manifest, bucket)`` may return a ``LoadResult`` with an error, which fails the update.
    load_many (the receiver's call): records the run's bucket indices in ``runs[version]``, then the contract's
    default (``load`` each).

    finish: sleeps ``finish_delay_s``; ``on_finish(manifest)`` may return an ``ApplyResult`` that is the
    answer (nothing applied unless it is ok); otherwise a tensor whose bytes differ from ``expected`` (or
    one expected and not received) refuses the update with "bytes differ: [names]"; else it is applied.
    """

    def __init__(self, *, dtype: str = "bfloat16", version: int = 0, tp_size: int = 1,
                 transports: tuple[str, ...] = ("zmq", "shm"), host: str = "test", keep: str = "names",
                 refuse: Collection[int] = (), noop_same_version: bool = False,
                 validate: Callable[[wire.Manifest], str | None] | None = None,
                 on_load: Callable[[wire.Manifest, StagedBucket], LoadResult | None] | None = None,
                 on_finish: Callable[[wire.Manifest], ApplyResult | None] | None = None,
                 load_delay_s: float = 0.0, finish_delay_s: float = 0.0, restores: bool = False,
                 restore_delay_s: float = 0.0) -> None:
        if keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, not {keep!r}")
        self.dtype, self.version, self.tp_size, self.transports, self.host = dtype, version, tp_size, transports, host
        self.keep = keep
        self.refuse = set(refuse)
        self.noop_same_version = noop_same_version
        self._validate, self.on_load, self.on_finish = validate, on_load, on_finish
        self.load_delay_s, self.finish_delay_s = load_delay_s, finish_delay_s
        self.expected: dict[str, bytes] = {}
        self.validated: list[int] = []
        self.applied: list[int] = []
        self.received: dict[int, dict[str, Any]] = {}
        self.manifests: dict[int, wire.Manifest] = {}
        self.segments: list[str] = []
        self.aborted: list[tuple[int, str]] = []
        self.restores = restores
        self.restored: list[tuple[int, dict[str, bytes]]] = []
        self.restore_delay_s = restore_delay_s  # between taking ``restore()``'s buckets and reading them (a slow load)
        self.restoring = False
        self.violations: list[str] = []
        self.runs: dict[int, list[list[int]]] = {}  # per version, the bucket indices of each load_many
        self._open: _Update | None = None
        self._lock = threading.Lock()

    # ---- what a test sets and reads ------------------------------------------------------------------
    def expect(self, weights: Any) -> None:
        """The next updates must carry exactly these tensors' bytes (``(name, tensor)`` pairs or a dict of
        them, already in the wire dtype); none expected with an empty one."""
        import torch

        items = weights.items() if isinstance(weights, dict) else weights
        self.expected = {name: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for name, t in items}

    def tensors(self, version: int) -> dict[str, Any]:
        """The tensors of applied ``version`` as torch tensors (needs ``keep="bytes"``)."""
        import torch

        if self.keep != "bytes":
            raise ValueError("FakeEngine.tensors needs keep='bytes'")
        specs = {s.name: s for s in self.manifests[version].tensors}
        return {name: torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, specs[name].dtype))
                .view(specs[name].shape) for name, raw in self.received[version].items()}

    @property
    def is_open(self) -> bool:
        """An update was begun and neither finished nor aborted."""
        return self._open is not None

    # ---- the contract ----------------------------------------------------------------------------------
    def info(self) -> wire.EngineInfo:
        return wire.EngineInfo(dtype=self.dtype, version=self.version, tp_size=self.tp_size,
                               transports=tuple(self.transports), host=self.host)

    def validate(self, manifest: wire.Manifest) -> str | None:
        self.validated.append(manifest.version)
        if manifest.version in self.refuse:
            raise VersionError(f"version {manifest.version} refused by this test engine")
        if self.noop_same_version and manifest.version == self.version:
            return f"version {manifest.version} already served"
        return self._validate(manifest) if self._validate is not None else None

    def begin(self, manifest: wire.Manifest, restore: Any = None) -> None:
        with self._lock:
            if self._open is not None:
                self._violate(f"begin of version {manifest.version} while version {self._open.manifest.version} is open")
            if restore is not None and not self.restores:
                self._violate(f"begin of version {manifest.version} with a restore, though this engine does not restore")
            self._open = _Update(manifest, restore=restore)

    def load_many(self, manifest: wire.Manifest, buckets: list[StagedBucket]) -> LoadResult:
        self.runs.setdefault(manifest.version, []).append([b.index for b in buckets])
        return super().load_many(manifest, buckets)

    def load(self, manifest: wire.Manifest, bucket: StagedBucket) -> LoadResult:
        update = self._current(manifest, f"load of bucket {bucket.index}")
        if update is None:
            return LoadResult(f"bucket {bucket.index} of version {manifest.version} outside an update", FailureKind.WIRE)
        if update.error is not None:
            return LoadResult(update.error[1], update.error[0])
        if update.loaded and bucket.index <= update.loaded[-1]:
            self._violate(f"bucket {bucket.index} of version {manifest.version} loaded after bucket {update.loaded[-1]}")
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        if self.on_load is not None:
            result = self.on_load(manifest, bucket)
            if result is not None and result.error:
                update.error = (result.kind or FailureKind.OTHER, result.error)
                return result
        view = bucket.segment.buffer
        self.segments.append(bucket.segment.name)
        for s in bucket.specs:
            data = view[s.offset : s.offset + s.nbytes]
            if self.expected and self.expected.get(s.name) != data:
                update.wrong.append(s.name)
            update.got[s.name] = bytes(data) if self.keep == "bytes" else zlib.crc32(data) if self.keep == "crc32" else None
        update.loaded.append(bucket.index)
        return LoadResult()

    def finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        t0 = time.perf_counter()
        update = self._current(manifest, "finish")
        with self._lock:
            if update is not None:
                self._open = None
        if update is None:
            return ApplyResult(False, f"no update of version {manifest.version} is open", FailureKind.WIRE)
        result = self._finish(update, manifest, timings, t0)
        if not result.ok:
            self._restore(update)
        return result

    def _finish(self, update: _Update, manifest: wire.Manifest, timings: dict[str, float], t0: float) -> ApplyResult:
        if update.error is not None:
            return ApplyResult(False, update.error[1], update.error[0])
        missing = sorted(set(range(len(manifest.bucket_sizes))) - set(update.loaded))
        if missing:
            self._violate(f"finish of version {manifest.version} with buckets {missing[:10]} never loaded")
            return ApplyResult(False, f"buckets {missing[:10]} never loaded", FailureKind.WIRE)
        if self.finish_delay_s:
            time.sleep(self.finish_delay_s)
        if self.on_finish is not None:
            result = self.on_finish(manifest)
            if result is not None:
                if result.ok:
                    self._applied(update)
                return result
        if self.expected:
            wrong = update.wrong + [n for n in self.expected if n not in update.got]
            if wrong:
                return ApplyResult(False, f"bytes differ: {wrong}", FailureKind.OTHER)
        self._applied(update)
        report: dict[str, Any] = {"seconds": {**timings, "apply": time.perf_counter() - t0}}
        if self.keep == "crc32":
            report["crc32"] = dict(update.got)
        return ApplyResult(True, "", None, report)

    def abort(self, manifest: wire.Manifest, reason: str) -> None:
        with self._lock:
            update = self._open
            if update is not None and update.manifest.version == manifest.version:
                self._open = None
                self.aborted.append((manifest.version, reason))
        if update is not None and update.manifest.version == manifest.version:
            self._restore(update)

    # ---- inside ----------------------------------------------------------------------------------------
    def _restore(self, update: _Update) -> None:
        """A failed or aborted update that had loaded a bucket: take back what its ``restore`` gives."""
        if update.restore is None or not update.loaded:
            return
        buckets = update.restore()
        self.restoring = True
        time.sleep(self.restore_delay_s)
        got = {s.name: bytes(b.segment.buffer[s.offset:s.offset + s.nbytes]) for b in buckets for s in b.specs}
        self.restoring = False
        self.restored.append((update.manifest.version, got))

    def _current(self, manifest: wire.Manifest, what: str) -> _Update | None:
        update = self._open
        if update is None or update.manifest.version != manifest.version:
            self._violate(f"{what} of version {manifest.version} outside an open update")
            return None
        return update

    def _applied(self, update: _Update) -> None:
        version = update.manifest.version
        self.manifests[version] = update.manifest
        self.received[version] = update.got
        self.version = version
        self.applied.append(version)

    def _violate(self, what: str) -> None:
        self.violations.append(what)
