"""Hooks on vLLM's layerwise reload.

Observation: which parameter received which write, which layer was copied back into its kernel
tensors. One repair: vLLM 0.32's unquantized MoE skips the experts' own kernel-format step on a
weight update (``_setup_kernel`` only runs ``fused_experts.process_weights_after_loading`` on the first
load), so on CPU the reloaded experts are copied back in checkpoint layout instead of the prepacked
layout the kernel reads. ``refresh_kernel_format`` runs that step on the freshly loaded layer before
it is copied into the kernel tensors.

One saving: ``SCRATCH`` keeps the large CPU tensors the reload materializes for the bridge's own updates
(an embedding, an LM head) from one update to the next, so each update writes into memory already mapped
instead of faulting in a fresh mmap page by page (65 MB: 16,000 page faults, 40-90 ms against 8 ms for the
copy itself on the 2-core test VM). vLLM's own ``reload_weights`` is left as it is."""

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


class ScratchPool:
    """The layerwise reload's materialized CPU tensors of at least ``min_bytes``, kept between the bridge's
    updates (while ``active``) and lent again to the next update's materialization of the same size.

    Contract: a tensor returns to the pool only after an update that succeeded (``settle``, after the
    write audit and the storage-identity check), and only when nothing but the pool refers to it or to its
    storage (no Python reference, no other tensor or kernel handle on the storage): the model, its kernel
    handles and vLLM's reload state hold none of it then, so writing into it later cannot reach what the
    engine serves. A failed or aborted update lets its tensors go (``drop``). Memory: the kept tensors'
    bytes, held between updates (the embedding and the LM head: 66 MB at 50m, 130 MB at 350m, about 2 GB on a 7B model
    with a 150k vocabulary); on GPUs nothing is kept (the caching allocator already reuses memory)."""

    # glibc maps an allocation above its mmap threshold afresh each time (the threshold follows freed
    # mappings up to 32 MiB); from 16 MiB on, every such tensor is kept
    MIN_BYTES = 16 << 20

    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self.active = False
        self.free: dict[int, list[Any]] = {}  # storage bytes -> untyped storages
        self.lent: list[Any] = []  # tensors materialized during the update in progress

    @property
    def nbytes(self) -> int:
        return sum(k * len(v) for k, v in self.free.items())

    def materialize(self, original: Any, meta_tensor: Any) -> Any:
        import torch

        if not self.active:
            return original(meta_tensor)
        size, stride = tuple(meta_tensor.size()), tuple(meta_tensor.stride())
        span = 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) if all(size) else 0
        nbytes = span * meta_tensor.element_size()
        if nbytes < self.min_bytes:
            return original(meta_tensor)
        probe = torch.empty(0, dtype=meta_tensor.dtype)  # on the device the reload's context names
        if probe.device.type != "cpu":
            return original(meta_tensor)
        pooled = self.free.get(nbytes)
        if not pooled:
            tensor = original(meta_tensor)
        else:
            tensor = probe.set_(pooled.pop(), 0, size, stride)
            tensor.requires_grad_(False)
            tensor.__class__ = meta_tensor.__class__
            tensor.__dict__ = meta_tensor.__dict__.copy()
        self.lent.append(tensor)
        return tensor

    def settle(self) -> None:
        """After a successful update: keep what nothing else refers to, let the rest go."""
        import sys

        import torch

        lent, self.lent = self.lent, []
        while lent:
            tensor = lent.pop()
            storage = tensor.untyped_storage()
            # Python references: the local name and getrefcount's argument; C++ owners of the tensor: none
            # but its Python object; users of its storage: the tensor and `storage`
            if (sys.getrefcount(tensor) == 2 and tensor._use_count() == 1
                    and torch._C._storage_Use_Count(storage._cdata) == 2):
                self.free.setdefault(int(storage.nbytes()), []).append(storage)
            del tensor, storage

    def drop(self) -> None:
        self.lent.clear()


_LOCK = threading.Lock()
_INSTALLED = False
RECORDER = LoadRecorder()
SCRATCH = ScratchPool()


def install() -> None:
    """Patch vLLM's layerwise module once per process (idempotent)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        from vllm.model_executor.model_loader.reload import layerwise, meta

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

        original_materialize = meta.materialize_meta_tensor

        def materialize_meta_tensor(meta_tensor: Any) -> Any:
            return SCRATCH.materialize(original_materialize, meta_tensor)

        layerwise.get_numel_loaded = get_numel_loaded
        layerwise._copy_and_restore_kernel_tensors = copy_and_restore
        meta.materialize_meta_tensor = materialize_meta_tensor
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
