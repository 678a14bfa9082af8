"""Hooks on vLLM's layerwise reload.

Observation: which parameter received which write, which layer was copied back into its kernel
tensors. One repair: vLLM 0.32's unquantized MoE skips the experts' own kernel-format step on a
weight update (``_setup_kernel`` only runs ``fused_experts.process_weights_after_loading`` on the first
load), so on CPU the reloaded experts are copied back in checkpoint layout instead of the prepacked
layout the kernel reads. ``refresh_kernel_format`` runs that step on the freshly loaded layer before
it is copied into the kernel tensors.

Three savings, during the bridge's own updates only (vLLM's own ``reload_weights`` is left as it is):
``SCRATCH.materialize_layer`` materializes each reloaded tensor as a view of the tensor the engine serves
(``serve.reload_in_place``), so the loaders write into it and vLLM's copy back is a copy onto itself; and
where a tensor cannot be a view (or in place is off), ``SCRATCH`` keeps the large CPU tensors the reload
materializes (an embedding, an LM head) from one update to the next, so each update writes into memory
already mapped instead of faulting in a fresh mmap page by page (65 MB: 16,000 page faults, 40-90 ms against
8 ms for the copy itself on the 2-core test VM); ``EMBEDDING_GEMM`` builds no CPU matmul handle for an input
embedding that no LM head is (``lookup_only_embeddings``); ``COUNTS`` reuses the element counts of the loaders'
meta runs; and ``LAYERS`` processes complete layers on a few threads while the worker goes on loading."""

from __future__ import annotations

