"""One weight update inside one TP worker: vLLM's layerwise reload, driven tensor by tensor,
with sink routing, capture of direct-copy writes, a write audit and a storage-identity check.

Lifecycle: ``begin()`` -> ``load(name, tensor)`` for every tensor -> ``finish()`` (or ``abort()``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bridge.errors import AuditError, BridgeError, IdentityError, RouterError
from bridge.report import RankReport
from inference_side import reload_hooks
from inference_side.router import RoutedLoader, SinkLoader, map_checkpoint_name, owning_module_path

logger = logging.getLogger(__name__)


class _RunStopped(BridgeError):
    """Internal: a batched ``load_weights`` run stopped at a tensor that was not written in time."""

StorageKey = tuple[int, tuple[int, ...], str, str]


def storage_key(t: Any) -> StorageKey:
    try:
        ptr = int(t.untyped_storage().data_ptr())
    except (RuntimeError, ValueError):
        ptr = -1
    return (ptr, tuple(t.shape), str(t.dtype), str(t.device))


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


class ReloadSession:
    def __init__(self, model: Any, model_config: Any, state: WorkerRouterState, names: list[str],
                 router: bool = True, audit: bool = True, identity: bool = True) -> None:
        self.model = model
        self.model_config = model_config
        self.state = state
        self.names = names
        self.router = router
        self.audit = audit
        self.identity = identity
        self.timings: dict[str, float] = defaultdict(float)
        self.routed_sinks: dict[str, Any] = {}  # vLLM param path -> expected local shard
        self.routed_bypass: list[str] = []
        self.skipped: list[str] = []
        self.loaded: list[str] = []
        self.written: set[str] = set()
        self._staged: dict[str, Any] = {}
        self._contributors: dict[str, set[str]] = defaultdict(set)
        self._pending: dict[str, int] = defaultdict(int)
        self._owner_of: dict[str, str] = {}
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
            self._before = self.snapshot()
        for name in self.names:
            owner = owning_module_path(self.state.module_names, map_checkpoint_name(self.model, name) or name)
            self._owner_of[name] = owner
            self._pending[owner] += 1
        rec = reload_hooks.RECORDER
        rec.reset()
        rec.active = True
        with torch.no_grad():
            initialize_layerwise_reload(self.model)
        self._begun = True
        for path, module in self.model.named_modules():
            for _pname, param in module._parameters.items():
                if param is not None:
                    self._param_owner[id(param)] = path
        if self.router:
            for path in self.state.sinks:
                self._register(path, SinkLoader(self.state.tp_rank, self.state.tp_size, path))
        self.timings["begin"] += time.perf_counter() - t0

    def load(self, name: str, tensor: Any) -> None:
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
                self._capture(name, tensor)
            else:
                rec.current = name
                self.load_calls += 1
                self.model.load_weights([(name, tensor)])
                if name not in rec.writes and self.router and tensor.is_floating_point():
                    logger.info("%s was written behind its weight loader; routing it", name)
                    self.state.bypass.add(name)
                    self._capture(name, tensor)
            rec.current = None
            self._done(name)
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
                self.load(name, tensor)
            else:
                run.append((name, tensor))
        self._load_run(run)

    def _load_run(self, run: list[tuple[str, Any]]) -> None:
        """One ``load_weights`` call for ``run``. The iterator checks, before handing out tensor i+1, that
        tensor i was written: a model that reads ahead (collects its weights first, e.g. into a dict) or
        a tensor written behind its loader's back stops the run there, before anything of the tensor was
        lost, and the rest of this update loads tensor by tensor (:meth:`load`), as before."""
        import torch

        if len(run) <= 1 or not self._runs_ok:
            for name, tensor in run:
                self.load(name, tensor)
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
                    self._capture(name, tensor)
                self._done(name)
        self.timings["load"] += time.perf_counter() - t0
        for name, tensor in run[len(written):]:
            self.load(name, tensor)

    def finish(self) -> RankReport:
        import torch
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        with torch.no_grad():
            for owner in self._owners_with_staged():
                self._flush(owner)
            finalize_layerwise_reload(self.model, self.model_config)
            self._finalized = True
            reload_hooks.RECORDER.active = False
            self.timings["finalize"] += time.perf_counter() - t0
            t1 = time.perf_counter()
            refreshed = self._refresh_backend_aliases()
            problems = self._audit() if self.audit else []
            moved = self._identity_violations() if self.identity else []
        self.timings["verify"] += time.perf_counter() - t1
        report = RankReport(
            self.state.tp_rank, seconds=dict(self.timings), tensors=len(self.loaded),
            stale=tuple(problems), identity_violations=tuple(moved),
            routed_sinks=tuple(sorted(self.routed_sinks)), routed_bypass=tuple(sorted(set(self.routed_bypass))),
            load_calls=self.load_calls, runs_stopped=not self._runs_ok, skipped=tuple(self.skipped),
            aliases_refreshed=refreshed,
        )
        if problems:
            raise AuditError("stale after update: " + "; ".join(problems), problems)
        if moved:
            raise IdentityError("storage changed during update: " + "; ".join(moved), moved)
        return report

    def abort(self) -> None:
        """Put kernel tensors back after a failure mid-load (the model never stays on meta)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        reload_hooks.RECORDER.active = False
        if self._begun and not self._finalized:
            import torch

            with torch.no_grad():
                finalize_layerwise_reload(self.model, self.model_config)
            self._finalized = True

    # ---- storage identity ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, StorageKey]:
        out = {f"param:{n}": storage_key(p) for n, p in self.model.named_parameters()}
        out.update({f"buffer:{n}": storage_key(b) for n, b in self.model.named_buffers()})
        for path, binding in self.state.sinks.items():
            impl_sinks = getattr(binding.impl, "sinks", None)
            if impl_sinks is not None:
                out[f"backend:{path}"] = storage_key(impl_sinks)
        return out

    def _identity_violations(self) -> list[str]:
        after = self.snapshot()
        bad = []
        for key, value in self._before.items():
            now = after.get(key)
            if now != value:
                bad.append(f"{key} {value} -> {now}")
        return bad

    # ---- routing internals --------------------------------------------------------------------
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

    def _register(self, path: str, loader: Any) -> None:
        """Make ``loader`` the original loader under the reload's wrapper of placeholder ``path``."""
        from vllm.model_executor.model_loader.reload.layerwise import make_online_process_loader

        module_path, _, pname = path.rpartition(".")
        module = self.model.get_submodule(module_path)
        placeholder = module._parameters[pname]
        placeholder.weight_loader = loader
        placeholder.weight_loader = make_online_process_loader(module, pname)

    def _capture(self, name: str, tensor: Any) -> None:
        """Run the model's own load code for ``name`` against real scratch tensors (NaN-filled) put in
        place of the meta placeholders of its owning module; keep what it wrote, staged per parameter."""
        import torch
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

        owner = self._owner_of.get(name) or owning_module_path(self.state.module_names, map_checkpoint_name(self.model, name) or name)
        root = self.model.get_submodule(owner) if owner else self.model
        swapped: list[tuple[Any, str, Any, Any, str]] = []
        for sub_path, sub in root.named_modules(prefix=owner):
            for pname, param in list(sub._parameters.items()):
                if param is None or not param.is_meta or not param.is_floating_point():
                    continue
                scratch = materialize_meta_tensor(param)
                scratch.data.fill_(float("nan"))
                sub._parameters[pname] = scratch
                swapped.append((sub, pname, param, scratch, f"{sub_path}.{pname}" if sub_path else pname))
        try:
            self.model.load_weights([(name, tensor.clone())])
        finally:
            for sub, pname, placeholder, _, _ in swapped:
                sub._parameters[pname] = placeholder
        hit = False
        for _, _, _, scratch, qual in swapped:
            mask = ~torch.isnan(scratch.data)
            if not bool(mask.any()):
                continue
            hit = True
            staged = self._staged.get(qual)
            if staged is None:
                staged = torch.full_like(scratch.data, float("nan"))
                self._staged[qual] = staged
            staged[mask] = scratch.data[mask]
            self._contributors[qual].add(name)
        if not hit:
            raise RouterError(f"{name}: the model's loader wrote it to no parameter of module '{owner}'")
        self.routed_bypass.append(name)

    def _done(self, name: str) -> None:
        owner = self._owner_of.get(name, "")
        self._pending[owner] -= 1
        if self._pending[owner] <= 0 and owner in self._owners_with_staged():
            self._flush(owner)

    def _owners_with_staged(self) -> set[str]:
        return {self._owner_for_param(q) for q in self._staged}

    def _owner_for_param(self, qual: str) -> str:
        for owner in sorted(set(self._owner_of.values()), key=len, reverse=True):
            if owner and qual.startswith(owner + "."):
                return owner
        return ""

    def _flush(self, owner: str) -> None:
        import torch

        rec = reload_hooks.RECORDER
        for qual in [q for q in self._staged if self._owner_for_param(q) == owner]:
            staged = self._staged.pop(qual)
            contributors = sorted(self._contributors.pop(qual))
            missing = int(torch.isnan(staged).sum())
            if missing:
                raise RouterError(f"{qual}: tensors {contributors} left {missing} of {staged.numel()} elements unwritten")
            module_path, _, pname = qual.rpartition(".")
            module = self.model.get_submodule(module_path)
            placeholder = module._parameters[pname]
            from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader

            original = _get_original_loader(placeholder)
            if not isinstance(original, RoutedLoader):
                self._register(qual, RoutedLoader(original))
                placeholder = module._parameters[pname]
            rec.current = contributors[0]
            placeholder.weight_loader(placeholder, staged, wb_routed=True)
            for c in contributors:
                rec.writes.setdefault(c, []).extend(rec.writes.get(contributors[0], [])[-1:])
            rec.current = None

    # ---- audit --------------------------------------------------------------------------------
    def _audit(self) -> list[str]:
        import torch

        rec = reload_hooks.RECORDER
        problems: list[str] = []
        skipped = set(self.skipped)
        for name in self.loaded:
            if name in skipped:
                continue
            if not rec.writes.get(name):
                problems.append(f"{name}: sent but never written through a weight loader (stale)")
                continue
            owners = {self._param_owner.get(pid) for pid, _ in rec.writes[name]}
            for owner in owners:
                if owner is None:
                    continue
                module = self.model.get_submodule(owner) if owner else self.model
                if id(module) not in rec.processed_layers:
                    problems.append(f"{name}: layer '{owner}' was not copied into its kernel tensors (stale)")
        for path, (expected, rng, _binding) in self.routed_sinks.items():
            live = self.model.get_parameter(path)
            got = live.data[: rng.count]
            if not torch.equal(got, expected.to(live.dtype)):
                problems.append(f"{path}: live sinks differ from the sent shard (stale)")
            if rng.padded > rng.count and not bool(torch.isneginf(live.data[rng.count :]).all()):
                problems.append(f"{path}: padded sink heads are not -inf")
        problems.extend(self._alias_problems())
        return problems

    def _refresh_backend_aliases(self) -> int:
        """Where an attention backend keeps its own converted copy of the sinks, refresh it in place."""
        refreshed = 0
        for path, binding in self.state.sinks.items():
            impl_sinks = getattr(binding.impl, "sinks", None)
            if impl_sinks is None:
                continue
            param = self.model.get_parameter(path)
            if storage_key(impl_sinks)[0] == storage_key(param)[0]:
                continue
            n = min(impl_sinks.shape[0], param.shape[0])
            import torch

            with torch.inference_mode():  # the backend made its copy inside a forward pass
                impl_sinks[:n].copy_(param.data[:n].to(impl_sinks.dtype))
            refreshed += 1
        return refreshed

    def _alias_problems(self) -> list[str]:
        import torch

        problems = []
        for path, binding in self.state.sinks.items():
            impl_sinks = getattr(binding.impl, "sinks", None)
            if impl_sinks is None:
                continue
            param = self.model.get_parameter(path)
            n = min(impl_sinks.shape[0], param.shape[0])
            if not torch.equal(impl_sinks.data[:n], param.data[:n].to(impl_sinks.dtype)):
                problems.append(f"{path}: the attention backend's sinks copy differs from the parameter (stale)")
        return problems
