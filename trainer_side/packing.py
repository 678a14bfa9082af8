"""Trainer-side packing: materialise, cast and copy named tensors into contiguous buckets."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from bridge.buckets import Placement, order_by_layer, plan_buckets
from bridge.errors import ManifestError
from bridge.wire import DTYPE_SIZES, TensorSpec


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def materialize(tensor: Any) -> Any:
    """DTensors become full tensors here, at send time. A tensor stays where it is (CPU or GPU): packing
    copies it into the host bucket."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach()


@dataclass(frozen=True)
class PackPlan:
    """Where every tensor goes. Built from shapes alone; no bytes are touched."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    placements: tuple[Placement, ...]
    bucket_sizes: tuple[int, ...]

    def bucket_members(self, index: int) -> list[int]:
        return [i for i, p in enumerate(self.placements) if p.bucket == index]


def make_plan(named: list[tuple[str, Any]], target_dtype: str, bucket_bytes: int) -> tuple[PackPlan, list[Any]]:
    """Order tensors by layer and plan buckets. Floating tensors are cast to ``target_dtype``."""
    seen: set[str] = set()
    for name, _ in named:
        if name in seen:
            raise ManifestError(f"duplicate tensor name {name!r} in the published weights")
        seen.add(name)
    order = order_by_layer([n for n, _ in named])
    names, dtypes, shapes, tensors = [], [], [], []
    for i in order:
        name, tensor = named[i]
        src = dtype_name(tensor.dtype)
        dt = target_dtype if tensor.is_floating_point() else src
        if dt not in DTYPE_SIZES:
            raise ManifestError(f"tensor {name}: dtype {dt} cannot travel")
        names.append(name)
        dtypes.append(dt)
        shapes.append(tuple(int(d) for d in tensor.shape))
        tensors.append(tensor)
    entries = [(n, DTYPE_SIZES[d] * _prod(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
    placements, sizes = plan_buckets(entries, bucket_bytes)
    return PackPlan(tuple(names), tuple(dtypes), tuple(shapes), tuple(placements), tuple(sizes)), tensors


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pack_bucket(plan: PackPlan, tensors: list[Any], index: int, out: Any,
                transform: Callable[[str, Any], Any] | None = None, checksum: str = "crc32") -> list[int]:
    """Copy the tensors of bucket ``index`` into ``out`` (a uint8 torch tensor of the bucket's size)
    and return the checksum (algorithm ``checksum``) of each tensor's bytes as written, in manifest order."""
    import torch

    from bridge.checksums import running

    fresh = None if checksum == "none" else running(checksum)
    sums = []
    for i in plan.bucket_members(index):
        name, place = plan.names[i], plan.placements[i]
        src = materialize(tensors[i])
        if transform is not None:
            src = transform(name, src)
        dst = out[place.offset : place.offset + place.nbytes]
        if not place.nbytes:  # the algorithm's value over no bytes (xxh3's is not 0)
            sums.append(0 if fresh is None else int(fresh().intdigest()))
            continue
        target = getattr(torch, plan.dtypes[i])
        if fresh is None:
            dst.view(target).view(src.shape).copy_(src)
            sums.append(0)
        else:
            sums.append(_copy_and_sum(dst, target, src, fresh()))
    return sums


PACK_CHUNK_BYTES = 1 << 20  # copied and summed while in cache: one pass over memory instead of two


def _copy_and_sum(dst: Any, target: Any, src: Any, hasher: Any) -> int:
    """Copy ``src`` into ``dst`` (uint8 bytes, read as ``target``) chunk by chunk, feeding each chunk's
    bytes to ``hasher`` right after it is written; the checksum of the whole tensor as written."""
    typed = dst.view(target)
    raw = memoryview(dst.numpy())
    if src.device.type != "cpu" and src.dim() > 0:
        return _copy_from_device_and_sum(typed, raw, src, hasher)
    if not src.is_contiguous() or src.dim() == 0:
        typed.view(src.shape).copy_(src)
        hasher.update(raw)
        return int(hasher.intdigest())
    flat = src.view(-1)
    width = typed.element_size()
    step = max(PACK_CHUNK_BYTES // width, 1)
    same = _bytes_of(flat) if flat.dtype == typed.dtype else None
    for start in range(0, flat.numel(), step):
        if same is not None:  # a plain memcpy on this thread: see _bytes_of
            raw[start * width : (start + step) * width] = same[start * width : (start + step) * width]
        else:
            typed[start : start + step].copy_(flat[start : start + step])
        hasher.update(raw[start * width : (start + step) * width])
    return int(hasher.intdigest())


def _bytes_of(flat: Any) -> memoryview | None:
    """The bytes of a contiguous CPU tensor, for copying one that needs no cast without torch: torch spreads
    each chunk's copy over its intra-op threads, which then spin between chunks, taking cores from the
    receivers verifying the buckets already sent (figures: docs/benchmarks.md). None where numpy cannot
    view it."""
    import torch

    try:
        return memoryview(flat.view(torch.uint8).numpy()).cast("B")
    except (RuntimeError, TypeError, ValueError):
        return None


DEVICE_CHUNK_BYTES = 16 << 20  # a GPU tensor comes to the host in chunks this size, one copying while one is summed
_device_copier: Any = None


def _copy_from_device_and_sum(typed: Any, raw: memoryview, src: Any, hasher: Any) -> int:
    """A tensor on an accelerator (a trainer's GPU): a helper thread copies it to the host chunk by chunk
    (cast on the device on the way) while this thread sums the chunk before, so the copy and the checksum
    overlap (figures: docs/benchmarks.md). A strided GPU tensor is made contiguous on the GPU first (one
    temporary of its size there)."""
    from concurrent.futures import ThreadPoolExecutor

    global _device_copier
    if _device_copier is None:
        _device_copier = ThreadPoolExecutor(1, thread_name_prefix="wb-device-copy")
    flat = src.contiguous().view(-1)  # a strided view becomes contiguous on the device
    width = typed.element_size()
    step = max(DEVICE_CHUNK_BYTES // width, 1)
    spans = [(start, min(start + step, flat.numel())) for start in range(0, flat.numel(), step)]

    def copy(span: tuple[int, int]) -> None:
        typed[span[0] : span[1]].copy_(flat[span[0] : span[1]])

    pending = _device_copier.submit(copy, spans[0]) if spans else None
    for i, (start, end) in enumerate(spans):
        assert pending is not None
        pending.result()  # chunk i is on the host (the copy's errors surface here)
        pending = _device_copier.submit(copy, spans[i + 1]) if i + 1 < len(spans) else None
        hasher.update(raw[start * width : end * width])
    return int(hasher.intdigest())


def plan_specs(plan: PackPlan) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(n, d, s, p.bucket, p.offset, p.nbytes)
        for n, d, s, p in zip(plan.names, plan.dtypes, plan.shapes, plan.placements, strict=True)
    )


def iter_named(weights: Iterable[tuple[str, Any]] | Any) -> Iterator[tuple[str, Any]]:
    """Accept ``named_parameters()``, a state dict, or any iterable of (name, tensor)."""
    if hasattr(weights, "items"):
        return iter(weights.items())
    return iter(weights)