import threading
from collections import Counter
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
    """Where the layerwise reload materializes tensors during the bridge's updates (while ``active``): views
    of the served tensors (``materialize_layer``, when ``in_place``), else fresh memory, of which CPU tensors
    of at least ``min_bytes`` are kept between updates and lent again to the next update's materialization
    of the same size.

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
        self._lock = threading.Lock()  # layers may materialize on several threads (LayerThreads)
        self.active = False
        self.free: dict[int, list[Any]] = {}  # storage bytes -> untyped storages
        self.lent: list[Any] = []  # tensors materialized during the update in progress
        self.in_place = True  # materialize_layer: views of the served tensors where they fit
        # bytes the update in progress (or the last one) materialized as views of served tensors, lent from
        # the pool, or allocated afresh
        self.materialized = {"in_place": 0, "pooled": 0, "fresh": 0}

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
            self._count("fresh", nbytes)
            return original(meta_tensor)
        probe = torch.empty(0, dtype=meta_tensor.dtype)  # on the device the reload's context names
        if probe.device.type != "cpu":
            self._count("fresh", nbytes)
            return original(meta_tensor)
        with self._lock:
            pooled = self.free.get(nbytes)
            storage = pooled.pop() if pooled else None
            self.materialized["fresh" if storage is None else "pooled"] += nbytes
        if storage is None:
            tensor = original(meta_tensor)
        else:
            tensor = probe.set_(storage, 0, size, stride)
            tensor.requires_grad_(False)
            tensor.__class__ = meta_tensor.__class__
            tensor.__dict__ = meta_tensor.__dict__.copy()
        with self._lock:
            self.lent.append(tensor)
        return tensor

    def _count(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.materialized[kind] += nbytes

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

    def start(self, in_place: bool) -> None:
        """An update of the bridge begins: lend and view from now on (``active``), counts from zero."""
        self.drop()  # whatever an earlier update left lent
        self.in_place = in_place
        self.materialized = dict.fromkeys(self.materialized, 0)
        self.active = True

    def materialize_layer(self, original: Any, layer: Any, info: Any) -> None:
        """vLLM's ``materialize_layer``, except that during the bridge's updates (``active`` and ``in_place``) a
        parameter or buffer whose kernel tensor has its dtype, size and strides is materialized as a view of
        that kernel tensor's storage: the loaders write into the served tensor itself, vLLM's copy back into
        it is then a copy onto itself (which torch skips), and nothing is allocated. The rest materialize as
        before (fresh, or lent by ``materialize``).

        Contract (why this loads what a fresh tensor loads): a layer's processing after loading reads only
        what its loaders wrote (vLLM materializes with ``torch.empty``, so nothing may rely on the prior
        content either way) and vLLM copies its result into the kernel tensors, which are these storages.
        Between ``initialize_layerwise_reload`` and the layer's copy back the served tensors are not on the
        module (they wait in ``info.kernel_tensors``) and generation waits for the update, so no forward
        reads a half-written layer. A failure after loading began already leaves the engine between two
        versions (degraded, or restored from the host copy or the delta store): with views, the failing
        layer may be part-written too. Views are never lent to the pool."""
        import torch
        from vllm.model_executor.model_loader.reload import meta

        kernel = info.kernel_tensors
        if self.active and self.in_place and kernel is not None and layer.__class__.__name__ not in meta.SKIP_MODULES:
            params, buffers = kernel
            for name, tensor in meta.get_layer_tensors(layer).items():
                if name in meta.SKIP_TENSORS or not tensor.is_meta:
                    continue
                served = params.get(name) if name in params else buffers.get(name)
                if (served is None or served.is_meta or served.dtype != tensor.dtype
                        or tuple(served.size()) != tuple(tensor.size()) or served.stride() != tensor.stride()):
                    continue
                view = torch.empty(0, dtype=served.dtype, device=served.device)
                view.set_(served.untyped_storage(), served.storage_offset(), served.size(), served.stride())
                view.requires_grad_(False)
                view.__class__ = tensor.__class__
                view.__dict__ = tensor.__dict__.copy()
                setattr(layer, name, view)
                self._count("in_place", served.numel() * served.element_size())
        original(layer, info)


def _class_names(obj: Any) -> set[str]:
    return {klass.__name__ for klass in type(obj).__mro__}


def lookup_only_embeddings(model: Any) -> set[int]:
    """The ids of ``model``'s input embeddings that serve only as lookup tables: no LM head is one of them.

    vLLM's CPU backend builds a oneDNN matmul handle (a repacked copy of the weight) for every
    ``VocabParallelEmbedding`` after it loads, the input embedding's included, since a tied LM head is that same
    module; an input embedding only looks rows up (``F.embedding`` on its weight), so for it the handle is pure
    cost: 0.066 s per update and a 65 MB copy at 350m on the 2-core test VM. An embedding counts as lookup-only
    when the model has an LM head of its own (a ``ParallelLMHead`` that is a distinct module), the embedding is
    not a ``ParallelLMHead`` itself, and it is reachable under one name only (not tied by reference). A model
    with no ``ParallelLMHead`` (gemma2, commandr: they compute logits from the input embedding) gets none.
    Pure: reads the module tree, changes nothing."""
    modules = list(model.named_modules(remove_duplicate=False))
    heads = {id(m) for _, m in modules if "ParallelLMHead" in _class_names(m)}
    if not heads:
        return set()
    names = Counter(id(m) for _, m in modules)
    return {id(m) for _, m in modules
            if "VocabParallelEmbedding" in _class_names(m) and id(m) not in heads and names[id(m)] == 1}


class EmbeddingGemm:
    """During the bridge's updates (``active``), the input embeddings in ``lookup_only`` whose weight is on CPU get
    no CPU matmul handle after loading: their ``cpu_linear`` becomes ``torch.nn.functional.linear`` on the current weight (what
    vLLM itself sets for a layer without a handle), so nothing stale can be read through it, and the cold load's
    handle (a packed copy of the old weight) is let go. ``skipped`` counts the handles the last update did not
    build. vLLM's own ``reload_weights`` is left as it is."""

    def __init__(self) -> None:
        self.active = False
        self.lookup_only: set[int] = set()
        self.skipped = 0

    def start(self, model: Any) -> None:
        self.lookup_only = lookup_only_embeddings(model)
        self.skipped = 0
        self.active = True

    def process(self, original: Any, method: Any, layer: Any) -> None:
        """vLLM's ``process_weights_after_loading`` of an unquantized embedding (``original``), but for a
        lookup-only embedding on CPU during the bridge's updates (elsewhere vLLM builds no handle either)."""
        if self.active and id(layer) in self.lookup_only and layer.weight.device.type == "cpu":
            import torch

            layer.cpu_linear = torch.nn.functional.linear
            self.skipped += 1
            return
        original(method, layer)


_PLAIN = (str, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(_plain(v) for v in value))


