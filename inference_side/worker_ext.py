"""The vLLM ``worker_extension_cls``: mixed into every TP worker, called through ``collective_rpc``.

An update is ``wb_begin`` -> ``wb_load`` per bucket or run of buckets (shared-memory segments, mapped in place) ->
``wb_finish`` (or ``wb_abort``), the lifecycle of inference_side/contract.py on this rank. Every call
returns a ``RankReport`` and never raises, so all ranks answer and the engine decides.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from bridge.errors import AuditError, BridgeError, IdentityError
from bridge.report import FailureKind, RankReport
from inference_side.affinity import layer_threads
from inference_side.mapped_buckets import MappedBuckets, torch_dtype
from inference_side.reload_session import ReloadSession, SinkBinding, WorkerRouterState
from inference_side.router import (
    init_sink_padding,
    is_sink_name,
    layout_matches,
    map_checkpoint_name,
    sink_head_range,
)

logger = logging.getLogger(__name__)
PRUNE_EVERY_S = 1.0
_BUSY = threading.RLock()  # held while an update uses mapped buckets; the prune thread skips a busy worker
_F = TypeVar("_F", bound=Callable[..., Any])


def _exclusive(method: _F) -> _F:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _BUSY:
            return method(*args, **kwargs)
    return run  # type: ignore[return-value]


class WeightSyncWorker:
    """Methods prefixed ``wb_`` to stay clear of vLLM's own worker API."""

    _wb_state: WorkerRouterState | None = None

    # ---- set-up ---------------------------------------------------------------------------------
    def _wb_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def wb_setup(self) -> dict[str, Any]:
        """Find checkpoint-backed sink parameters, register the common TP sink loader on them,
        set padded heads to -inf, bind each to the attention backend object that reads it. A weight_bridge
        backend engine in this worker then makes its update calls on this worker (its extension class)."""
        import torch
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from bridge.checkpoint import read_tensor_table
        from inference_side.router import SinkLoader

        model = self._wb_model()
        rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        first = next(model.parameters(), None)
        state = WorkerRouterState(tp_rank=rank, tp_size=size, cores=frozenset(os.sched_getaffinity(0)),
                                  torch_threads=torch.get_num_threads(),
                                  on_cpu=first is None or first.device.type == "cpu")
        state.module_names = {name for name, _ in model.named_modules()}
        table = read_tensor_table(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        params = dict(model.named_parameters())
        attn_impls = {path: m.impl for path, m in model.named_modules() if getattr(getattr(m, "impl", None), "sinks", None) is not None}
        unrouted: list[str] = []
        with torch.no_grad():
            for ckpt_name, entry in table.items():
                if not is_sink_name(ckpt_name):
                    continue
                path = map_checkpoint_name(model, ckpt_name)
                if path is None or path not in params:
                    continue
                param = params[path]
                rng = sink_head_range(entry.shape[0], int(param.shape[0]), rank, size, path)
                layout = self._wb_probe_sink(model, ckpt_name, path, entry)
                if layout is not None and not layout_matches(layout, rng):
                    # e.g. MiMo-V2 Omni's vision sinks hold every head on every rank: not a per-rank shard
                    logger.warning("%s: the model writes its sinks as global heads %s, not this rank's range %s; "
                                   "left to the model's own loader", path, layout, rng)
                    unrouted.append(path)
                    continue
                loader = SinkLoader(rank, size, path)
                # on the live parameter too: at finalize vLLM replays a deferred attention layer's writes
                # (DeepSeek V4's attention module holds attn_sink) through the live parameter's loader
                param.weight_loader = loader
                init_sink_padding(param, entry.shape[0], rank, size, path)
                module_path = path.rpartition(".")[0]
                impl = next((impl for apath, impl in attn_impls.items() if apath.startswith(module_path + ".")), None)
                state.sinks[path] = SinkBinding(path, ckpt_name, entry.shape[0], impl)
        self._wb_state = state
        engine = getattr(self, "weight_transfer_engine", None)  # the weight_bridge backend: it takes this worker's calls
        if engine is not None and hasattr(engine, "adopt"):
            engine.adopt(self)
        return {"rank": rank, "tp_size": size, "sinks": sorted(state.sinks), "unrouted_sinks": sorted(unrouted),
                "pid": os.getpid(), "cpus": sorted(state.cores)}

    def _wb_probe_sink(self, model: Any, ckpt_name: str, path: str, entry: Any) -> list[int | None] | None:
        """Which global head the model's own load code writes into each slot of this sink (None if unknown)."""
        from vllm.config import set_current_vllm_config

        from inference_side.router import probe_sink_layout

        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                return probe_sink_layout(model, ckpt_name, path, entry.shape[0], torch_dtype(entry.dtype))
        except Exception as exc:  # noqa: BLE001 - a model whose loader cannot take one tensor: keep the default
            logger.info("%s: could not probe the model's sink layout (%s); assuming this rank's head range", path, exc)
            return None

    def wb_idle_spin(self, seconds: float) -> dict[str, Any]:
        """Shorten how long this worker busy-waits for its next RPC (inference_side/idle_spin.py)."""
        from inference_side.idle_spin import set_reader_spin

        return {"rank": self._wb_state.tp_rank if self._wb_state else -1, "previous": set_reader_spin(seconds)}

    # ---- one update: the lifecycle of inference_side/contract.py, on this rank -------------------
    _wb_session: ReloadSession | None = None
    _wb_mapped: MappedBuckets | None = None

    def _wb_rank(self) -> int:
        return self._wb_state.tp_rank if self._wb_state is not None else -1

    def _wb_buckets(self) -> MappedBuckets:
        if self._wb_mapped is None:
            self._wb_mapped = MappedBuckets()
            threading.Thread(target=self._wb_prune_loop, name="wb-prune", daemon=True).start()
        return self._wb_mapped

    @_exclusive
    def wb_begin(self, names: list[str], options: dict[str, Any]) -> RankReport:
        """Open the layerwise reload for an update of tensors ``names`` (a reload left open is aborted first)."""
        from vllm.config import set_current_vllm_config

        if self._wb_state is None:
            self.wb_setup()
        assert self._wb_state is not None
        self.wb_abort()
        self._wb_buckets().prune()
        state = self._wb_state
        threads, cores = layer_threads(options.get("reload_threads", 1), state.cores, set(options.get("spare_cores", ())),
                                       state.torch_threads, state.on_cpu)
        session = ReloadSession(
            self._wb_model(), self.vllm_config.model_config, self._wb_state, names,  # type: ignore[attr-defined]
            router=bool(options.get("router", True)),
            audit=bool(options.get("audit", True)),
            identity=bool(options.get("identity", True)),
            in_place=bool(options.get("in_place", True)),
            layer_threads=threads, layer_cores=cores,
        )
        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                session.begin()
        except Exception as exc:  # noqa: BLE001 - any failure inside vLLM must come back as a reason
            session.abort()
            return self._wb_failed(exc, "begin")
        self._wb_session = session
        return RankReport(self._wb_rank())

    @_exclusive
    def wb_load(self, *buckets: dict[str, Any]) -> RankReport:
        """Load the buckets' tensors into the open reload, one bucket after the other in the order given (the
        receiver sends several in one call when several are ready: one RPC instead of one per bucket); then
        unmap every bucket nothing holds."""
        from vllm.config import set_current_vllm_config

        session = self._wb_session
        if session is None:
            return RankReport(self._wb_rank(), ok=False, kind=FailureKind.WIRE, error="no update is open on this worker")
        mapped = self._wb_buckets()
        t0 = time.perf_counter()
        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                for bucket in buckets:
                    self._wb_load_tensors(session, mapped.map(bucket))
        except Exception as exc:  # noqa: BLE001 - any failure inside vLLM must come back as a reason
            return self._wb_failed(exc, "load")
        mapped.release_unviewed()
        return RankReport(self._wb_rank(), seconds={"load": time.perf_counter() - t0}, held=mapped.held())

    def _wb_load_tensors(self, session: ReloadSession, tensors: list[tuple[str, Any]]) -> None:
        """Load one bucket's ``(name, tensor)`` views (a method, so no loop variable outlives it and pins a
        mapping)."""
        session.load_many(tensors)

    @_exclusive
    def wb_finish(self) -> RankReport:
        """Finish the open reload: finalize, refresh backend aliases, audit, identity check."""
        from vllm.config import set_current_vllm_config

        session, self._wb_session = self._wb_session, None
        if session is None:
            return RankReport(self._wb_rank(), ok=False, kind=FailureKind.WIRE, error="no update is open on this worker")
        t0 = time.perf_counter()
        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                done = session.finish()
        except AuditError as exc:
            session.abort()
            return replace(self._wb_failed(exc, "finish"), stale=exc.tensors)
        except IdentityError as exc:
            session.abort()
            return replace(self._wb_failed(exc, "finish"), identity_violations=exc.violations)
        except Exception as exc:  # noqa: BLE001 - any failure inside vLLM must come back as a reason
            session.abort()
            return self._wb_failed(exc, "finish")
        finally:
            self._wb_buckets().close_all()
        return replace(done, seconds={**done.seconds, "worker_finish": time.perf_counter() - t0})

    def wb_step(self, name: str, *args: Any) -> RankReport:
        """One lifecycle step taken by this worker's weight_bridge backend engine (inference_side/vllm_backend.py
        ``run_step``): how an InferenceActor drives its workers inside vLLM's weight-update session."""
        from inference_side.vllm_backend import run_step

        return run_step(self, name, *args)

    @_exclusive
    def wb_abort(self) -> RankReport:
        """End an open reload without finishing it: kernel tensors back in place (a mix of versions if
        loading had begun). Harmless when none is open."""
        from vllm.config import set_current_vllm_config

        session, self._wb_session = self._wb_session, None
        try:
            if session is not None:
                with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                    session.abort()
        finally:
            if self._wb_mapped is not None:
                self._wb_mapped.close_all()
        return RankReport(self._wb_rank())

    def _wb_failed(self, exc: Exception, step: str) -> RankReport:
        if not isinstance(exc, BridgeError):
            logger.error("%s failed in worker: %s", step, traceback.format_exc())
        return RankReport.failed(self._wb_rank(), exc, kind=None if isinstance(exc, BridgeError) else FailureKind.LOAD)

    def _wb_prune_loop(self) -> None:
        """About once a second, between updates: a publisher that went away (or a receiver that trimmed its
        pool) must not leave its segments' memory pinned by this worker until the next update. Only where
        no tensor views them: ``torch.frombuffer`` views do not pin a mapping."""
        while True:
            time.sleep(PRUNE_EVERY_S)
            if _BUSY.acquire(blocking=False):
                try:
                    if self._wb_session is None and self._wb_mapped is not None:
                        self._wb_mapped.prune()
                finally:
                    _BUSY.release()

    # ---- LoRA adapters: read-back of a registered version (inference_side/lora_audit.py) ---------------
    _wb_lora_base: Any = None

    def _wb_lora_manager(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
        if manager is None:
            raise BridgeError("this worker has no LoRA manager (the engine was started without enable_lora)")
        return manager

    def wb_lora_snapshot(self) -> int:
        """Take the base weights' fingerprint (storage and checksum of every parameter and buffer) that the next
        ``wb_lora_readback`` compares against; returns how many tensors it covers."""
        from inference_side.lora_audit import fingerprint

        self._wb_lora_base = fingerprint(self._wb_model())
        return len(self._wb_lora_base)

    def wb_lora_readback(self, lora_id: int, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """This rank's LoRA weights for ``lora_id`` against the adapter's verified ``tensors`` (``lora_audit.pack_tensors``)
        and PEFT ``config``,
        and the base weights against the last ``wb_lora_snapshot``: the report of ``lora_audit.read_back`` plus
        ``base_tensors`` (how many were compared) and ``base_moved`` (those that changed). Never raises: a failure
        to read is a mismatch."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from inference_side.lora_audit import base_moved, fingerprint, read_back, unpack_tensors

        rank = get_tensor_model_parallel_rank()
        try:
            report = read_back(self._wb_lora_manager(), lora_id, unpack_tensors(tensors), config, rank)
        except Exception as exc:  # noqa: BLE001 - reported: the engine could not show the weights are the trainer's
            report = {"rank": rank, "lora_id": lora_id, "slot": None, "modules": 0, "slices": 0, "bytes": 0,
                      "mismatches": [f"reading the LoRA weights back failed: {type(exc).__name__}: {exc}"],
                      "mismatch_count": 1}
        before, self._wb_lora_base = self._wb_lora_base, None
        if before is None:
            report["base_tensors"], report["base_moved"] = 0, ["no snapshot of the base weights was taken"]
        else:
            moved = base_moved(before, fingerprint(self._wb_model()))
            report["base_tensors"], report["base_moved"] = len(before), moved[:8]
            report["base_moved_count"] = len(moved)
        return report

    # ---- inspection (tests, health) -------------------------------------------------------------
    def wb_read(self, paths: list[str]) -> dict[str, list[float]]:
        """This rank's live values of the given parameters (vLLM names), as floats."""
        model = self._wb_model()
        return {p: model.get_parameter(p).data.float().flatten().tolist() for p in paths}

    def wb_backend_sinks(self) -> dict[str, Any]:
        """For each sink parameter: does the backend alias it, and the backend's values."""
        state = self._wb_state
        out: dict[str, Any] = {}
        if state is None:
            return out
        model = self._wb_model()
        for path, binding in state.sinks.items():
            impl_sinks = getattr(binding.impl, "sinks", None)
            param = model.get_parameter(path)
            out[path] = {
                "aliased": impl_sinks is not None and impl_sinks.untyped_storage().data_ptr() == param.untyped_storage().data_ptr(),
                "backend_dtype": str(impl_sinks.dtype) if impl_sinks is not None else None,
                "values": impl_sinks.float().tolist() if impl_sinks is not None else None,
            }
        return out

    def wb_memory(self) -> dict[str, int]:
        """Host memory this rank's bridge holds between updates (``reload_scratch_bytes``: the reload's kept
        scratch tensors, ``reload_hooks.ScratchPool``) and what the last update's reload materialized its
        tensors in, in bytes: views of the served tensors (``reload_in_place_bytes``), kept scratch
        (``reload_pooled_bytes``), fresh memory (``reload_fresh_bytes``); and how many input embeddings the last
        update gave no CPU matmul handle (``reload_embedding_handles_skipped``, ``reload_hooks.EmbeddingGemm``) and
        how many of its loader calls were not run on meta tensors to count (``reload_counts_reused``,
        ``reload_hooks.LoaderCounts``), how many threads processed its layers and how many layers they took
        (``reload_layer_threads``, ``reload_layers_threaded``: ``reload_hooks.LayerThreads``)."""
        from inference_side import reload_hooks

        scratch = reload_hooks.SCRATCH
        return {"reload_scratch_bytes": scratch.nbytes, **{f"reload_{k}_bytes": v for k, v in scratch.materialized.items()},
                "reload_embedding_handles_skipped": reload_hooks.EMBEDDING_GEMM.skipped,
                "reload_counts_reused": reload_hooks.COUNTS.reused,
                "reload_layer_threads": reload_hooks.LAYERS.threads, "reload_layers_threaded": reload_hooks.LAYERS.handed}

    def wb_bypass(self) -> list[str]:
        return sorted(self._wb_state.bypass) if self._wb_state else []

