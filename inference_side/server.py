"""The inference side of one engine: owns a ``vllm.LLM``, serves generation, takes weight updates.

``InferenceActor`` (see ``inference_side/__init__.py``) is this class as a Ray actor. It is the
``EngineGate`` its ``SyncReceiver`` drives (inference_side/contract.py): ``begin`` / ``load`` / ``finish`` /
``abort`` become the same steps on every TP worker, taken by the ``weight_bridge`` backend that ``vllm serve``
uses (``wb_step`` → inference_side/vllm_backend.py ``run_step``) inside vLLM's weight-update session: ``start_weight_update``
before the first, ``finish_weight_update(version)`` once applied, so vLLM labels its outputs with the version.
No request runs while a base update is open: generation waits (at most ``deadlines.ack_s``) until the update finished or
was aborted. A LoRA adapter update holds nothing back until its ``finish``: requests keep the adapter version served.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard

from bridge import wire
from bridge.checkpoint import ModelSpec, read_tensor_table
from bridge.config import BridgeConfig, config_from_dict, load_config
from bridge.errors import BridgeError, ConfigError, DeadlineExceeded, ManifestError, NotReady
from bridge.report import ApplyResult, FailureKind, LoadResult, RankReport, describe, first_failure, kind_of
from bridge.transports import available as available_transports
from bridge.vllm_plugin import BACKEND
from inference_side.contract import EngineGate, Restore, StagedBucket
from inference_side.ledger import Ledger, sync_record
from inference_side.lora import ServedAdapter, bucket_tensors, validate_adapter, write_peft_dir
from inference_side.lora_audit import pack_tensors, readback_rank, readback_summary
from inference_side.receiver import SyncReceiver
from inference_side.validate import validate_manifest

logger = logging.getLogger(__name__)


class EngineDegraded(BridgeError):
    """The engine refuses requests: an update failed after loading began; a complete version is needed."""


class UnknownAdapter(BridgeError):
    """Generation asked for a LoRA adapter of which the engine serves no version."""


def _ray_node() -> tuple[str | None, str | None]:
    """The Ray node this process runs on: its id and its address (None, None outside Ray)."""
    try:
        import ray

        if not ray.is_initialized():
            return None, None
        return str(ray.get_runtime_context().get_node_id()), str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - outside a Ray worker the runtime context may not answer
        return None, None


def resolve_config(config: BridgeConfig | dict[str, Any] | str | None) -> BridgeConfig:
    if isinstance(config, BridgeConfig):
        return config
    if isinstance(config, dict):
        return config_from_dict(config)
    return load_config(config)


@dataclass
class _Update:
    """The update open in the engine, between ``begin`` and ``finish`` / ``abort``."""

    manifest: wire.Manifest
    started: float
    begun: bool = False  # the workers opened their reload (closing it puts the kernel tensors back)
    loaded: bool = False  # a bucket reached the workers: a failure from here on leaves a mix of versions
    failure: tuple[FailureKind, str] | None = None
    buckets: list[StagedBucket] = field(default_factory=list)  # kept for the host copy (staged only)
    ranks: list[RankReport] = field(default_factory=list)
    load_s: float = 0.0
    adapter: dict[str, Any] | None = None  # an adapter update: its tensors as they arrive (nothing reaches the workers)
    restore: Restore | None = None  # the served version's buckets, should the update fail once loading began


class InferenceServer(EngineGate):
    restores = True  # a failed update that began loading is rolled back from the receiver's delta base when given

    def __init__(self, model: str | ModelSpec, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                 config: BridgeConfig | dict[str, Any] | str | None = None, name: str | None = None,
                 join: Any = None, join_timeout_s: float = 600.0, **llm_kwargs: Any) -> None:
        """Start a vLLM engine on ``model`` (a local checkpoint directory) and a receiver for updates.
        ``llm_kwargs`` go to ``vllm.LLM`` (``worker_extension_cls`` may name a subclass of
        ``inference_side.worker_ext.WeightSyncWorker``).

        ``model`` may instead be a ``ModelSpec`` (the model's config files and tensor table, no weights), or
        ``llm_kwargs`` may say ``load_format="dummy"``: vLLM then builds the model with placeholder weights and
        nothing is read from a checkpoint. Such an engine refuses generation and scoring (``NotReady``) until
        an update carrying every tensor was applied and verified. ``join`` (a ``RelayActor`` handle on this
        node) brings it to the fleet's version before the constructor returns: the relay sends the version it
        holds as a dense update, verified like any (``Relay.join``); an engine restarted by Ray rejoins the
        same way."""
        from inference_side.engine import start_llm

        self.config = resolve_config(config)
        self._spec_dir: str | None = None
        if isinstance(model, ModelSpec):
            import tempfile

            self._spec_dir = tempfile.mkdtemp(prefix="wb-spec-")
            model = str(model.write(self._spec_dir))
            llm_kwargs.setdefault("load_format", "dummy")
        self.model_path = str(Path(model))
        self.tp_size = tensor_parallel_size
        self.dtype = dtype
        self.name = name or f"engine-{socket.gethostname()}"
        self.table = read_tensor_table(self.model_path)
        # no checkpoint weights: nothing is served until a complete version is applied and verified
        self._unverified: str | None = None
        if llm_kwargs.get("load_format") == "dummy":
            self._unverified = (f"engine {self.name} was started from the model's config alone (load_format='dummy') "
                                f"and holds no verified weights yet: it serves once a complete version was applied")
            if self.config.sync.host_copy:
                raise ConfigError("sync.host_copy restores from the checkpoint: an engine started without one "
                                  "(load_format='dummy') cannot keep it")
        # the workers' side of every update is the weight_bridge backend (inference_side/vllm_backend.py)
        self.llm = start_llm(self.model_path, tensor_parallel_size, dtype,
                             {"weight_transfer_config": {"backend": BACKEND}, **llm_kwargs},
                             engine_core_spin_s=self.config.serve.engine_core_spin_s,
                             recheck=self.config.serve.worker_idle_spin_s is not None)
        self._session = False  # vLLM's weight-update session is open (start_weight_update .. finish_weight_update)
        self.setup = self.llm.collective_rpc("wb_setup")
        from inference_side.affinity import spare_cores

        # the cores no TP worker is bound to: the workers' layer threads may use them during an update
        self._spare = sorted(spare_cores(set(os.sched_getaffinity(0)), [set(r["cpus"]) for r in self.setup]))
        if self.config.serve.worker_idle_spin_s is not None:
            self.llm.collective_rpc("wb_idle_spin", args=(self.config.serve.worker_idle_spin_s,))
        if self.config.serve.pin_off_workers:  # status()["cores"] shows where the threads ended up
            from inference_side.affinity import pin_off_workers

            pin_off_workers([r["pid"] for r in self.setup], [set(r["cpus"]) for r in self.setup])
        # Guards the engine: generation and each update call hold it while they run; between an update's
        # begin and its finish/abort, generation waits on it for the update to end.
        self._engine = threading.Condition(threading.RLock())
        self._update: _Update | None = None
        self._version = 0
        self._generated = 0  # sequences generated (rollouts served) since start
        self._degraded: str | None = None
        self._ledger = Ledger(self.name, self.config.serve.history)
        lora_config = getattr(self.llm.llm_engine.vllm_config, "lora_config", None)
        self.max_lora_rank: int | None = lora_config.max_lora_rank if lora_config is not None else None
        self._adapters: dict[str, ServedAdapter] = {}  # adapter name -> the newest verified version vLLM serves
        self._lora_ids = 0  # the last LoRA id given to vLLM (each adapter version gets a new one)
        self._lora_dir: Path | None = None  # PEFT directories of the served adapter versions (made on first use)
        self._host_copy: Any = None
        if self.config.sync.host_copy:
            from inference_side.host_copy import HostCopy

            self._host_copy = HostCopy(self.model_path, self.dtype)
        self.receiver = SyncReceiver(self, self.config, on_event=self._on_event,
                                     status=lambda since: (self.status(), self._ledger.dicts(since)))
        self._endpoint = self.receiver.start()
        logger.info("%s serving %s at %s", self.name, self.model_path, self._endpoint)
        self.joined: dict[str, Any] = {}
        if join is not None:
            self._join(join, join_timeout_s)

    def _join(self, relay: Any, timeout_s: float) -> None:
        """Ask this node's relay (a Ray actor handle) for the fleet's version; on return the engine serves it
        (or, when the fleet has published nothing yet, waits for the first version)."""
        import ray

        endpoint = self.receiver.ipc_endpoint or self._endpoint
        try:
            self.joined = dict(ray.get(relay.join.remote(self.name, endpoint, timeout_s), timeout=timeout_s))
        except Exception as exc:  # noqa: BLE001 - Ray raises several unrelated types; the relay's own error inside
            self.shutdown()
            raise NotReady(f"engine {self.name} could not join its node's relay: {type(exc).__name__}: {exc}") from exc
        logger.info("%s joined its relay at version %s", self.name, self._version)

    # ---- public API (Ray methods) ----------------------------------------------------------------
    def endpoint(self, kind: str = "tcp") -> str:
        """Where publishers connect: ``tcp`` (any host allowed by transport.bind_host) or ``ipc`` (this host)."""
        if kind == "ipc":
            if not self.receiver.ipc_endpoint:
                raise ConfigError("this engine does not listen on ipc:// (transport.listen_ipc is false)")
            return self.receiver.ipc_endpoint
        if kind != "tcp":
            raise ConfigError(f"unknown endpoint kind {kind!r}: tcp or ipc")
        return self._endpoint

    def version(self) -> int:
        return self._version

    def ready(self) -> bool:
        """Serves requests: holds a verified version (not started without weights and waiting) and is not degraded."""
        return self._unverified is None and self._degraded is None

    def status(self) -> dict[str, Any]:
        node, node_ip = _ray_node()
        return {
            "engine": self.name,
            "model_path": self.model_path,
            "endpoint": self._endpoint,
            "ipc_endpoint": self.receiver.ipc_endpoint,
            "version": self._version,
            "degraded": self._degraded,
            "ready": self.ready(),
            "unverified": self._unverified,
            "node": node,
            "node_ip": node_ip,
            "tp_size": self.tp_size,
            "dtype": self.dtype,
            "sinks": self.setup[0].get("sinks", []) if self.setup else [],
            "sessions": self.receiver.summary(),
            "host_copy": self._host_copy is not None,
            "adapters": {n: a.to_dict() for n, a in sorted(self._adapters.items())},
            "sequences_generated": self._generated,
            "cores": {"workers": [r["cpus"] for r in self.setup], "worker_pids": [r["pid"] for r in self.setup],
                      "receiver": self.receiver.cores()},
        }

    def records(self) -> list[dict[str, Any]]:
        return self._ledger.dicts()

    def adapter_version(self, name: str) -> int | None:
        """The newest verified version of LoRA adapter ``name`` that the engine serves (None: none)."""
        served = self._adapters.get(name)
        return served.version if served is not None else None

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, logprobs: int | None = None,
                 temperature: float = 0.0, seed: int | None = None, adapter: str | None = None) -> list[dict[str, Any]]:
        """Token-id prompts in, one dict per prompt out: ``token_ids``, each sampled token's logprob
        (``logprobs``, when asked) and ``version``, the weight version that produced them (no update runs
        during a call, so one call's outputs share one version). Greedy by default. ``adapter`` names a LoRA
        adapter: its newest verified version applies, given as ``adapter_version`` (None without one)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=logprobs,
                                seed=seed, detokenize=False)
        with self._serving():
            self._check_ready()
            version = self._version
            lora, adapter_version = None, None
            if adapter is not None:
                served = self._adapters.get(adapter)
                if served is None:
                    raise UnknownAdapter(f"engine {self.name} serves no version of adapter {adapter!r} "
                                         f"(it serves: {sorted(self._adapters) or 'none'})")
                lora, adapter_version = self._lora_request(served), served.version
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                     lora_request=lora)
            self._generated += len(outs)
        result = []
        for out in outs:
            comp = out.outputs[0]
            lps = None
            if logprobs is not None and comp.logprobs is not None:
                lps = [step[tok].logprob for tok, step in zip(comp.token_ids, comp.logprobs, strict=True)]
            result.append({"token_ids": list(comp.token_ids), "logprobs": lps, "version": version,
                           "adapter_version": adapter_version})
        return result

    def score(self, sequences: list[list[int]]) -> list[dict[str, Any]]:
        """Per sequence: ``logprobs``, the log-probability of each token after the first under the served
        weights, and ``version``, the weight version that scored it."""
        with self._serving():
            self._check_ready()
            version = self._version
            return [{"logprobs": lps, "version": version} for lps in self._score(sequences)]

    def read_params(self, paths: list[str]) -> list[dict[str, list[float]]]:
        """Each TP rank's live values of the given parameters (vLLM names)."""
        with self._serving():
            return self.llm.collective_rpc("wb_read", args=(paths,))

    def backend_sinks(self) -> list[dict[str, Any]]:
        with self._serving():
            return self.llm.collective_rpc("wb_backend_sinks")

    def bypass_tensors(self) -> list[list[str]]:
        return self.llm.collective_rpc("wb_bypass")

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call ``method`` of the worker extension on every TP worker (vLLM's ``collective_rpc``), between
        updates; one result per rank. For methods a deployment adds in its own ``worker_extension_cls``."""
        with self._serving():
            return self.llm.collective_rpc(method, args=tuple(args))

    def shutdown(self) -> None:
        import shutil

        self.receiver.stop()
        for directory in (self._lora_dir, self._spec_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def _check_ready(self) -> None:
        if self._unverified:
            raise NotReady(self._unverified)
        if self._degraded:
            raise EngineDegraded(f"engine {self.name} is degraded: {self._degraded}")

    # ---- EngineGate (inference_side/contract.py) ---------------------------------------------------
    @staticmethod
    def _transports() -> tuple[str, ...]:
        """Every data plane this host can receive on (NCCL only where a GPU is visible)."""
        import torch

        return tuple(t for t in available_transports() if t != "nccl" or torch.cuda.is_available())

    def info(self) -> wire.EngineInfo:
        return wire.EngineInfo(dtype=self.dtype, version=self._version, tp_size=self.tp_size,
                               transports=self._transports(), host=socket.gethostname())

    def validate(self, manifest: wire.Manifest) -> str | None:
        if self._unverified:
            if manifest.adapter is not None:
                raise ManifestError(f"adapter {manifest.adapter.name}: {self._unverified}; an adapter needs the base first")
            missing = sorted(set(self.table) - {s.name for s in manifest.tensors})
            if missing:
                raise ManifestError(f"{self._unverified}: the update must carry every tensor; it lacks "
                                    f"{len(missing)}: {missing[:5]}")
        if manifest.adapter is not None:
            return validate_adapter(manifest, self.table, self.max_lora_rank, self.adapter_version(manifest.adapter.name))
        return validate_manifest(manifest, self.table, self.dtype, self._version, self._degraded or self._unverified)

    def begin(self, manifest: wire.Manifest, restore: Restore | None = None) -> None:
        with self._engine:
            if self._update is not None:  # an update the receiver never closed (it always does): end it first
                self._close(self._update, (FailureKind.ABORTED, "superseded by a newer update"))
            update = self._update = _Update(manifest, time.perf_counter(), restore=restore)
            if manifest.adapter is not None:
                update.adapter = {}
                served = self.adapter_version(manifest.adapter.name)
                if served is not None and manifest.version <= served:
                    update.failure = (FailureKind.VERSION, f"VersionError: adapter {manifest.adapter.name} version "
                                      f"{manifest.version} is not newer than the served version {served} (applied "
                                      f"meanwhile by another update)")
                return
            if manifest.version < self._version or (manifest.version == self._version and not (self._degraded or self._unverified)):
                # another update (a second publisher) got there first while this one was staged
                update.failure = (FailureKind.VERSION, f"VersionError: version {manifest.version} is not newer than the "
                                  f"served version {self._version} (applied meanwhile by another update)")
                return
            update.begun = True
            self._ranks(update, self._rpc("wb_begin", [s.name for s in manifest.tensors], self._worker_options()))

    def load(self, manifest: wire.Manifest, bucket: StagedBucket) -> LoadResult:
        return self.load_many(manifest, [bucket])

    def load_many(self, manifest: wire.Manifest, buckets: list[StagedBucket]) -> LoadResult:
        """The buckets in one ``wb_load`` on every TP worker (one RPC for the run, not one per bucket)."""
        with self._engine:
            update = self._update
            if not self._open_for(update, manifest):
                return LoadResult(f"bucket {', '.join(str(b.index) for b in buckets)} of version {manifest.version} "
                                  "arrived outside its update", FailureKind.WIRE)
            if update.adapter is not None:  # held here until finish: the served adapter is untouched till then
                if update.failure is None:
                    for bucket in buckets:
                        update.adapter.update(bucket_tensors(bucket.segment.buffer, bucket.specs))
                return LoadResult(update.failure[1], update.failure[0]) if update.failure else LoadResult()
            if update.failure is None and buckets:
                t0 = time.perf_counter()
                update.loaded = True
                reports = self._rpc("wb_load", *(bucket.payload() for bucket in buckets))
                update.load_s += time.perf_counter() - t0
                self._ranks(update, reports)
                if self._host_copy is not None:
                    update.buckets.extend(buckets)
                held = frozenset(name for r in reports for name in r.held)
            else:
                held = frozenset()
            if update.failure is not None:
                return LoadResult(update.failure[1], update.failure[0], held)
            return LoadResult(held=held)

    def finish(self, manifest: wire.Manifest, timings: dict[str, float]) -> ApplyResult:
        with self._engine:
            update = self._update
            if not self._open_for(update, manifest):
                return ApplyResult(False, f"no update of version {manifest.version} is open", FailureKind.WIRE)
            if update.adapter is not None:
                try:
                    return self._finish_adapter(update, timings)
                finally:
                    self._end(update)
            t0 = time.perf_counter()
            if update.failure is None:
                finished = self._rpc("wb_finish")
                self._ranks(update, finished)
                update.ranks = list(finished)
            seconds = {"apply": update.load_s + time.perf_counter() - t0, "stream_load": update.load_s,
                       "stream_total": time.perf_counter() - update.started}
            if self.config.sync.mode != "streaming":
                del seconds["stream_load"], seconds["stream_total"]
            if update.failure is not None:
                kind, reason = update.failure
                reason = self._close(update, update.failure)
                return self._record(manifest, False, reason, seconds, timings, update.ranks, kind=kind)
            try:
                if self._host_copy is not None:
                    self._host_copy.keep(update.buckets)
                self._close_session(manifest.version)  # vLLM labels the tokens it samples from now on with it
                self.llm.reset_prefix_cache()
                self._version = manifest.version
                self._degraded = None
                self._unverified = None  # every tensor came with this verified update (validate)
                probe = self._probe(manifest.probe) if manifest.probe and self.config.probe.enabled else {}
            finally:
                self._end(update)
            return self._record(manifest, True, "", seconds, timings, update.ranks, probe)

    def abort(self, manifest: wire.Manifest, reason: str) -> None:
        with self._engine:
            update = self._update
            if not self._open_for(update, manifest):
                return
            if update.adapter is None:
                reason = self._close(update, (FailureKind.ABORTED, reason))
            else:  # nothing of it reached vLLM
                self._end(update)
            self._ledger.failed(manifest.version, FailureKind.ABORTED,
                                f"{'streaming ' if self.config.sync.mode == 'streaming' else ''}update aborted: {reason}",
                                adapter=manifest.adapter.name if manifest.adapter else "")

    @staticmethod
    def _open_for(update: _Update | None, manifest: wire.Manifest) -> TypeGuard[_Update]:
        """``update`` is the one of ``manifest`` (an adapter's versions count apart from the base's)."""
        if update is None or update.manifest.version != manifest.version:
            return False
        ours, theirs = update.manifest.adapter, manifest.adapter
        return (ours.name if ours else None) == (theirs.name if theirs else None)

    # ---- LoRA adapters (inference_side/lora.py) ------------------------------------------------------
    @staticmethod
    def _lora_request(served: ServedAdapter) -> Any:
        from vllm.lora.request import LoRARequest

        # vLLM tells LoRA requests apart by name: each version gets its own (and its own id)
        return LoRARequest(lora_name=f"{served.name}@v{served.version}", lora_int_id=served.lora_id, lora_path=served.path)

    def _finish_adapter(self, update: _Update, timings: dict[str, float]) -> ApplyResult:
        """Write the verified adapter into a fresh PEFT directory, register it with vLLM under a new LoRA id,
        then retire the previous version's id. Refused (vLLM would not load it): the previous version serves on."""
        import shutil
        import tempfile

        manifest, adapter = update.manifest, update.manifest.adapter
        assert adapter is not None and update.adapter is not None
        t0 = time.perf_counter()

        def done(ok: bool, reason: str = "", kind: FailureKind | None = None, ranks: list[RankReport] | None = None,
                 extra: dict[str, Any] | None = None) -> ApplyResult:
            result = self._record(manifest, ok, reason, {"apply": time.perf_counter() - t0}, timings, ranks or [], kind=kind)
            if extra:
                result = replace(result, report={**result.report, **extra})
            return result

        if update.failure is not None:
            return done(False, update.failure[1], update.failure[0])
        missing = [s.name for s in manifest.tensors if s.name not in update.adapter]
        if missing:
            return done(False, f"adapter {adapter.name}: tensors never loaded: {missing[:5]}", FailureKind.WIRE)
        if self._lora_dir is None:
            self._lora_dir = Path(tempfile.mkdtemp(prefix=f"wb-lora-{self.name}-"))
        self._lora_ids += 1
        path = self._lora_dir / f"{adapter.name}-v{manifest.version}-id{self._lora_ids}"
        new = ServedAdapter(adapter.name, manifest.version, self._lora_ids, str(path), adapter.rank, adapter.target_modules)
        old = self._adapters.get(adapter.name)
        keeps = f"version {old.version} serves on" if old else "no version of it is served"
        audit = self.config.router.audit
        try:
            write_peft_dir(path, adapter.config, update.adapter)
            if audit:
                self.llm.collective_rpc("wb_lora_snapshot")
            if not self.llm.llm_engine.add_lora(self._lora_request(new)):
                raise ManifestError("vLLM did not register it")
        except Exception as exc:  # noqa: BLE001 - vLLM's own refusal, named; the previous version serves on
            shutil.rmtree(path, ignore_errors=True)
            return done(False, f"adapter {adapter.name} version {manifest.version} could not be loaded by "
                        f"vLLM: {type(exc).__name__}: {exc} ({keeps})", FailureKind.LOAD)
        if audit:
            readback = self.llm.collective_rpc("wb_lora_readback", args=(new.lora_id, pack_tensors(update.adapter),
                                                                                dict(adapter.config)))
            ranks = [readback_rank(r) for r in readback]
            extra = {"lora_readback": readback_summary(readback)}
            failed = first_failure(ranks)
            if failed is not None:
                try:
                    self.llm.llm_engine.remove_lora(new.lora_id)
                except Exception as exc:  # noqa: BLE001 - the id is not served under the adapter's name anyway
                    logger.warning("%s: removing LoRA id %s after a failed read-back failed: %s", self.name, new.lora_id, exc)
                shutil.rmtree(path, ignore_errors=True)
                return done(False, f"adapter {adapter.name} version {manifest.version}: {failed[1]} ({keeps})", failed[0],
                            ranks, extra)
        else:
            ranks, extra = [], {}
        self._adapters[adapter.name] = new
        if old is not None:
            try:
                self.llm.llm_engine.remove_lora(old.lora_id)
            except Exception as exc:  # noqa: BLE001 - the new version serves; the old id only lingers
                logger.warning("%s: removing LoRA id %s (%s v%s) failed: %s", self.name, old.lora_id, old.name, old.version, exc)
            shutil.rmtree(old.path, ignore_errors=True)
        return done(True, ranks=ranks, extra=extra)

    # ---- one update: internals -----------------------------------------------------------------
    def _rpc(self, method: str, *args: Any) -> list[RankReport]:
        """One lifecycle call (``wb_begin`` ...) on every TP worker, through the weight_bridge backend inside vLLM's
        weight-update session (opened here by the first call of an update); one report per rank."""
        if not self._session:
            self.llm.start_weight_update()
            self._session = True
        return [RankReport.coerce(r) for r in self.llm.collective_rpc("wb_step", args=(method.removeprefix("wb_"), *args))]

    def _close_session(self, version: int | None) -> None:
        """End vLLM's weight-update session; ``version``: the one now served (its label in vLLM), else none."""
        if self._session:
            self._session = False
            self.llm.finish_weight_update(None if version is None else str(version))

    @staticmethod
    def _ranks(update: _Update, reports: list[RankReport]) -> None:
        """Note the first failure among the ranks' answers."""
        failed = first_failure(reports)
        if failed is not None and update.failure is None:
            update.failure = failed

    def _close(self, update: _Update, failure: tuple[FailureKind, str]) -> str:
        """End a failed update: the workers' reload is closed (kernel tensors back in place), then, if loading had
        begun, the served version restored (from the update's ``restore``, else the host copy) or the engine
        marked degraded. Returns the reason, with what became of
        the engine."""
        reason = failure[1]
        try:
            if not update.begun:
                return reason
            self._rpc("wb_abort")
            if not update.loaded:  # the reload was opened and closed again: the served weights are untouched
                return reason
            source = "the receiver's delta base" if update.restore is not None else "the host copy"
            restored = self._restore(update) if update.restore is not None or self._host_copy is not None else None
            if restored:
                reason += f" (rolled back from {source}: the engine serves version {self._version})"
            else:
                mode = "streaming update" if self.config.sync.mode == "streaming" else "update"
                self._degraded = f"{mode} to v{update.manifest.version} failed after loading began: {reason}"
                if restored is not None:
                    reason += f" (restoring {source} failed too: the engine is degraded)"
                logger.warning("%s: %s", self.name, self._degraded)
            self.llm.reset_prefix_cache()
            return reason
        finally:
            self._end(update)

    def _end(self, update: _Update) -> None:
        self._close_session(None)  # still open only when the update failed or an exception cut it short
        if self._update is update:
            self._update = None
            self._engine.notify_all()

    def _worker_options(self) -> dict[str, Any]:
        """What every TP worker's ``wb_begin`` takes: the config's options and the cores no worker is bound to."""
        return {**self.config.worker_options(), "spare_cores": self._spare}

    def _restore(self, update: _Update) -> bool:
        """Reload, on every rank, the served version: the buckets ``update.restore`` gives (every tensor), else
        the host copy of each tensor the failed update may have overwritten."""
        from inference_side.host_copy import reload_buckets, restore

        options = self._worker_options()
        try:
            if update.restore is not None:
                buckets = update.restore()
                failed = reload_buckets(buckets, self._rpc, options) if buckets else \
                    (FailureKind.OTHER.value, "the receiver's delta base holds no version to restore")
            else:
                failed = restore(self._host_copy, update.manifest, self._rpc, options)
        except BridgeError as exc:
            failed = (kind_of(exc).value, describe(exc))
        if failed is not None:
            logger.error("%s: restoring the served version failed: %s", self.name, failed[1])
            return False
        logger.warning("%s: update to v%s failed; restored v%s", self.name, update.manifest.version, self._version)
        return True

    @contextmanager
    def _serving(self) -> Iterator[None]:
        """Hold the engine for a request, once no base update is open (waits at most ``deadlines.ack_s``). An open
        adapter update does not hold requests back: nothing of it reaches vLLM before its ``finish`` (which holds the
        engine while it registers and reads back the new version), so they run on the versions served."""
        with self._engine:
            limit = self.config.deadlines.ack_s
            if not self._engine.wait_for(lambda: self._update is None or self._update.adapter is not None, timeout=limit):
                raise DeadlineExceeded(f"engine {self.name}: an update stayed open for over {limit}s (deadlines.ack_s)")
            yield

    def _score(self, sequences: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        scored = []
        for seq, out in zip(sequences, outs, strict=True):
            steps = out.prompt_logprobs or []
            scored.append([steps[i][tok].logprob for i, tok in enumerate(seq) if i > 0 and steps[i] is not None])
        return scored

    def _probe(self, probe: wire.ProbeSpec) -> dict[str, Any]:
        engine = self._score([list(s) for s in probe.sequences])
        diffs, kls = [], []
        for mine, theirs in zip(engine, probe.logprobs, strict=True):
            for a, b in zip(mine, theirs, strict=False):
                diffs.append(abs(a - b))
                r = b - a  # log(p_trainer / p_engine) on tokens of the probe
                kls.append(math.exp(r) - 1 - r)
        mad = sum(diffs) / len(diffs) if diffs else 0.0
        kl = sum(kls) / len(kls) if kls else 0.0
        return {"probe_mean_abs_logprob_diff": mad, "probe_kl": kl,
                "probe_flagged": mad > self.config.probe.max_mean_abs_logprob_diff}

    def _record(self, manifest: wire.Manifest, ok: bool, reason: str, extra: dict[str, float],
                timings: dict[str, float], ranks: list[RankReport], probe: dict[str, Any] | None = None,
                kind: FailureKind | None = None) -> ApplyResult:
        record = sync_record(self.name, manifest, ok, reason, timings, ranks, extra=extra, kind=kind, probe=probe)
        self._ledger.add(record)
        return ApplyResult(ok, reason, kind, record.to_dict() | {"ranks": [r.to_dict() for r in ranks]})

    def _on_event(self, event: str, data: dict[str, Any]) -> None:
        """The receiver's refusals, deadlines, aborts and conflicts become failed records."""
        self._ledger.event(event, data)