def loader_call_key(tensor_name: str, weight_loader: Any, arguments: dict[str, Any]) -> tuple[Any, ...] | None:
    """What decides a weight loader call's outcome when vLLM's layerwise reload runs it on meta tensors to count
    the elements it writes: the checkpoint tensor being loaded, the loader (its function, and the module it is
    bound to), each argument's shape, dtype and strides for a tensor (a meta tensor has no values) or its value
    when plain (str, int, float, bool, None, tuples of them). ``None`` when an argument is anything else: such a
    call is always counted. Pure."""
    import torch

    owner = getattr(weight_loader, "__self__", None)
    function = getattr(weight_loader, "__func__", weight_loader)
    parts: list[Any] = [tensor_name, id(owner), id(function)]
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            parts.append((name, tuple(value.shape), value.dtype, value.stride(), type(value).__name__))
        elif _plain(value):
            parts.append((name, value))
        else:
            return None
    return tuple(parts)


class LoaderCounts:
    """vLLM's layerwise reload runs every weight loader call twice: once on meta tensors, to count the elements it
    will write (``get_numel_loaded``: how it knows when a layer is complete), then for real once the layer is.
    During the bridge's updates (``active``) the first run's answer (the count and the loader's return value) is
    kept per call (``loader_call_key``) for one model, and once two updates' runs agreed on it, later updates use
    it instead of running the loader on meta tensors again: 7% of the worker's load of a 350m update on the
    2-core test VM, vLLM's Python around 243 loader calls. The real run is untouched.

    Contract: a call whose key matches gets the answer the meta run gave twice before for the same checkpoint
    tensor, loader (function and bound module) and argument shapes and values; a meta run reads no tensor
    values, so it would give it again. A loader that returns anything but a plain value, an argument that is
    not plain, or a call made outside the bridge's updates is counted by vLLM as before. The kept answers belong
    to one model (``start`` with another model forgets them): module ids are stable while it lives."""

    AGREE = 2  # meta runs that must agree before an answer is reused

    def __init__(self) -> None:
        self.active = False
        self._model: Any = None  # a weak reference to the model the answers belong to
        self.known: dict[tuple[Any, ...], tuple[int, Any, int]] = {}  # key -> (numel, return value, agreeing runs)
        self.reused = 0  # meta runs the update in progress (or the last one) skipped

    def start(self, model: Any) -> None:
        import weakref

        if self._model is None or self._model() is not model:
            self.known.clear()
            self._model = weakref.ref(model)
        self.reused = 0
        self.active = True

    def forget(self) -> None:
        """After a failed or aborted update: inactive, and nothing learned so far is reused."""
        self.active = False
        self.known.clear()

    def count(self, original: Any, weight_loader: Any, args: Any, tensor_name: str | None) -> tuple[int, Any]:
        """``get_numel_loaded(weight_loader, args)``, from what earlier updates learned where it may."""
        key = loader_call_key(tensor_name, weight_loader, args.arguments) if self.active and tensor_name is not None else None
        seen = self.known.get(key) if key is not None else None
        if seen is not None and seen[2] >= self.AGREE:
            self.reused += 1
            return seen[0], seen[1]
        numel, ret = original(weight_loader, args)
        if key is not None and _plain(ret):
            agreeing = seen[2] + 1 if seen is not None and (seen[0], seen[1]) == (numel, ret) else 1
            self.known[key] = (int(numel), ret, agreeing)
        return numel, ret


