"""A trainer rank's own view of what it publishes: the block of each tensor it holds (bridge/shards.py) and
the bytes of each range it sends, taken from its local shard. Nothing here gathers: a DTensor is read
through ``to_local()``, never ``full_tensor()``, so no rank holds more of a tensor than its shard.

The bytes of a rank's ranges of one tensor are consecutive slices of its local shard's row-major bytes
(``plan_ranges``' contract), so a contiguous local shard is sent as views of itself, with no copy; a
non-contiguous one is made contiguous once (a copy the size of this rank's shard of that one tensor).
The bytes are the tensor's own dtype and device: casting and the copy to host stay with the packer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from bridge import checksums
from bridge.shards import (
    LocalShard,
    RangeSpec,
    RankPlan,
    ShardError,
    local_plan,
    plan_ranges,
    shard_of_placements,
)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def is_dtensor(tensor: Any) -> bool:
    return hasattr(tensor, "to_local") and hasattr(tensor, "placements") and hasattr(tensor, "device_mesh")


def _placement(p: Any) -> tuple[str, int] | tuple[str]:
    """A torch placement as shard_of_placements takes it. A ``_StridedShard`` (a Shard subclass that is not a
    plain chunk) and ``Partial`` pass through as themselves, so they are refused there by name."""
    kind = type(p).__name__
    if kind == "Shard":
        return ("shard", int(p.dim))
    if kind == "Replicate":
        return ("replicate",)
    return (kind,)


def local_shard(name: str, tensor: Any, rank: int, replica: int | None = None) -> LocalShard:
    """The block of ``tensor`` this rank holds. A DTensor's comes from its mesh, coordinate and placements
    (ShardError where the local tensor's shape is not what torch's chunk semantics give, so an unknown
    layout is never sent as a wrong one). A plain tensor is the whole tensor, held alike by every rank:
    ``replica`` defaults to ``rank`` (rank 0 sends it); pass 0 where only this rank holds it (a pipeline
    stage's own layers)."""
    if not is_dtensor(tensor):
        shape = tuple(int(d) for d in tensor.shape)
        return LocalShard(name, _dtype_name(tensor.dtype), shape, (0,) * len(shape), shape, rank,
                          rank if replica is None else replica)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ShardError(f"tensor {name}: rank {rank} is not in the tensor's device mesh", name, (rank,))
    shard = shard_of_placements(name, _dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape),
                                tuple(int(d) for d in mesh.shape), tuple(int(c) for c in coordinate),
                                [_placement(p) for p in tensor.placements], rank)
    held = tuple(int(d) for d in tensor.to_local().shape)
    if held != shard.local_shape:
        raise ShardError(f"tensor {name}: rank {rank} holds a local shard of shape {list(held)} where placements "
                         f"{tensor.placements} give {list(shard.local_shape)}", name, (rank,))
    return shard


def _local_bytes(tensor: Any) -> Any:
    """The local shard as a flat uint8 tensor: a view when it is contiguous."""
    import torch

    local = tensor.to_local() if is_dtensor(tensor) else tensor
    local = local.detach()
    if not local.is_contiguous():
        local = local.contiguous()
    return local.reshape(-1).view(torch.uint8) if local.dim() else local.reshape(1).view(torch.uint8)


def range_views(shard: LocalShard, local: Any) -> Iterator[tuple[RangeSpec, Any]]:
    """Each range of ``plan_ranges(shard)`` (checksum 0) with its bytes: a flat uint8 view of ``local``
    (this rank's local tensor of the block, on its device), in wire order."""
    ranges = plan_ranges(shard)
    if not ranges:
        return
    flat = _local_bytes(local)
    if flat.numel() != shard.local_nbytes:
        raise ShardError(f"tensor {shard.name}: rank {shard.rank}'s local shard has {flat.numel()} bytes, its block "
                         f"{shard.local_nbytes}", shard.name, (shard.rank,))
    size = ranges[0].nbytes
    for i, r in enumerate(ranges):
        yield r, flat[i * size : (i + 1) * size]


def owned_ranges(name: str, tensor: Any, rank: int, replica: int | None = None) -> Iterator[tuple[RangeSpec, Any]]:
    """Each range this rank sends of ``tensor`` (a DTensor or a plain tensor) with its bytes (range_views)."""
    return range_views(local_shard(name, tensor, rank, replica), tensor)


def rank_plan(named: Iterable[tuple[str, Any]], rank: int, checksum: str = checksums.DEFAULT) -> tuple[RankPlan, list[Any]]:
    """This rank's plan with each range's checksum (algorithm ``checksum``) filled in, and the bytes of each
    range (flat uint8 views, in the plan's order). The sums are taken here over CPU bytes; a sender that
    packs into buckets sums as it copies instead (trainer_side/packing.py)."""
    import dataclasses

    fn = checksums.function(checksum)
    shards, ranges, views = [], [], []
    for name, tensor in named:
        shard = local_shard(name, tensor, rank)
        shards.append(shard)
        for r, view in range_views(shard, tensor):
            host = view if view.device.type == "cpu" else view.cpu()
            ranges.append(dataclasses.replace(r, checksum=int(fn(memoryview(host.numpy())))))
            views.append(view)
    headers = local_plan(rank, shards).tensors
    return RankPlan(rank, headers, tuple(ranges)), views
