"""Pure functions: layer ordering and bucket packing plans. No torch, no I/O."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from bridge.wire import ALIGN

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The transformer layer a checkpoint name belongs to, or None (embeddings, final norm, head)."""
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def layer_order_key(name: str) -> tuple[int, int, str]:
    """Embeddings first, then layers in order, then everything else (norm, lm_head).

    Within a layer names keep their original relative order via the caller's stable sort.
    """
    idx = layer_index(name)
    if idx is not None:
        return (1, idx, "")
    if "embed" in name:
        return (0, 0, "")
    return (2, 0, "")


def order_by_layer(names: Sequence[str]) -> list[int]:
    """Indices of ``names`` in layer order (stable within a layer)."""
    return sorted(range(len(names)), key=lambda i: layer_order_key(names[i]))


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Placement:
    name: str
    bucket: int
    offset: int
    nbytes: int


def plan_buckets(entries: Sequence[tuple[str, int]], bucket_bytes: int) -> tuple[list[Placement], list[int]]:
    """Pack ``(name, nbytes)`` entries, in the given order, into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. Offsets are aligned to ``ALIGN``.
    Returns the placements (same order as entries) and each bucket's size in bytes.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    placements: list[Placement] = []
    sizes: list[int] = []
    cursor = 0
    for name, nbytes in entries:
        if nbytes < 0:
            raise ValueError(f"tensor {name}: negative size {nbytes}")
        start = align_up(cursor)
        if not sizes or (start + nbytes > bucket_bytes and cursor > 0):
            sizes.append(0)
            start = 0
        placements.append(Placement(name, len(sizes) - 1, start, nbytes))
        cursor = start + nbytes
        sizes[-1] = cursor
    return placements, sizes
