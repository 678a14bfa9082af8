"""One weight update inside one TP worker: vLLM's layerwise reload, driven tensor by tensor, with sink
routing (router.py), capture of direct-copy writes (capture.py), a write audit and a storage-identity
check (audit.py).

Lifecycle: ``begin()`` -> ``load(name, tensor)`` for every tensor -> ``finish()`` (or ``abort()``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bridge.errors import AuditError, BridgeError, IdentityError
from bridge.report import RankReport
from inference_side import reload_hooks
from inference_side.audit import (
    StorageKey,
    identity_violations,
    refresh_backend_aliases,
    snapshot,
    stale_tensors,
)
from inference_side.capture import BypassCapture, register_loader
from inference_side.router import SinkLoader, map_checkpoint_name, owning_module_path

logger = logging.getLogger(__name__)


class _RunStopped(BridgeError):
    """Internal: a batched ``load_weights`` run stopped at a tensor that was not written in time."""

@dataclass
class SinkBinding:
    """A checkpoint-backed sink parameter and the attention backend object that reads it."""

    param_path: str
    checkpoint_name: str
    global_heads: int
    impl: Any = None  # attention impl whose ``.sinks`` the kernel reads


@dataclass
class WorkerRouterState:
    """What a worker learns once and keeps across updates."""

    tp_rank: int
    tp_size: int
    sinks: dict[str, SinkBinding] = field(default_factory=dict)  # by vLLM param path
    bypass: set[str] = field(default_factory=set)  # checkpoint names the model writes behind its loaders
    module_names: set[str] = field(default_factory=set)
    cores: frozenset[int] = frozenset()  # the cores vLLM bound the worker to (read at set-up, on its own thread)
    torch_threads: int = 1  # torch's intra-op threads in the worker
    on_cpu: bool = True  # the model's weights are on the CPU


class ReloadSession:
    def __init__(self, model: Any, model_config: Any, state: WorkerRouterState, names: list[str],
                 router: bool = True, audit: bool = True, identity: bool = True, in_place: bool = True,
                 layer_threads: int = 1, layer_cores: set[int] | frozenset[int] = frozenset()) -> None:
        self.model = model
        self.model_config = model_config
        self.state = state
        self.names = names
        self.router = router
        self.audit = audit
        self.identity = identity
        self.in_place = in_place  # loaders write into views of the served tensors (reload_hooks.ScratchPool)
        # layers processed on this many threads bound to these cores (reload_hooks.LayerThreads; 1: inline)
        self.layer_threads, self.layer_cores = layer_threads, frozenset(layer_cores)
        self.timings: dict[str, float] = defaultdict(float)
        self.routed_sinks: dict[str, Any] = {}  # vLLM param path -> expected local shard
        self.skipped: list[str] = []
        self.loaded: list[str] = []
        self.written: set[str] = set()
        self._capture: BypassCapture | None = None  # made in begin, once the tensors' owners are known
        self._param_owner: dict[int, str] = {}
        self._before: dict[str, StorageKey] = {}
        self._begun = False
        self._finalized = False
        self._runs_ok = True  # load_many may hand runs of tensors to one load_weights call
        self.load_calls = 0  # model.load_weights calls this update (one per tensor without runs)

    # ---- lifecycle ---------------------------------------------------------------------------
    def begin(self) -> None:
        import torch
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        t0 = time.perf_counter()
        reload_hooks.install()
        if self.identity:
            self._before = snapshot(self.model, self.state.sinks)
        owner_of = {name: owning_module_path(self.state.module_names, map_checkpoint_name(self.model, name) or name)
                    for name in self.names}
        self._capture = BypassCapture(self.model, self.state.module_names, owner_of)
        rec = reload_hooks.RECORDER
        rec.reset()
        rec.active = True
        reload_hooks.SCRATCH.start(self.in_place)
        reload_hooks.EMBEDDING_GEMM.start(self.model)
        reload_hooks.COUNTS.start(self.model)
        reload_hooks.LAYERS.start(self.layer_threads, self.layer_cores)
        with torch.no_grad():
            initialize_layerwise_reload(self.model)
        self._begun = True
        for path, module in self.model.named_modules():
            for _pname, param in module._parameters.items():
                if param is not None:
                    self._param_owner[id(param)] = path
        if self.router:
            for path in self.state.sinks:
                register_loader(self.model, path, SinkLoader(self.state.tp_rank, self.state.tp_size, path))
        self.timings["begin"] += time.perf_counter() - t0

    def load(self, name: str, tensor: Any) -> None:
        """Load one tensor. A layer it completed may still be processing on the layer threads when this returns
        (``finish`` waits for them); one that failed already is raised here."""
        self._load_one(name, tensor)
        reload_hooks.LAYERS.check()

    def _load_one(self, name: str, tensor: Any) -> None:
        import torch

        t0 = time.perf_counter()
        rec = reload_hooks.RECORDER
        mapped = map_checkpoint_name(self.model, name)
        self.loaded.append(name)
        with torch.no_grad():
            if mapped is None or self._pp_missing(mapped):
                self.skipped.append(name)
            elif self.router and mapped in self.state.sinks:
                rec.current = name
                placeholder = self._placeholder(mapped)
                placeholder.weight_loader(placeholder, tensor)
                binding = self.state.sinks[mapped]
                from inference_side.router import sink_head_range

                rng = sink_head_range(int(tensor.shape[0]), int(placeholder.shape[0]),
                                      self.state.tp_rank, self.state.tp_size, mapped)
                self.routed_sinks[mapped] = (tensor.narrow(0, rng.start, rng.count).clone(), rng, binding)
            elif self.router and name in self.state.bypass:
                self._captured().capture(name, tensor)
            else:
                rec.current = name
                self.load_calls += 1
                self.model.load_weights([(name, tensor)])
                if name not in rec.writes and self.router and tensor.is_floating_point():
                    logger.info("%s was written behind its weight loader; routing it", name)
                    self.state.bypass.add(name)
                    self._captured().capture(name, tensor)
            rec.current = None
            self._captured().done(name)
        self.timings["load"] += time.perf_counter() - t0

    def load_many(self, items: Iterable[tuple[str, Any]]) -> None:
        """Load tensors in order, like :meth:`load`, but hand each run of plainly loaded tensors to
        ``model.load_weights`` as one iterator (as vLLM's own reload does): the model's loader set-up
        (module walks, name maps) then runs once per run instead of once per tensor. Sinks, known
        bypass tensors and skipped names still go one by one. The recorder still attributes every write
        to its tensor: the iterator names the tensor it hands out before the model loads it."""
        run: list[tuple[str, Any]] = []
        for name, tensor in items:
            mapped = map_checkpoint_name(self.model, name)
            special = (mapped is None or self._pp_missing(mapped)
                       or (self.router and (mapped in self.state.sinks or name in self.state.bypass)))
            if special:
                self._load_run(run)
                run = []
                self._load_one(name, tensor)
            else:
                run.append((name, tensor))
        self._load_run(run)
        reload_hooks.LAYERS.check()

    def _load_run(self, run: list[tuple[str, Any]]) -> None:
        """One ``load_weights`` call for ``run``. The iterator checks, before handing out tensor i+1, that
        tensor i was written: a model that reads ahead (collects its weights first, e.g. into a dict) or
        a tensor written behind its loader's back stops the run there, before anything of the tensor was
        lost, and the rest of this update loads tensor by tensor (:meth:`load`)."""
        import torch

        if len(run) <= 1 or not self._runs_ok:
            for name, tensor in run:
                self._load_one(name, tensor)
            return
        t0 = time.perf_counter()
        rec = reload_hooks.RECORDER
        handed: list[str] = []

        def feed() -> Iterator[tuple[str, Any]]:
            for name, tensor in run:
                if handed and handed[-1] not in rec.writes:
                    raise _RunStopped(handed[-1])
                rec.current = name
                handed.append(name)
                yield name, tensor
            rec.current = None

        stopped = False
        with torch.no_grad():
            try:
                self.load_calls += 1
                self.model.load_weights(feed())
            except _RunStopped as stop:
                logger.info("%s: not written before the next tensor was asked for; loading tensor by tensor", stop)
                stopped, self._runs_ok = True, False
            finally:
                rec.current = None
            written = handed[:-1] if stopped else handed
            self.loaded.extend(written)
            for name, tensor in run[: len(written)]:
                if name not in rec.writes and self.router and tensor.is_floating_point():
                    logger.info("%s was written behind its weight loader; routing it", name)
                    self.state.bypass.add(name)
                    self._captured().capture(name, tensor)
                self._captured().done(name)
        self.timings["load"] += time.perf_counter() - t0
        for name, tensor in run[len(written):]:
            self._load_one(name, tensor)

    def finish(self) -> RankReport:
        import torch
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        with torch.no_grad():
            self._captured().flush_all()
            reload_hooks.LAYERS.wait()  # the layers still processing on threads: their time counts as finalize
            reload_hooks.LAYERS.active = False  # finalize processes what is left inline
            finalize_layerwise_reload(self.model, self.model_config)
            self._finalized = True
            reload_hooks.RECORDER.active = False
            reload_hooks.SCRATCH.active = False
            reload_hooks.EMBEDDING_GEMM.active = False
            reload_hooks.COUNTS.active = False
            self.timings["finalize"] += time.perf_counter() - t0
            t1 = time.perf_counter()
            refreshed = refresh_backend_aliases(self.model, self.state.sinks)
            problems = stale_tensors(self.model, self.loaded, self.skipped, self._param_owner, self.routed_sinks,
                                     self.state.sinks) if self.audit else []
            moved = identity_violations(self._before, snapshot(self.model, self.state.sinks)) if self.identity else []
        self.timings["verify"] += time.perf_counter() - t1
        report = RankReport(
            self.state.tp_rank, seconds=dict(self.timings), tensors=len(self.loaded),
            stale=tuple(problems), identity_violations=tuple(moved),
            routed_sinks=tuple(sorted(self.routed_sinks)), routed_bypass=tuple(sorted(set(self._captured().routed))),
            load_calls=self.load_calls, runs_stopped=not self._runs_ok, skipped=tuple(self.skipped),
            aliases_refreshed=refreshed,
        )
        if problems or moved:
            reload_hooks.SCRATCH.drop()
            reload_hooks.COUNTS.forget()  # nothing a failed update counted is reused
        if problems:
            raise AuditError("stale after update: " + "; ".join(problems), problems)
        if moved:
            raise IdentityError("storage changed during update: " + "; ".join(moved), moved)
        reload_hooks.SCRATCH.settle()  # the reload's large scratch tensors, for the next update
        return report

    def abort(self) -> None:
        """Put kernel tensors back after a failure mid-load (the model never stays on meta)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        reload_hooks.LAYERS.stop()  # layers still being processed end first
        reload_hooks.RECORDER.active = False
        reload_hooks.SCRATCH.active = False
        reload_hooks.EMBEDDING_GEMM.active = False
        reload_hooks.SCRATCH.drop()
        reload_hooks.COUNTS.forget()
        if self._begun and not self._finalized:
            import torch

            with torch.no_grad():
                finalize_layerwise_reload(self.model, self.model_config)
            self._finalized = True

    # ---- routing internals --------------------------------------------------------------------
    def _captured(self) -> BypassCapture:
        assert self._capture is not None, "begin() first"
        return self._capture

    def _pp_missing(self, path: str) -> bool:
        from vllm.model_executor.models.utils import PPMissingLayer

        parts = path.split(".")
        module = self.model
        for part in parts[:-1]:
            module = getattr(module, part, None)
            if module is None:
                return False
            if isinstance(module, PPMissingLayer):
                return True
        return False

    def _placeholder(self, path: str) -> Any:
        module_path, _, pname = path.rpartition(".")
        return self.model.get_submodule(module_path)._parameters[pname]

