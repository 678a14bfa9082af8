"""The ``weight_bridge`` backend of vLLM's weight-transfer API, worker side (one per TP worker process).

vLLM creates a ``WeightBridgeEngine`` in every worker after loading the model when the engine is started with
``weight_transfer_config={"backend": "weight_bridge"}`` (registered by bridge/vllm_plugin.py). The update
itself takes the project's verified path: ``init_transfer_engine`` starts a ``SyncReceiver`` in the worker
(on ``base_port + TP rank``), and ``update_weights`` (vLLM's RPC, on the worker's own thread, serialized with
forward passes) serves that receiver's lifecycle calls: ``begin`` / ``load`` per bucket / ``finish`` or
``abort`` become the worker extension's ``wb_begin`` / ``wb_load`` / ``wb_finish`` / ``wb_abort`` on this
worker's model, so the sink router, bypass capture, write audit, identity check, checksums and version
rules all apply. The whole update happens inside that one RPC: the model is never left half-loaded
between vLLM's calls. With TP > 1 the ranks agree (a gloo all-reduce on the TP group's CPU group) before
they finish: all apply or none does. A delta this worker's receiver patches in its base store is loaded bucket by
bucket as each is verified (``sync.delta_early_load``); should it fail after that, every rank reloads the served
version from its own receiver's store (rolled back bit for bit) before the update's end is answered.

A refused or failed update is answered to the trainer's publisher in its ``Ack`` (reason and ``FailureKind``)
and fails vLLM's ``update_weights`` call with the same reason (``UpdateFailed``; over HTTP the route answers with
an error status and that reason). Only the last TP rank raises, the others return: vLLM's multiprocess executor
reads the ranks' replies in rank order and stops at the first rank that raised, so a raise on an earlier rank
would leave the later ranks' replies to be read as the answers of the next call. The ranks share the failure
before they end, so the last rank raises with the real reason whichever rank found it. The trainer engine then
closes vLLM's update session with ``finish_weight_update`` and no version (the last rank, whose session vLLM
already closed, answers that call with an error the trainer expects), so ``/weight_info`` keeps the served one.

A LoRA adapter version (a manifest with an ``AdapterSpec``, ``update_info.adapter`` naming it) takes the same
receiver, checksums, finiteness and version rules, but is checked against the engine's LoRA configuration
(inference_side/lora.py ``validate_adapter``) and never reaches the model: its verified tensors are kept until
``finish``, then TP rank 0 writes them as a PEFT directory with a marker (``lora.MARKER``), reported to the
publisher as ``adapter_dir``. The base weights and their version do not move. ``vllm serve`` serves that directory
under the adapter's name once the trainer asks the adapter route (inference_side/vllm_adapters.py).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import socket
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from bridge import wire
from bridge.checkpoint import read_tensor_table
from bridge.config import config_from_dict
from bridge.errors import BridgeError, ConfigError, UpdateFailed
from bridge.report import ApplyResult, FailureKind, LoadResult, RankReport, first_failure, parse_kind
from bridge.transports import available as available_transports
from bridge.vllm_plugin import BACKEND
from inference_side.affinity import receiver_cores, spare_cores, threads_started_on
from inference_side.contract import EngineGate, Restore, StagedBucket
from inference_side.ledger import Ledger, RecordingGate
from inference_side.lora import ServedAdapter, bucket_tensors, validate_adapter, write_marker, write_peft_dir
from inference_side.receiver import SyncReceiver
from inference_side.validate import validate_manifest
from inference_side.worker_ext import WeightSyncWorker

logger = logging.getLogger(__name__)


@dataclass
class WeightBridgeInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s ``init_info``: where this worker's receiver listens (``bind_host``,
    ``base_port`` + TP rank; 0: any free port, logged), the bridge config (a ``BridgeConfig`` as a dict) and
    ``lora_dir``, where TP rank 0 writes the LoRA adapter versions it verified (default: a fresh temporary
    directory, removed when the worker exits normally; the server's adapter route reads them, so it lies on the API
    server's host)."""

    base_port: int = 0
    bind_host: str = "127.0.0.1"
    config: dict[str, Any] = field(default_factory=dict)
    lora_dir: str = ""


