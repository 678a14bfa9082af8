"""Hooks on vLLM's layerwise reload.

Observation: which parameter received which write, which layer was copied back into its kernel
tensors. One repair: vLLM 0.32's unquantized MoE skips the experts' own kernel-format step on a
weight update (``_setup_kernel`` only runs ``fused_experts.process_weights_after_loading`` on the first
load), so on CPU the reloaded experts are copied back in checkpoint layout instead of the prepacked
layout the kernel reads. ``refresh_kernel_format`` runs that step on the freshly loaded layer before
it is copied into the kernel tensors."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadRecorder:
    """Collects, for the tensor being loaded now, every loader-routed write and every processed layer."""

    current: str | None = None
    writes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # tensor -> [(id(param), numel)]
    processed_layers: set[int] = field(default_factory=set)  # id(module) copied into kernel storage
    active: bool = False

    def reset(self) -> None:
        self.current = None
        self.writes.clear()
        self.processed_layers.clear()


_LOCK = threading.Lock()
_INSTALLED = False
RECORDER = LoadRecorder()


def install() -> None:
    """Patch vLLM's layerwise module once per process (idempotent)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        from vllm.model_executor.model_loader.reload import layerwise

        original_numel = layerwise.get_numel_loaded
        original_copy = layerwise._copy_and_restore_kernel_tensors

        def get_numel_loaded(weight_loader: Any, args: Any) -> tuple[int, object]:
            numel, ret = original_numel(weight_loader, args)
            if RECORDER.active and RECORDER.current is not None:
                param = args.arguments.get("param")
                RECORDER.writes.setdefault(RECORDER.current, []).append((id(param), int(numel)))
            return numel, ret

        def copy_and_restore(layer: Any, info: Any) -> None:
            refresh_kernel_format(layer)
            original_copy(layer, info)
            if RECORDER.active:
                RECORDER.processed_layers.add(id(layer))

        layerwise.get_numel_loaded = get_numel_loaded
        layerwise._copy_and_restore_kernel_tensors = copy_and_restore
        _INSTALLED = True


def refresh_kernel_format(layer: Any) -> bool:
    """Re-run an unquantized MoE layer's expert kernel-format step (CPU prepack) after a reload."""
    method = getattr(layer, "quant_method", None)
    if type(method).__name__ != "UnquantizedFusedMoEMethod":
        return False
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    step = getattr(experts, "process_weights_after_loading", None)
    if step is None:
        return False
    from vllm.model_executor.utils import is_weights_pre_processed

    if is_weights_pre_processed():
        return False
    step(layer)
    return True
