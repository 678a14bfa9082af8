"""The bucket segments a TP worker maps while it loads an update.

Segments are mapped copy-on-write and kept from one update to the next (the receiver and the publisher
reuse theirs, and reading pages already mapped skips the page-table set-up of a fresh mapping). A bucket's
mapping is closed as soon as no tensor views it any more: vLLM's layerwise reload keeps a layer's tensors
until the layer is complete, and ``torch.frombuffer`` views do not pin the mapping (closing it under a live
view would leave the view reading unmapped memory).
"""

from __future__ import annotations

from typing import Any

from bridge.shm import AttachCache, Segment


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def views(seg: Segment, tensors: list[list[Any]]) -> list[tuple[str, Any]]:
    """``(name, tensor)`` views into ``seg`` for a bucket's ``[name, dtype, shape, offset, nbytes]`` list."""
    import torch

    out = []
    for name, dtype, shape, offset, nbytes in tensors:
        raw = torch.frombuffer(seg.mm, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else torch.empty(0, dtype=torch.uint8)
        out.append((name, raw.view(torch_dtype(dtype)).view(tuple(shape))))
    return out


def _unmapped(seg: Segment, storages: list[Any]) -> bool:
    """Unmap ``seg`` once no tensor views it: a storage referenced only by ``storages`` has a use count of 1."""
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or any(use_count(st._cdata) > 1 for st in storages):
        return False
    storages.clear()
    seg.close()
    return True


class MappedBuckets:
    """The segments of the update in progress, each with the storages of the views handed out."""

    def __init__(self) -> None:
        self.cache = AttachCache(private=True)
        self._held: list[tuple[Segment, list[Any]]] = []

    def map(self, bucket: dict[str, Any]) -> list[tuple[str, Any]]:
        """Map bucket ``{"segment", "size", "tensors"}`` and return its tensors as views."""
        seg = self.cache.attach(bucket["segment"], bucket["size"])
        out = views(seg, bucket["tensors"])
        self._held.append((seg, [t.untyped_storage() for _, t in out]))
        return out

    def release_unviewed(self) -> None:
        """Close every mapping no tensor views any more."""
        self._held = [(s, st) for s, st in self._held if not _unmapped(s, st)]

    def held(self) -> tuple[str, ...]:
        """Names of the segments still viewed (a layer not yet complete holds them)."""
        return tuple(seg.name for seg, _ in self._held)

    def close_all(self) -> None:
        """The update is over: close every mapping of it."""
        for seg, _ in self._held:
            seg.close()
        self._held = []

    def prune(self) -> None:
        """Unmap kept segments whose file is gone (call only between updates)."""
        self.cache.prune()
