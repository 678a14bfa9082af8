"""The vLLM ``worker_extension_cls``: mixed into every TP worker, called through ``collective_rpc``.

One RPC per update in staged mode (``wb_apply`` with every bucket's shared-memory segment);
every method catches its own failure and returns it, so all ranks answer and the actor decides.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from bridge.errors import BridgeError
from bridge.shm import AttachCache, Segment
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


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


class WeightSyncWorker:
    """Methods prefixed ``wb_`` to stay clear of vLLM's own worker API."""

    _wb_state: WorkerRouterState | None = None
    _wb_fail_once: str | None = None  # test-only: tensor name at which the next update raises

    # ---- set-up ---------------------------------------------------------------------------------
    def _wb_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def wb_setup(self) -> dict[str, Any]:
        """Find checkpoint-backed sink parameters, register the common TP sink loader on them,
        set padded heads to -inf, bind each to the attention backend object that reads it."""
        import torch
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from bridge.checkpoint import read_tensor_table
        from inference_side.router import SinkLoader

        model = self._wb_model()
        rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        state = WorkerRouterState(tp_rank=rank, tp_size=size)
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
        return {"rank": rank, "tp_size": size, "sinks": sorted(state.sinks), "unrouted_sinks": sorted(unrouted),
                "pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0))}

    def _wb_probe_sink(self, model: Any, ckpt_name: str, path: str, entry: Any) -> list[int | None] | None:
        """Which global head the model's own load code writes into each slot of this sink (None if unknown)."""
        from vllm.config import set_current_vllm_config

        from inference_side.router import probe_sink_layout

        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                return probe_sink_layout(model, ckpt_name, path, entry.shape[0], _torch_dtype(entry.dtype))
        except Exception as exc:  # noqa: BLE001 - a model whose loader cannot take one tensor: keep the default
            logger.info("%s: could not probe the model's sink layout (%s); assuming this rank's head range", path, exc)
            return None

    def wb_idle_spin(self, seconds: float) -> dict[str, Any]:
        """Shorten how long this worker busy-waits for its next RPC (inference_side/idle_spin.py)."""
        from inference_side.idle_spin import set_reader_spin

        return {"rank": self._wb_state.tp_rank if self._wb_state else -1, "previous": set_reader_spin(seconds)}

    # ---- one update -----------------------------------------------------------------------------
    @_exclusive
    def wb_apply(self, buckets: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        if self._wb_state is None:
            self.wb_setup()
        assert self._wb_state is not None
        names = [t[0] for b in buckets for t in b["tensors"]]
        session = ReloadSession(
            self._wb_model(), self.vllm_config.model_config, self._wb_state, names,  # type: ignore[attr-defined]
            router=bool(options.get("router", True)),
            audit=bool(options.get("audit", True)),
            identity=bool(options.get("identity", True)),
        )
        segments: list[Segment] = []
        self._wb_prune()
        attached = self._wb_attached()
        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                session.begin()
                for bucket in buckets:
                    seg = attached.attach(bucket["segment"], bucket["size"])
                    segments.append(seg)
                    _load_views(session, _views(seg, bucket["tensors"]), self._wb_test_only_fail(bucket["tensors"]))
                report = session.finish()
            report["ok"] = True
        except BridgeError as exc:
            session.abort()
            report = {"ok": False, "rank": self._wb_state.tp_rank, "error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - any failure inside vLLM must come back as a reason
            session.abort()
            logger.error("update failed in worker: %s", traceback.format_exc())
            report = {"ok": False, "rank": self._wb_state.tp_rank, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            del session
            for seg in segments:
                seg.close()
            self._wb_prune()
        report["worker_seconds"] = time.perf_counter() - t0
        return report

    _wb_attach_cache: AttachCache | None = None

    def _wb_attached(self) -> AttachCache:
        """Bucket segments mapped copy-on-write and kept from one update to the next: the receiver and the
        publisher reuse their segments, and reading kept pages skips the page-table set-up of a fresh
        mapping (about a third of a bucket's copy time here). Segments whose file is gone are unmapped."""
        if self._wb_attach_cache is None:
            self._wb_attach_cache = AttachCache(private=True)
            threading.Thread(target=self._wb_prune_loop, name="wb-prune", daemon=True).start()
        return self._wb_attach_cache

    def _wb_prune(self) -> None:
        """Unmap kept segments whose file is gone; only where no tensor views them (between updates), since
        ``torch.frombuffer`` views do not pin a mapping."""
        if self._wb_attach_cache is not None and self._wb_stream is None:
            self._wb_attach_cache.prune()

    def _wb_prune_loop(self) -> None:
        """About once a second, between updates: a publisher that went away (or a receiver that trimmed its
        pool) must not leave its segments' memory pinned by this worker until the next update."""
        while True:
            time.sleep(PRUNE_EVERY_S)
            if _BUSY.acquire(blocking=False):
                try:
                    self._wb_prune()
                finally:
                    _BUSY.release()

    # ---- streaming mode: one RPC per bucket (inference_side/streaming.py) -------------------------
    _wb_stream: ReloadSession | None = None
    _wb_stream_segments: list[tuple[Segment, list[Any]]] | None = None  # mapped buckets and their storages

    @_exclusive
    def wb_stream_begin(self, names: list[str], options: dict[str, Any]) -> dict[str, Any]:
        """Open the layerwise reload for an update whose buckets follow one ``wb_stream_load`` each."""
        from vllm.config import set_current_vllm_config

        if self._wb_state is None:
            self.wb_setup()
        assert self._wb_state is not None
        self.wb_stream_abort()  # a reload left open by an update that never ended
        session = ReloadSession(
            self._wb_model(), self.vllm_config.model_config, self._wb_state, names,  # type: ignore[attr-defined]
            router=bool(options.get("router", True)),
            audit=bool(options.get("audit", True)),
            identity=bool(options.get("identity", True)),
        )
        self._wb_stream_segments = []
        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                session.begin()
        except Exception as exc:  # noqa: BLE001 - any failure inside vLLM must come back as a reason
            session.abort()
            return {"ok": False, "rank": self._wb_state.tp_rank, "error": f"{type(exc).__name__}: {exc}"}
        self._wb_stream = session
        return {"ok": True, "rank": self._wb_state.tp_rank}

    @_exclusive
    def wb_stream_load(self, bucket: dict[str, Any]) -> dict[str, Any]:
        """Load one bucket's tensors into the open reload; unmap every earlier bucket nothing holds."""
        from vllm.config import set_current_vllm_config

        rank = self._wb_state.tp_rank if self._wb_state else -1
        session = self._wb_stream
        if session is None or self._wb_stream_segments is None:
            return {"ok": False, "rank": rank, "error": "no streaming update is open on this worker"}
        t0 = time.perf_counter()
        try:
            seg = self._wb_attached().attach(bucket["segment"], bucket["size"])
            views = _views(seg, bucket["tensors"])
            self._wb_stream_segments.append((seg, [t.untyped_storage() for _, t in views]))
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                _load_views(session, views)
            del views
        except Exception as exc:  # noqa: BLE001 - any failure inside vLLM must come back as a reason
            logger.error("streaming load failed in worker: %s", traceback.format_exc())
            return {"ok": False, "rank": rank, "error": f"{type(exc).__name__}: {exc}"}
        self._wb_stream_segments = [(s, st) for s, st in self._wb_stream_segments if not _unmapped(s, st)]
        return {"ok": True, "rank": rank, "seconds": time.perf_counter() - t0,
                "held": [seg.name for seg, _ in self._wb_stream_segments]}

    @_exclusive
    def wb_stream_finish(self) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config

        rank = self._wb_state.tp_rank if self._wb_state else -1
        session, self._wb_stream = self._wb_stream, None
        if session is None:
            return {"ok": False, "rank": rank, "error": "no streaming update is open on this worker"}
        t0 = time.perf_counter()
        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                report = session.finish()
            report["ok"] = True
        except BridgeError as exc:
            session.abort()
            report = {"ok": False, "rank": rank, "error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - any failure inside vLLM must come back as a reason
            session.abort()
            logger.error("streaming finish failed in worker: %s", traceback.format_exc())
            report = {"ok": False, "rank": rank, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            self._wb_unmap_all()
        report["worker_seconds"] = time.perf_counter() - t0
        return report

    @_exclusive
    def wb_stream_abort(self) -> dict[str, Any]:
        """End an open streaming reload after a failure: kernel tensors back in place (a mix of versions)."""
        from vllm.config import set_current_vllm_config

        session, self._wb_stream = self._wb_stream, None
        if session is not None:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                session.abort()
        self._wb_unmap_all()
        return {"ok": True, "rank": self._wb_state.tp_rank if self._wb_state else -1, "aborted": session is not None}

    def _wb_unmap_all(self) -> None:
        for seg, _ in self._wb_stream_segments or []:
            seg.close()
        self._wb_stream_segments = None
        self._wb_prune()

    # ---- benchmark baseline ---------------------------------------------------------------------
    def wb_baseline_reload(self, seed: int) -> dict[str, Any]:
        """The benchmark's baseline B: vLLM's own in-process ``reload_weights`` from a list of tensors
        that already sit in this worker (made here from ``seed``, untimed). Returns the reload's seconds."""
        import torch

        from bridge.checkpoint import read_tensor_table

        table = read_tensor_table(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        dtype = _torch_dtype(self.vllm_config.model_config.dtype.__str__().removeprefix("torch."))  # type: ignore[attr-defined]
        gen = torch.Generator().manual_seed(seed)
        tensors = []
        for name, entry in table.items():
            noise = torch.randn(entry.shape, generator=gen, dtype=torch.float32)
            value = 1.0 + 0.1 * noise if "norm" in name and len(entry.shape) == 1 else 0.05 * noise
            tensors.append((name, value.to(dtype if entry.dtype in ("bfloat16", "float16", "float32") else _torch_dtype(entry.dtype))))
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
        return {"seconds": time.perf_counter() - t0, "bytes": nbytes}

    def _wb_test_only_fail(self, tensors: list[list[Any]]) -> str | None:
        """The armed test-only failure if its tensor is in this bucket (then disarmed), else None."""
        name = self._wb_fail_once
        if name is None or all(t[0] != name for t in tensors):
            return None
        self._wb_fail_once = None
        return name

    def wb_test_only_arm_failure(self, name: str) -> str:
        """Test-only: make the next update raise on this rank when it reaches tensor ``name``."""
        self._wb_fail_once = name
        return name

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

    def wb_bypass(self) -> list[str]:
        return sorted(self._wb_state.bypass) if self._wb_state else []


def _views(seg: Segment, tensors: list[list[Any]]) -> list[tuple[str, Any]]:
    import torch

    out = []
    for name, dtype, shape, offset, nbytes in tensors:
        raw = torch.frombuffer(seg.mm, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else torch.empty(0, dtype=torch.uint8)
        out.append((name, raw.view(_torch_dtype(dtype)).view(tuple(shape))))
    return out


def _load_views(session: ReloadSession, views: list[tuple[str, Any]], fail_at: str | None = None) -> None:
    """Load the views of one bucket (a function, so no loop variable outlives it and pins a mapping).
    ``fail_at``: test-only, raise when that tensor is reached."""
    if fail_at is not None and any(name == fail_at for name, _ in views):
        for name, tensor in views:
            if name == fail_at:
                raise RuntimeError(f"test-only injected failure while loading {name}")
            session.load(name, tensor)
        return
    session.load_many(views)


def _unmapped(seg: Segment, storages: list[Any]) -> bool:
    """Unmap ``seg`` once no tensor views it any more: vLLM's layerwise reload keeps a layer's tensors
    until the layer is complete, and ``torch.frombuffer`` views do not pin the mapping (closing it under
    a live view would leave the view reading unmapped memory). A storage referenced only by ``storages``
    has a use count of 1."""
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or any(use_count(st._cdata) > 1 for st in storages):
        return False
    storages.clear()
    seg.close()
    return True
