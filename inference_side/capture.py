"""Bypass capture: tensors a model writes behind its parameters' loaders (a direct ``param.data.copy_``,
lost during vLLM's layerwise reload) are captured and routed through the current loader.

The model's own load code runs for such a tensor against NaN-filled scratch tensors put in place of the
meta placeholders of its owning module; what it wrote is staged per parameter. Once every tensor owned
by that module arrived, each staged parameter is handed to its placeholder's loader (a ``RoutedLoader``),
so vLLM sees an ordinary write and copies the layer back into its kernel tensors."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bridge.errors import RouterError
from inference_side import reload_hooks
from inference_side.router import RoutedLoader, map_checkpoint_name, owning_module_path


def register_loader(model: Any, path: str, loader: Any) -> None:
    """Make ``loader`` the original loader under the reload's wrapper of placeholder ``path``."""
    from vllm.model_executor.model_loader.reload.layerwise import make_online_process_loader

    module_path, _, pname = path.rpartition(".")
    module = model.get_submodule(module_path)
    placeholder = module._parameters[pname]
    placeholder.weight_loader = loader
    placeholder.weight_loader = make_online_process_loader(module, pname)


class BypassCapture:
    """One update's captured writes. ``owner_of`` maps each tensor of the update to its owning module."""

    def __init__(self, model: Any, module_names: set[str], owner_of: dict[str, str]) -> None:
        self.model = model
        self.module_names = module_names
        self.owner_of = owner_of
        self.routed: list[str] = []  # tensors captured this update
        self._staged: dict[str, Any] = {}  # parameter path -> values written so far (NaN: not yet)
        self._contributors: dict[str, set[str]] = defaultdict(set)
        self._pending: dict[str, int] = defaultdict(int)  # owning module -> tensors of it still to arrive
        for owner in owner_of.values():
            self._pending[owner] += 1

    def capture(self, name: str, tensor: Any) -> None:
        """Run the model's load code for ``name`` on scratch tensors; stage what it wrote."""
        import torch
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

        owner = self.owner_of.get(name) or owning_module_path(self.module_names, map_checkpoint_name(self.model, name) or name)
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
        self.routed.append(name)

    def done(self, name: str) -> None:
        """Tensor ``name`` was loaded (or captured): once its module has all of its tensors, flush it."""
        owner = self.owner_of.get(name, "")
        self._pending[owner] -= 1
        if self._pending[owner] <= 0 and owner in self._owners_with_staged():
            self._flush(owner)

    def flush_all(self) -> None:
        """Hand every staged parameter to its loader (before vLLM finalizes the reload)."""
        for owner in self._owners_with_staged():
            self._flush(owner)

    def _owners_with_staged(self) -> set[str]:
        return {self._owner_for_param(q) for q in self._staged}

    def _owner_for_param(self, qual: str) -> str:
        for owner in sorted(set(self.owner_of.values()), key=len, reverse=True):
            if owner and qual.startswith(owner + "."):
                return owner
        return ""

    def _flush(self, owner: str) -> None:
        import torch
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader

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
            original = _get_original_loader(placeholder)
            if not isinstance(original, RoutedLoader):
                register_loader(self.model, qual, RoutedLoader(original))
                placeholder = module._parameters[pname]
            rec.current = contributors[0]
            placeholder.weight_loader(placeholder, staged, wb_routed=True)
            for c in contributors:
                rec.writes.setdefault(c, []).extend(rec.writes.get(contributors[0], [])[-1:])
            rec.current = None