@dataclass
class WeightBridgeUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``'s ``update_info``: the version the trainer publishes now, and how long to wait for it;
    ``adapter`` names the LoRA adapter whose version it is ("": the base weights)."""

    version: int = 0
    timeout_s: float = 600.0
    adapter: str = ""


def engine_name(endpoint: str, tp_rank: int, base_port: int = 0) -> str:
    """A stable name for the engine whose TP rank ``tp_rank`` listens on ``endpoint`` (``tcp://host:port``):
    ``vllm@host:base_port`` (TP rank 0's receiver, where the dashboard polls it), ``/tpN`` added on other
    ranks; the host as others reach it (this host's name for a wildcard bind)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if host in ("0.0.0.0", "*", "::", "[::]", ""):
        host = socket.gethostname()
    return f"vllm@{host}:{base_port or port}" + (f"/tp{tp_rank}" if tp_rank else "")


class _ModelWorker(WeightSyncWorker):
    """The worker extension's update calls on the model vLLM handed to this engine."""

    def __init__(self, model: Any, vllm_config: Any) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config = vllm_config


class _Call:
    def __init__(self, name: str, *args: Any) -> None:
        self.name = name
        self.args = args
        self.done: Future[Any] = Future()

    def answer(self, value: Any) -> None:
        if not self.done.cancelled():
            self.done.set_result(value)


def _named(version: int, adapter: str) -> str:
    return f"adapter {adapter} version {version}" if adapter else f"version {version}"


def _unserved(name: str, why: str, kind: FailureKind) -> Any:
    """The answer to a receiver's call ``name`` that no update_weights RPC ran: a failed load or finish."""
    if name == "load":
        return LoadResult(why, kind)
    if name == "finish":
        return ApplyResult(False, why, kind)
    return None


class _RpcGate(EngineGate):
    """The receiver's engine: validates on the receiver's thread, hands every model call to the RPC thread. It
    restores (``EngineGate.restores``): a failed update that began loading and came with ``restore`` is rolled back
    by reloading what ``restore()`` gives, on the RPC thread, before its end is answered."""

    restores = True

    def __init__(self, engine: WeightBridgeEngine) -> None:
        self.engine = engine

    def info(self) -> wire.EngineInfo:
        e = self.engine
        return wire.EngineInfo(dtype=e.dtype, version=e.version, tp_size=e.tp_size,
                               transports=tuple(t for t in available_transports() if t != "nccl"), host=socket.gethostname())

    def validate(self, manifest: wire.Manifest) -> str | None:
        e = self.engine
        if manifest.adapter is not None:
            noop = validate_adapter(manifest, e.table, e.max_lora_rank, e.adapter_version(manifest.adapter.name))
        else:
            noop = validate_manifest(manifest, e.table, e.dtype, e.version)
        if noop:  # answered "already served" by the receiver: no lifecycle call follows, the RPC ends here
            e.noop(manifest)
        return noop

    def begin(self, manifest: wire.Manifest, restore: Restore | None = None) -> None:
        self.engine.call("begin", manifest, restore)

    def load(self, manifest: wire.Manifest, bucket: StagedBucket) -> LoadResult:
        result: LoadResult = self.engine.call("load", manifest, bucket)
        return result

    def finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        result: ApplyResult = self.engine.call("finish", manifest, timings)
        return result

    def abort(self, manifest: wire.Manifest, reason: str) -> None:
        self.engine.call("abort", manifest, reason)


class WeightBridgeEngine(WeightTransferEngine[WeightBridgeInitInfo, WeightBridgeUpdateInfo]):
    init_info_cls = WeightBridgeInitInfo
    update_info_cls = WeightBridgeUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        super().__init__(config, vllm_config, device, model)
        self.worker: WeightSyncWorker = _ModelWorker(model, vllm_config)
        self.table = read_tensor_table(vllm_config.model_config.model)
        self.dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.version = 0  # served over the bridge (0: the checkpoint vLLM loaded)
        self.receiver: SyncReceiver | None = None
        self.worker_cores: set[int] = set()  # the cores vLLM bound this worker's RPC thread to
        self.spare_cores: set[int] = set()  # the engine's cores no TP worker is bound to (known at TP 1 only)
        self._calls: queue.Queue[_Call] = queue.Queue()
        self.last_failure: tuple[FailureKind, str] | None = None  # why the last update was not applied
        self._wait_s = 60.0
        self._failure: tuple[FailureKind, str] | None = None  # the open update's first failure on this rank
        self._open: wire.Manifest | None = None  # the update whose reload is open on this worker (wb_begin .. end)
        self._loaded = False  # a bucket of it reached the model
        self._buckets: list[StagedBucket] = []  # its buckets, for the host copy
        self._restore: Restore | None = None  # the open update's way back to the served version (the receiver's store)
        self._refused: FailureKind | None = None  # the kind of a refusal of the open update, ended by its abort
        self.host_copy: Any = None  # sync.host_copy: this worker's copy of the served weights (a full model)
        self.ledger = Ledger(f"vllm-tp{self.tp_rank}@{socket.gethostname()}")  # named after the receiver once it listens
        self.model_path = str(vllm_config.model_config.model)
        lora_config = getattr(vllm_config, "lora_config", None)
        self.max_lora_rank: int | None = lora_config.max_lora_rank if lora_config is not None else None
        self.adapters: dict[str, ServedAdapter] = {}  # adapter name -> its newest verified version
        self._lora: dict[str, Any] | None = None  # the open adapter update's verified tensors, held until finish
        self._lora_root: Path | None = None  # where TP rank 0 writes verified adapter versions
        self._lora_dir = ""  # WeightBridgeInitInfo.lora_dir

    # ---- vLLM's calls ------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WeightBridgeInitInfo) -> None:
        self.shutdown()
        self.worker.wb_setup()
        cfg = config_from_dict({**init_info.config, "transport": {**init_info.config.get("transport", {}),
                                                                  "bind_host": init_info.bind_host}})
        self._wait_s = cfg.deadlines.bucket_s
        self._lora_dir = init_info.lora_dir
        if cfg.sync.host_copy and self.host_copy is None:
            if self.version != 0:
                raise ConfigError(f"weight_bridge: sync.host_copy must be on from the first update: the copy starts "
                                  f"from the checkpoint and this engine serves version {self.version} already")
            from inference_side.host_copy import HostCopy

            self.host_copy = HostCopy(self.model_path, self.dtype)  # kept from then on: it follows every update
        port = init_info.base_port + self.tp_rank if init_info.base_port else 0
        gate = RecordingGate(_RpcGate(self), self.ledger, streaming=cfg.sync.mode == "streaming")
        self.receiver = SyncReceiver(gate, cfg, on_event=self._on_event, port=port, status=self.status_report)
        # off this worker's binding: the receiver's threads (and ZMQ's I/O thread) are started from here
        self.worker_cores = os.sched_getaffinity(0)
        allowed = os.sched_getaffinity(os.getppid())
        # at TP 1 this worker is the only one; at TP > 1 the other ranks' bindings are not known here
        self.spare_cores = spare_cores(allowed, [self.worker_cores]) if self.tp_size == 1 else set()
        cores = receiver_cores(allowed, self.worker_cores, cfg.serve.pin_off_workers)
        with threads_started_on(cores):
            endpoint = self.receiver.start()
        self.ledger.engine = engine_name(endpoint, self.tp_rank, init_info.base_port)
        logger.info("weight_bridge: TP rank %d takes updates at %s", self.tp_rank, endpoint)

    def start_weight_update(self) -> None:
        """A new update session: calls left from an earlier update (the receiver ended it after its RPC had
        returned) are answered and dropped. The reload opens with the update's first lifecycle call."""
        while True:
            try:
                stale = self._calls.get_nowait()
            except queue.Empty:
                break
            stale.answer(_unserved(stale.name, "the update this call belongs to had already ended", FailureKind.ABORTED))
        self._close_reload(None)

    def receive_weights(self, update_info: WeightBridgeUpdateInfo) -> None:
        """Serve the receiver's lifecycle calls for version ``update_info.version`` until it finished or failed.
        Raises ``UpdateFailed`` (reason and kind) on the last TP rank when the update was not applied."""
        if self.receiver is None:
            raise BridgeError("weight_bridge: init_weight_transfer_engine was not called: no receiver takes this "
                              "worker's updates (an InferenceActor drives its workers with run_step instead)")
        end = time.monotonic() + update_info.timeout_s
        while True:
            try:
                call = self._calls.get(timeout=max(end - time.monotonic(), 0.001))
            except queue.Empty:
                why = f"{_named(update_info.version, update_info.adapter)} did not arrive within {update_info.timeout_s}s"
                self.ledger.failed(update_info.version, FailureKind.TIMEOUT, why, adapter=update_info.adapter)
                self._failed(update_info.version, FailureKind.TIMEOUT, f"DeadlineExceeded: {why}")
                return
            outcome = self._run(call, update_info)
            if outcome is not None:
                kind, reason = outcome
                self.last_failure = None
                if kind is not None:
                    self._failed(update_info.version, kind, reason)
                return

    def _failed(self, version: int, kind: FailureKind, reason: str) -> None:
        self.last_failure = (kind, reason)
        logger.warning("weight_bridge: version %s not applied [%s]: %s", version, kind.value, reason)
        if self.tp_rank == self.tp_size - 1:  # the last rank's reply is read last (see the module's docstring)
            raise UpdateFailed(f"weight_bridge: version {version} not applied [{kind.value}]: {reason}",
                               {f"tp{self.tp_rank}": reason}, {f"tp{self.tp_rank}": kind})

    def adapter_version(self, name: str) -> int | None:
        """The newest verified version of LoRA adapter ``name`` (None: none)."""
        served = self.adapters.get(name)
        return served.version if served is not None else None

    def noop(self, manifest: wire.Manifest) -> None:
        """From the receiver's thread: ``manifest`` was answered "already served"; end the RPC waiting for it."""
        self._calls.put(_Call("noop", manifest.version, manifest.adapter.name if manifest.adapter else ""))

    def finish_weight_update(self) -> None:
        """Nothing to do: the update finished inside ``update_weights`` (and a repeated call must not fail)."""

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()
            self.receiver = None

    def adopt(self, worker: WeightSyncWorker) -> None:
        """Make the update calls on ``worker``, the vLLM worker whose extension (``worker_extension_cls``, a
        ``WeightSyncWorker``) ran ``wb_setup``: its state and a deployment's subclass apply. Without one the
        engine uses a worker of its own over the same model."""
        if self._open is None:
            self.worker = worker

    # ---- a host-side gate's calls (InferenceActor): one lifecycle step, see run_step ----------------------
    def step(self, name: str, *args: Any) -> RankReport:
        """``wb_<name>`` (begin, load, finish, abort) on this worker's model; its report, never raises."""
        if name not in ("begin", "load", "finish", "abort"):
            return RankReport(self.tp_rank, ok=False, kind=FailureKind.WIRE, error=f"no lifecycle step named {name!r}")
        return RankReport.coerce(getattr(self.worker, f"wb_{name}")(*args))

    # ---- the receiver's calls, run on the RPC thread -------------------------------------------------
    def call(self, name: str, *args: Any) -> Any:
        """From the receiver's apply thread: run ``name`` on the RPC thread, wait for its answer."""
        call = _Call(name, *args)
        self._calls.put(call)
        try:
            return call.done.result(timeout=self._wait_s)
        except TimeoutError:
            call.done.cancel()
        return _unserved(name, f"DeadlineExceeded: no update_weights call served this update within {self._wait_s}s "
                         "(the trainer calls start_weight_update and update_weights before it publishes)", FailureKind.TIMEOUT)

    # ---- operations: what the dashboard polls over the receiver's endpoint (wire.StatusRequest) -------------
    def status(self) -> dict[str, Any]:
        """This engine as ``InferenceServer.status()`` shapes it (the dashboard's engine row)."""
        rx = self.receiver
        return {
            "engine": self.ledger.engine, "endpoint": rx.endpoint if rx else "", "ipc_endpoint": rx.ipc_endpoint if rx else "",
            "version": self.version, "degraded": None, "tp_size": self.tp_size, "tp_rank": self.tp_rank,
            "dtype": self.dtype, "model": self.model_path, "backend": "weight_bridge (vLLM weight transfer)",
            "sessions": rx.summary() if rx else [],
            "adapters": {n: a.to_dict() for n, a in sorted(self.adapters.items())},  # verified versions
            "last_failure": None if self.last_failure is None else {"kind": self.last_failure[0].value,
                                                                    "reason": self.last_failure[1]},
            "cores": {"receiver": rx.cores() if rx else [], "worker": sorted(self.worker_cores)},
        }

    def records(self) -> list[dict[str, Any]]:
        return self.ledger.dicts()

    def status_report(self, since: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return self.status(), self.ledger.dicts(since)

    def _on_event(self, event: str, data: dict[str, Any]) -> None:
        """The receiver refused an update, timed it out, or the publisher abandoned it (``Abort``: a staged update
        still arriving never reached the engine, e.g. a trainer rank failed mid-publish): end the RPC waiting for
        it, rather than let it wait out ``update_info.timeout_s``. One already open in the model is ended by the
        receiver's own abort or finish instead (``_run``). Only an event naming the awaited version ends it: a
        message that names none (version 0: a stray peer's garbage, another protocol) is refused to its sender
        and leaves the update waiting; a publisher whose send failed before its Begin says so with an Abort of
        that version (``UpdateSender.abandon``)."""
        self.ledger.event(event, data)
        if event in ("refused", "timeout", "aborted"):
            self._calls.put(_Call("refused", data.get("kind", ""), str(data.get("reason", "")), int(data.get("version", 0))))

    def _run(self, call: _Call, info: WeightBridgeUpdateInfo) -> tuple[FailureKind | None, str] | None:
        """Run one call; the update's outcome (kind None: applied) once it ended, else None."""
        version = info.version
        if call.name == "noop":
            return (None, "") if call.args == (version, info.adapter) else None
        if call.name == "refused":
            kind, reason, refused = call.args
            if refused != version:  # another update's, or no update's (a stray peer's garbage: version 0)
                return None
            if self._open is not None:  # opened in the model (streaming, a delta loaded early): the receiver ends it
                self._refused = parse_kind(kind)  # with its abort or finish, queued after the loads it submitted,
                return None  # which restores
            agreed = self._agree((parse_kind(kind) or FailureKind.OTHER, reason)) or (FailureKind.OTHER, reason)
            return agreed[0], self._close_reload(agreed[1])
        manifest = call.args[0]
        if call.name == "begin":
            self._failure = None
            sent = manifest.adapter.name if manifest.adapter else ""
            if manifest.version != version or sent != info.adapter:
                self._failure = (FailureKind.VERSION, f"VersionError: the trainer announced {_named(version, info.adapter)}, "
                                                      f"the publisher sent {_named(manifest.version, sent)}")
            elif manifest.adapter is not None:  # nothing reaches the model: the tensors wait here until finish
                self._close_reload(None)
                self._lora = {}
            else:
                self._close_reload(None)
                self._open, self._loaded, self._buckets = manifest, False, []
                self._restore = call.args[1] if len(call.args) > 1 else None
                self._refused = None
                self._note(self.worker.wb_begin([s.name for s in manifest.tensors], self._worker_options()))
            call.answer(None)
            return None
        if call.name == "load":
            if self._lora is not None:
                if self._failure is None:
                    bucket = call.args[1]
                    self._lora.update(bucket_tensors(bucket.segment.buffer, bucket.specs))
                failure = self._failure
                call.answer(LoadResult(failure[1], failure[0]) if failure else LoadResult())
                return None
            if self._failure is None:
                self._loaded = True
                if self.host_copy is not None:
                    self._buckets.append(call.args[1])
                loaded = RankReport.coerce(self.worker.wb_load(call.args[1].payload()))
                self._note(loaded)
                held = frozenset(loaded.held)
            else:
                held = frozenset()
            failure = self._failure
            call.answer(LoadResult(failure[1], failure[0], held) if failure else LoadResult(held=held))
            return None
        if call.name == "finish" and manifest.adapter is not None:
            return self._finish_adapter(call, manifest)
        if call.name == "finish":
            self._failure = self._agree(self._failure)
            ranks: list[RankReport] = []
            if self._failure is None:
                finished = RankReport.coerce(self.worker.wb_finish())
                ranks.append(finished)
                self._note(finished)
                # a rank whose finish failed (audit, identity) fails the update on every rank: no rank takes the
                # version (the ranks that finished hold the new weights: see docs/guarantees.md on this mode)
                self._failure = self._agree(self._failure)
            if self._failure is None:
                self._open, self._restore = None, None
                if self.host_copy is not None:
                    self.host_copy.keep(self._buckets)
                self._buckets = []
                self.version = manifest.version
                report = {"tensors_audited": sum(r.tensors for r in ranks), "ranks": [r.to_dict() for r in ranks],
                          "seconds": dict(call.args[1])}
                call.answer(ApplyResult(True, report=report))
                return None, ""
            kind, reason = self._failure
            reason = self._close_reload(reason)
            call.answer(ApplyResult(False, reason, kind, {"ranks": [r.to_dict() for r in ranks]}))
            return kind, reason
        # abort (after a refusal of the open update: that refusal's kind)
        kind, self._refused = self._refused or FailureKind.ABORTED, None
        self._agree((kind, str(call.args[1])))
        reason = self._close_reload(f"update aborted: {call.args[1]}")
        call.answer(None)
        return kind, reason

    def _finish_adapter(self, call: _Call, manifest: wire.Manifest) -> tuple[FailureKind | None, str]:
        """The end of an adapter update: every rank verified every tensor, then TP rank 0 writes the PEFT directory
        (marker last) and every rank takes the version; else none does and the previous version stays."""
        adapter, tensors = manifest.adapter, self._lora
        assert adapter is not None
        self._lora = None
        t0 = time.perf_counter()
        if self._failure is None:
            missing = [s.name for s in manifest.tensors if tensors is None or s.name not in tensors]
            if missing:
                self._failure = (FailureKind.WIRE, f"adapter {adapter.name}: tensors never loaded: {missing[:5]}")
        self._failure = self._agree(self._failure)
        path: Path | None = None
        if self._failure is None and self.tp_rank == 0:
            assert tensors is not None
            try:
                path = self._write_adapter(manifest, tensors)
            except Exception as exc:  # noqa: BLE001 - named in the answer; the previous version stays
                self._failure = (FailureKind.LOAD, f"adapter {adapter.name} version {manifest.version}: writing its "
                                 f"PEFT directory failed: {type(exc).__name__}: {exc}")
        self._failure = self._agree(self._failure)
        if self._failure is not None:
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
            kind, reason = self._failure
            old = self.adapters.get(adapter.name)
            reason += f" (version {old.version} stays)" if old else ""
            call.answer(ApplyResult(False, reason, kind))
            return kind, reason
        self.adapters[adapter.name] = ServedAdapter(adapter.name, manifest.version, 0, str(path or ""), adapter.rank,
                                                    adapter.target_modules)
        report = {"adapter_dir": str(path or ""), "seconds": {**dict(call.args[1]), "write": time.perf_counter() - t0}}
        call.answer(ApplyResult(True, report=report))
        return None, ""

    def _write_adapter(self, manifest: wire.Manifest, tensors: dict[str, Any]) -> Path:
        """Write a verified adapter version as a PEFT directory, its marker last; keep the two versions before it
        (requests admitted on them may still reload them), remove older ones."""
        adapter = manifest.adapter
        assert adapter is not None
        if self._lora_root is None:
            if self._lora_dir:
                root = Path(self._lora_dir)
                root.mkdir(parents=True, exist_ok=True)
            else:
                import atexit

                root = Path(tempfile.mkdtemp(prefix="wb-lora-"))
                atexit.register(shutil.rmtree, root, True)
            self._lora_root = root
        home = self._lora_root / adapter.name
        home.mkdir(exist_ok=True)
        path = home / f"v{manifest.version}"
        if path.exists():  # left by a version verified here before that vLLM never served (a restarted trainer)
            shutil.rmtree(path)
        write_peft_dir(path, adapter.config, tensors)
        write_marker(path, adapter.name, manifest.version, adapter.rank, adapter.target_modules)
        kept = sorted((p for p in home.iterdir() if p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
        for old in kept[:-3]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def _close_reload(self, reason: str | None) -> str:
        """End this worker's open reload of a failed update (kernel tensors back in place); if a bucket had
        reached the model, reload the served weights: every tensor ``restore()`` gives (the receiver's delta base,
        rolled back: a delta loaded as it arrived), else the host copy's tensors of the update. Returns ``reason``
        with what became of the served weights."""
        manifest, loaded, back = self._open, self._loaded, self._restore
        self._open, self._loaded, buckets, self._buckets, self._lora, self._restore = None, False, self._buckets, [], None, None
        del buckets
        reason = reason or ""
        if manifest is None:
            return reason
        self.worker.wb_abort()
        if not loaded:
            return reason
        from inference_side.host_copy import reload_buckets, restore

        def step(name: str, *args: Any) -> list[RankReport]:
            return [RankReport.coerce(getattr(self.worker, name)(*args))]

        stored = back() if back is not None else []
        if stored:
            source = "the receiver's delta base"
            failed = reload_buckets(stored, step, self._worker_options())
        elif self.host_copy is not None:
            source = "the host copy"
            failed = restore(self.host_copy, manifest, step, self._worker_options())
        else:
            logger.warning("weight_bridge: TP rank %d holds part of version %s (no host copy, sync.host_copy)",
                           self.tp_rank, manifest.version)
            return reason + f" (TP rank {self.tp_rank} holds part of version {manifest.version}: no host copy)"
        if failed is not None:
            logger.error("weight_bridge: TP rank %d: restoring %s failed: %s", self.tp_rank, source, failed[1])
            return reason + f" (restoring {source} failed on TP rank {self.tp_rank}: {failed[1]})"
        return reason + f" (rolled back from {source}: TP rank {self.tp_rank} serves version {self.version})"

    def _worker_options(self) -> dict[str, Any]:
        """What every TP worker's ``wb_begin`` takes (``BridgeConfig.worker_options``, and the cores no worker is
        bound to); none without a receiver."""
        if self.receiver is None:
            return {}
        return {**self.receiver.config.worker_options(), "spare_cores": sorted(self.spare_cores)}

    def _note(self, report: RankReport) -> None:
        failed = first_failure([report])
        if failed is not None and self._failure is None:
            self._failure = failed

    def _agree(self, failure: tuple[FailureKind, str] | None) -> tuple[FailureKind, str] | None:
        """The update's failure as every TP rank sees it: the first rank's failure, None when all are ok (each
        rank calls this once per update)."""
        if self.tp_size == 1:
            return failure
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        seen: list[Any] = [None] * self.tp_size
        dist.all_gather_object(seen, None if failure is None else (failure[0].value, failure[1]),
                               group=get_tp_group().cpu_group)
        for rank, other in enumerate(seen):
            if other is not None:
                kind, reason = other
                return (parse_kind(kind) or FailureKind.OTHER,
                        reason if rank == self.tp_rank else f"TP rank {rank}: {reason}")
        return None


def run_step(worker: Any, name: str, *args: Any) -> RankReport:
    """One lifecycle step (``begin`` / ``load`` / ``finish`` / ``abort``) on one worker, for a gate that drives every
    TP worker from the host: ``llm.collective_rpc("wb_step", args=(name, *args))`` between vLLM's
    ``start_weight_update`` and ``finish_weight_update`` (``LLM.update_weights`` returns no per-rank result, so the
    steps go through ``collective_rpc`` into the same engine). Refused outside vLLM's update session. The engine
    takes the worker's own extension (``worker_extension_cls``, a ``WeightSyncWorker``) for its model calls, so a
    deployment's subclass of it applies."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    real = worker.worker if isinstance(worker, WorkerWrapperBase) else worker
    engine = getattr(real, "weight_transfer_engine", None)
    if not isinstance(engine, WeightBridgeEngine):
        return RankReport(0, ok=False, kind=FailureKind.OTHER, error="the engine was not started with "
                          f"weight_transfer_config={{'backend': '{BACKEND}'}} (found {type(engine).__name__})")
    if not getattr(real, "_weight_update_active", False):
        return RankReport(engine.tp_rank, ok=False, kind=FailureKind.WIRE,
                          error=f"wb_{name} outside a weight update: start_weight_update was not called")
    if isinstance(real, WeightSyncWorker) and engine.worker is not real:
        engine.adopt(real)
    return engine.step(name, *args)