class LayerThreads:
    """During the bridge's updates (``active``: ``start`` with at least two threads), vLLM's processing of each
    layer whose loading is complete (``_layerwise_process``: materialize it, run its buffered loaders for real,
    its ``process_weights_after_loading`` (on CPU the oneDNN repacking of a linear layer, which releases the GIL),
    the copy back) runs on a pool of ``threads`` threads bound to ``cores``, while the worker's own thread goes
    on with the next tensors' loaders, across loads: on the 2-core test VM a 350m update's chain of loads took
    0.27 s on two threads against 0.43 s inline (docs/benchmarks.md).

    Contract: a layer is handed over only once its loaders counted every element (vLLM's own trigger), so no
    later call of this update touches it; each layer's processing reads and writes that layer alone (its
    buffered arguments, its tensors, its kernel handles). The buffered arguments are views of the update's
    bucket memory and keep it mapped until their layer is done (``MappedBuckets`` reports such buckets as held,
    as it does for a layer split across buckets). ``check`` raises a failure of a layer already processed (the
    session calls it after each load); ``wait`` returns once every layer handed over is done and raises the first
    failure (the session calls it before finalizing); ``stop`` waits and deactivates (an abort). Inactive,
    layers are processed inline as vLLM does."""

    def __init__(self) -> None:
        self.active = False
        self.threads = 1
        self.cores: frozenset[int] = frozenset()
        self._pool: Any = None
        self._pool_shape: tuple[int, frozenset[int]] = (1, frozenset())
        self._pending: list[Any] = []
        self.handed = 0  # layers the update in progress (or the last one) processed on the pool

    def start(self, threads: int, cores: set[int] | frozenset[int]) -> None:
        """An update of the bridge begins: ``threads`` (at least 2 to be active) bound to ``cores``."""
        self.threads, self.cores = threads, frozenset(cores)
        self.handed = 0
        self._pending = []
        self.active = threads > 1 and bool(self.cores)

    def _executor(self) -> Any:
        if self._pool is None or self._pool_shape != (self.threads, self.cores):
            import os
            from concurrent.futures import ThreadPoolExecutor

            if self._pool is not None:
                self._pool.shutdown(wait=True)
            cores = set(self.cores)
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="wb-layer",
                                            initializer=os.sched_setaffinity, initargs=(0, cores))
            self._pool_shape = (self.threads, self.cores)
        return self._pool

    QUEUED_PER_THREAD = 4  # layers handed over and not done, per thread, before the worker's thread waits

    def process(self, original: Any, layer: Any, info: Any) -> None:
        """``original(layer, info)`` inline when inactive, else on the pool; the worker's thread waits first while
        ``QUEUED_PER_THREAD`` layers per thread are not done (their buffered arguments hold bucket memory)."""
        if not self.active:
            original(layer, info)
            return
        from concurrent.futures import FIRST_COMPLETED, wait

        while len(self._pending) >= self.QUEUED_PER_THREAD * self.threads:
            wait(self._pending, return_when=FIRST_COMPLETED)
            self.check()
        self.handed += 1
        self._pending.append(self._executor().submit(original, layer, info))

    def check(self) -> None:
        """Raise the first failure among the layers already processed (without waiting for the others)."""
        done: list[Any] = []
        pending: list[Any] = []
        for future in self._pending:
            (done if future.done() else pending).append(future)
        self._pending = pending
        for future in done:
            exc = future.exception()
            if exc is not None:
                self.stop()
                raise exc

    def wait(self) -> None:
        """Every layer handed over done; the first failure raised (after all ended)."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future in pending:
            exc = future.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error

    def stop(self) -> None:
        """Inactive, after waiting for whatever was handed over (failures dropped: the caller is failing already
        or has waited)."""
        self.active = False
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the update is being aborted
            pass


_LOCK = threading.Lock()
_INSTALLED = False
RECORDER = LoadRecorder()
SCRATCH = ScratchPool()
EMBEDDING_GEMM = EmbeddingGemm()
COUNTS = LoaderCounts()
LAYERS = LayerThreads()


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
            numel, ret = COUNTS.count(original_numel, weight_loader, args, RECORDER.current if RECORDER.active else None)
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

        original_materialize_layer = layerwise.materialize_layer

        def materialize_layer(layer: Any, info: Any) -> None:
            SCRATCH.materialize_layer(original_materialize_layer, layer, info)

        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        original_embedding_step = UnquantizedEmbeddingMethod.process_weights_after_loading

        def embedding_after_loading(method: Any, layer: Any) -> None:
            EMBEDDING_GEMM.process(original_embedding_step, method, layer)

        original_process = layerwise._layerwise_process

        def layerwise_process(layer: Any, info: Any) -> None:
            LAYERS.process(original_process, layer, info)

        UnquantizedEmbeddingMethod.process_weights_after_loading = embedding_after_loading  # type: ignore[method-assign,assignment]
        layerwise._layerwise_process = layerwise_process
        layerwise.materialize_layer = materialize_layer
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
